"""Which prefill worker probably holds which prompt prefixes: the router's side of prefix caching.

The router cannot see the workers' caches; it remembers what it sent. Prompts are cut into chunks
of `chunk_tokens` tokens, each named by a hash chain (the key of chunk c covers every token up to
its end, as in the workers' caches), and every key records the workers it was sent to. A worker's
keys are kept in least-recently-sent order and dropped past `capacity_tokens`, roughly what its
cache holds, deepest chunks first. The answer is approximate both ways (the worker may have
evicted a prefix, or cached one more page), which is all routing needs: the worker's own cache is
the authority on what is reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence


def chunk_keys(tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    keys, prev = [], b""
    for c in range(len(tokens) // chunk_tokens):
        chunk = array("i", tokens[c * chunk_tokens:(c + 1) * chunk_tokens]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixIndex:
    def __init__(self, chunk_tokens: int = 16, capacity_tokens: int = 65536) -> None:
        if chunk_tokens < 1 or capacity_tokens < chunk_tokens:
            raise ValueError("chunk_tokens must be >= 1 and capacity_tokens >= chunk_tokens")
        self.chunk_tokens = chunk_tokens
        self.capacity_chunks = capacity_tokens // chunk_tokens
        self._holders: dict[bytes, set[str]] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, worker: str, tokens: Sequence[int]) -> None:
        """`worker` was sent `tokens`: it now (probably) caches their complete chunks."""
        keys = chunk_keys(tokens, self.chunk_tokens)
        lru = self._lru.setdefault(worker, OrderedDict())
        for key in reversed(keys):  # the shortest prefix ends most recent: it is evicted last
            self._holders.setdefault(key, set()).add(worker)
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity_chunks:
            key, _ = lru.popitem(last=False)
            self._drop(key, worker)

    def forget(self, worker: str) -> None:
        """The worker lost its cache (restarted, removed)."""
        for key in self._lru.pop(worker, OrderedDict()):
            self._drop(key, worker)

    def match(self, tokens: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Tokens of the longest recorded prefix of `tokens` per worker (0 when none)."""
        out = {w: 0 for w in workers}
        alive = set(out)
        for c, key in enumerate(chunk_keys(tokens, self.chunk_tokens)):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            for w in alive:
                out[w] = (c + 1) * self.chunk_tokens
        return out

    def _drop(self, key: bytes, worker: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[key]
