"""Incremental detokenization for streamed plain-text completions.

A token can end in the middle of a UTF-8 character; decoding it alone gives U+FFFD. We decode a
small window of recent ids and emit only text that is complete, as later tokens make it so.
"""

from __future__ import annotations

from typing import Callable

_INCOMPLETE = "\ufffd"
_MAX_HELD_TOKENS = 8  # a UTF-8 character spans <= 4 bytes; more held ids means truly invalid bytes


class IncrementalDetokenizer:
    """`push(ids)` returns the new text those ids completed; `flush()` returns what is left.

    `prefix` marks where the window starts (ids before it are settled text), `read` where the
    already emitted text ends. Decoding `ids[prefix:]` and subtracting the text of
    `ids[prefix:read]` keeps merges across the boundary right without decoding everything again.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        settled = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if len(text) <= len(settled) or (text.endswith(_INCOMPLETE) and held < _MAX_HELD_TOKENS):
            return ""  # wait for the rest of a multi-byte character
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(settled):]

    def flush(self) -> str:
        settled = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(settled):]
