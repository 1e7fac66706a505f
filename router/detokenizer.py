"""Incremental detokenization for streamed plain-text completions.

A token can end in the middle of a UTF-8 character; decoding it alone gives U+FFFD. We feed
the ids' raw bytes through Python's incremental UTF-8 decoder, which holds back only the
bytes of an unfinished character and replaces bytes that can never form one, so the streamed
pieces join to exactly the text of decoding all ids at once.
"""

from __future__ import annotations

import codecs
from typing import Callable


class IncrementalDetokenizer:
    """`push(ids)` returns the new text those ids completed; `flush()` returns what is left."""

    def __init__(self, decode_bytes: Callable[[list[int]], bytes]) -> None:
        self._decode_bytes = decode_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._utf8.decode(self._decode_bytes(token_ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
