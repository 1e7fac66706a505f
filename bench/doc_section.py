"""One marked section of a markdown results file (docs/performance.md), replaced in place.

Each benchmark owns the text between its `<!-- name:begin -->` and `<!-- name:end -->` markers;
re-running it replaces that text (markers included) and leaves the rest of the file alone.
"""

from __future__ import annotations

import os
from pathlib import Path


def replace_section(doc: Path, begin: str, end: str, section: str) -> None:
    """Put `section` (which starts with `begin` and ends with `end`) in place of the marked text,
    or append it when the file has no such section; the file is written atomically."""
    doc = Path(doc)
    text = doc.read_text() if doc.is_file() else "# Performance\n"
    if begin in text and end in text and text.index(begin) < text.index(end):
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)
