"""Prefix cache: the KV pages of earlier prompts, found again by a hash chain of their tokens.

Page p of a prompt (its tokens [p * page_size, (p + 1) * page_size)) is cached under
key_p = H(key_{p-1} || tokens of page p), so one key names the whole prefix up to that page's end
and two prompts share an entry exactly when they share every token before it. Only complete pages
are cached. An entry holds the page's full-attention block and, while the pool can spare it, its
sliding-window block.

A cached prefix of k pages is usable when the full blocks of all k pages are cached and the
sliding blocks of the pages a query at position k * page_size can still see (the window at its
end) are too: the next position's sliding layers need exactly those, its full layers need all.
A match is backed off to the longest prefix that has its window, and always leaves at least one
token to compute (the first sampled token needs the last position's logits).

Blocks come from the same `PagedKVCache` pool the prompt runs in (one allocator serves both layer
groups). A request holding a match (a `PrefixLease`) pins its entries (exact reference counts);
unpinned entries give blocks back only when the pool runs short, least recently used first, in two
classes:
1. sliding blocks of pages in no *protected* window (the page keeps its full block and still
   serves longer prefixes). Protected are the windows where the next match will likely end, read
   off the shape of the chains: at a leaf (the end of a cached prompt, where a conversation's next
   turn resumes; with the window one page earlier, where an exact repeat ends) and at a branch
   (where cached prompts diverge, as after a shared system prompt). A page inside a chain that
   one longer prompt extends is neither: when a conversation's next turn is cached, the window at
   its previous end stops being protected;
2. whole entries from the leaves of the chain (so a chain never has a hole; among equally recent
   pages the deepest goes first), their sliding blocks with them.
So under pressure a conversation first loses the windows in its middle, which no continuation
reads, and keeps the one its next turn needs.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from dataclasses import dataclass, field

from .kv_cache import KVCacheFull, PagedKVCache, SeqBlocks, cdiv, sliding_first_page


@dataclass(eq=False)
class _Entry:
    key: bytes
    page: int
    parent: "_Entry | None"
    full_block: int
    sliding_block: int | None
    refs: int = 0
    children: int = 0
    last_used: int = 0
    alive: bool = True
    protected: int = 0  # protected windows (at a leaf or a branch) this page lies in: sliding kept


def _blocks(e: _Entry) -> int:
    """Blocks an entry holds: its full block and, where it kept one, its sliding block."""
    return 1 + (e.sliding_block is not None)


@dataclass(eq=False)
class PrefixLease:
    """One prompt's hold on the cache: its blocks (cached prefix first, then its own) and pins.

    num_cached : prompt positions whose KV is already in `blocks` (prefill starts there).
    blocks : the table to prefill into (sliding table starting at the window of num_cached).
    """

    tokens: list[int]
    keys: list[bytes]
    num_cached: int
    blocks: SeqBlocks
    pinned: list[_Entry]
    own_full: list[int] = field(default_factory=list)  # taken for this prompt, not (yet) cached
    own_sliding: list[int] = field(default_factory=list)
    released: bool = False


def chain_keys(tokens: list[int], page_size: int, num_pages: int) -> list[bytes]:
    """Hash-chain keys of the first `num_pages` complete pages of `tokens`."""
    keys, prev = [], b""
    for p in range(num_pages):
        page = array("i", tokens[p * page_size:(p + 1) * page_size]).tobytes()
        prev = hashlib.blake2b(prev + page, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    def __init__(self, kv: PagedKVCache, *, enabled: bool = True):
        self.kv = kv
        self.page_size = kv.page_size
        self.enabled = enabled
        self._entries: dict[bytes, _Entry] = {}
        self._clock = itertools.count(1)
        self._order = itertools.count()
        self._evict_full: list[tuple] = []  # lazy heaps of (last_used, -page, n, entry): leaves
        self._evict_sliding: list[tuple] = []  # and idle unprotected entries holding a sliding block
        self.evicted_blocks = 0
        self._pinned = 0  # entries with refs > 0
        self._idle_blocks = 0  # blocks of the entries with refs == 0

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        return len(self._entries)

    def num_pinned_pages(self) -> int:
        return self._pinned

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks of the cached pages no prompt holds: as good as free (a full block each, and
        its sliding block where the entry kept one)."""
        return self._idle_blocks

    def cached_blocks(self) -> dict[str, set[int]]:
        """Blocks owned by cache entries, per pool (for accounting checks)."""
        out = {"full": {e.full_block for e in self._entries.values()}}
        if self.kv.has_sliding:
            out["sliding"] = {e.sliding_block for e in self._entries.values() if e.sliding_block is not None}
        return out

    # -- per prompt -------------------------------------------------------------------------------
    def acquire(self, tokens: list[int], *, reuse: bool = True) -> PrefixLease:
        """Pin the longest usable cached prefix of `tokens` and take blocks for the rest of the
        prompt (evicting unpinned entries as needed); KVCacheFull, holding nothing, when the pool
        cannot hold the prompt even after evicting everything unpinned. `reuse=False` matches
        nothing (a prompt whose every position needs its logits) but may still fill the cache."""
        n, ps = len(tokens), self.page_size
        if n < 1:
            raise ValueError("empty prompt")
        keys = chain_keys(tokens, ps, n // ps)
        matched: list[_Entry] = []
        if self.enabled and reuse:
            for key in keys[:(n - 1) // ps]:
                e = self._entries.get(key)
                if e is None:
                    break
                matched.append(e)
            matched = matched[:self._usable(matched)]
        k = len(matched)
        now = next(self._clock)
        for e in matched:
            if e.refs == 0:
                self._pinned += 1
                self._idle_blocks -= _blocks(e)
            e.refs += 1
            e.last_used = now
        pages = cdiv(n, ps)
        try:
            own = self._allocate((pages - k) * (2 if self.kv.has_sliding else 1))
        except KVCacheFull:
            self._unpin(matched)
            raise
        own_full, own_sliding = own[:pages - k], own[pages - k:]
        first = sliding_first_page(k * ps, self.kv.window, ps) if self.kv.has_sliding else 0
        blocks = SeqBlocks(
            full=[e.full_block for e in matched] + own_full,
            sliding=[e.sliding_block for e in matched[first:]] if self.kv.has_sliding else [],
            sliding_first_page=first, sliding_spare=list(own_sliding),
            sliding_quota=pages, max_tokens=n)
        return PrefixLease(list(tokens), keys, k * ps, blocks, matched, own_full, list(own_sliding))

    def release(self, lease: PrefixLease, computed: bool) -> None:
        """Give the prompt's hold back. `computed`: its prefill ran to the end (with
        `ModelRunner.prefill(..., finish=False)`), so its complete pages join the cache;
        otherwise, and for the partial last page, its own blocks go back to the pool."""
        if lease.released:
            return
        lease.released = True
        if computed and self.enabled:
            self._insert(lease)
        self._unpin(lease.pinned)
        self.kv.allocator.free(lease.own_full + lease.own_sliding)
        lease.own_full, lease.own_sliding, lease.pinned = [], [], []
        lease.blocks.full, lease.blocks.sliding, lease.blocks.sliding_spare = [], [], []

    def clear(self) -> int:
        """Evict every unpinned entry; the number of blocks freed."""
        before = self.evicted_blocks
        while self._evict_one_full():
            pass
        return self.evicted_blocks - before

    # -- internals --------------------------------------------------------------------------------
    def _usable(self, matched: list[_Entry]) -> int:
        """Longest k <= len(matched) whose window at its end has every sliding block."""
        if not self.kv.has_sliding:
            return len(matched)
        k = len(matched)
        while k > 0:
            first = sliding_first_page(k * self.page_size, self.kv.window, self.page_size)
            missing = [p for p in range(first, k) if matched[p].sliding_block is None]
            if not missing:
                return k
            k = missing[-1]  # a window ending at or before the missing page may still be whole
        return 0

    def _insert(self, lease: PrefixLease) -> None:
        blocks, ps = lease.blocks, self.page_size
        k = lease.num_cached // ps
        parent = lease.pinned[-1] if lease.pinned else None
        now = next(self._clock)
        adopted_full, adopted_sliding = set(), set()
        chain = list(lease.pinned)
        new_leaf = None
        for p in range(k, len(lease.keys)):
            full = blocks.full[p]
            sliding = None
            if self.kv.has_sliding:
                i = p - blocks.sliding_first_page
                sliding = blocks.sliding[i] if 0 <= i < len(blocks.sliding) else None
            e = self._entries.get(lease.keys[p])
            if e is None:  # new pages are the chain's tail (a new key's successors are new)
                e = _Entry(lease.keys[p], p, parent, full, sliding, last_used=now)
                self._entries[e.key] = e
                self._idle_blocks += _blocks(e)
                if parent is not None and parent is new_leaf:
                    parent.children += 1  # inside the new tail: protected only at its end, below
                elif parent is not None:
                    self._add_children(parent, 1)
                adopted_full.add(full)
                adopted_sliding.add(sliding)
                new_leaf = e
            else:  # recomputed (match backed off or capped): keep the entry, fill its window gap
                e.last_used = now
                if e.sliding_block is None and sliding is not None:
                    e.sliding_block = sliding
                    self._idle_blocks += e.refs == 0
                    adopted_sliding.add(sliding)
            chain.append(e)
            parent = e
        if new_leaf is not None:  # the tail's inner pages have one child each: only its end is a leaf
            self._protect(new_leaf, self._role(new_leaf), +1)
        for e in chain[k:]:
            if e.refs == 0:
                self._push_evictable(e)
        lease.own_full = [b for b in lease.own_full if b not in adopted_full]
        lease.own_sliding = [b for b in lease.own_sliding if b not in adopted_sliding]

    def _unpin(self, entries: list[_Entry]) -> None:
        for e in reversed(entries):  # deepest first: equal times evict the deepest page first
            e.refs -= 1
            if e.refs < 0:
                raise RuntimeError(f"prefix cache page {e.page} unpinned twice")
            self._pinned -= e.refs == 0
            if e.refs == 0 and e.alive:
                self._idle_blocks += _blocks(e)
                self._push_evictable(e)

    def _push_evictable(self, e: _Entry) -> None:
        item = (e.last_used, -e.page, next(self._order), e)
        if e.children == 0:
            heapq.heappush(self._evict_full, item)
        if e.sliding_block is not None and not e.protected:
            heapq.heappush(self._evict_sliding, item)
        live = 4 * len(self._entries) + 64
        if len(self._evict_full) > live or len(self._evict_sliding) > live:
            self._compact()

    def _compact(self) -> None:
        def keep(heap, ok):
            heap[:] = [it for it in heap if ok(it)]
            heapq.heapify(heap)

        keep(self._evict_full, lambda it: self._can_evict_full(it))
        keep(self._evict_sliding, lambda it: self._can_evict_sliding(it))

    @staticmethod
    def _fresh(item) -> bool:
        e = item[3]
        return e.alive and e.refs == 0 and e.last_used == item[0]

    def _can_evict_full(self, item) -> bool:
        return self._fresh(item) and item[3].children == 0

    def _can_evict_sliding(self, item) -> bool:
        return self._fresh(item) and item[3].sliding_block is not None and not item[3].protected

    def _evict_one_full(self) -> bool:
        while self._evict_full:
            item = heapq.heappop(self._evict_full)
            if not self._can_evict_full(item):
                continue
            e = item[3]
            e.alive = False  # first: the protection it drops below must not queue the page itself
            self._protect(e, self._role(e), -1)
            del self._entries[e.key]
            self.kv.allocator.free([e.full_block])
            self._idle_blocks -= 1
            self.evicted_blocks += 1
            if e.sliding_block is not None:
                self.drop_sliding(e)
            if e.parent is not None:
                self._add_children(e.parent, -1)
                if e.parent.children == 0 and e.parent.refs == 0 and e.parent.alive:
                    heapq.heappush(self._evict_full, (e.parent.last_used, -e.parent.page, next(self._order), e.parent))
            return True
        return False

    def _evict_one_sliding(self) -> bool:
        while self._evict_sliding:
            item = heapq.heappop(self._evict_sliding)
            if not self._can_evict_sliding(item):
                continue
            self.drop_sliding(item[3])
            return True
        return False

    def drop_sliding(self, e: _Entry) -> None:
        """Give an entry's sliding block back (no prompt holds the entry); its page still serves
        longer prefixes, not one whose window reaches it."""
        if e.refs or e.sliding_block is None:
            raise RuntimeError(f"prefix cache page {e.page}: no idle sliding block to drop")
        self.kv.allocator.free([e.sliding_block])
        e.sliding_block = None
        self._idle_blocks -= 1

    @staticmethod
    def _role(e: _Entry) -> str | None:
        """Where matches will likely end: a leaf (a cached prompt's end), a branch (prompts
        diverge after it), or neither (one longer prompt goes on)."""
        return "leaf" if e.children == 0 else "branch" if e.children > 1 else None

    def _add_children(self, e: _Entry, delta: int) -> None:
        """Count a child linked (+1) or evicted (-1), moving the protection of the windows at e."""
        before = self._role(e)
        e.children += delta
        after = self._role(e)
        if after != before:
            self._protect(e, before, -1)
            self._protect(e, after, +1)

    def _protect(self, end: _Entry, role: str | None, delta: int) -> None:
        """Add `delta` to the protection of the pages the window at `end` covers (as a branch:
        a query right after it; as a leaf: also one a page earlier, where an exact repeat of
        a page-aligned prompt ends); a page left unprotected may give its sliding block."""
        if role is None or not self.kv.has_sliding:
            return
        depth = end.page + 1 - (role == "leaf")
        pages = end.page + 1 - sliding_first_page(depth * self.page_size, self.kv.window, self.page_size)
        e = end
        for _ in range(pages):
            e.protected += delta
            if not e.protected and e.refs == 0 and e.alive and e.sliding_block is not None:
                self._push_evictable(e)
            e = e.parent

    def _allocate(self, count: int) -> list[int]:
        alloc = self.kv.allocator
        while alloc.num_free < count and (self._evict_one_sliding() or self._evict_one_full()):
            pass
        return alloc.allocate(count)  # KVCacheFull when even eviction left too few
