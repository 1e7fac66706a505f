"""KV block bookkeeping: which blocks a request holds, which are free, when a freed one may be
reused. No tensors here: `kv_cache.PagedKVCache` adds the pools these block ids index.

A request's pages live in two layer groups (full-attention and sliding-window layers) whose blocks
come from one pool: a block holds one page of every layer of the group it serves, so the memory a
sliding page does not need is there for full pages (gpt-oss: half the layers slide over 128 keys; a
request of thousands of tokens needs a few sliding pages and hundreds of full ones). A request owns
- full blocks for every page it can ever reach (prompt + max new tokens), taken at admission, so a
  running request never waits for memory;
- a fixed quota of sliding blocks, enough for the pages a window of `sliding_window` keys can
  span; pages that slide out of every future query's window are recycled to its end.
A local prefill of a prompt longer than the window briefly needs sliding blocks for the whole
prompt; they are taken from the pool and returned right after (`finish_prefill`).

Sharing: the choices of an n > 1 request read the prompt's complete pages from the same blocks
(`fork`); a block with several holders counts them, and `free` returns it to the pool only when the
last holder lets go. A choice owns a copy of the prompt's last, partial page and its own sliding
pages (they are rewritten as the window slides).

Reuse: a block freed while a remote writer (a prefill worker's NIXL write) may still land in it is
freed under a *fence* (any hashable key, e.g. the request id): it stays out of the free list until
`lift_fence(key)`, which the owner calls once every transfer into it has ended.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Hashable

import torch


class KVCacheFull(RuntimeError):
    """Not enough free blocks: the caller should refuse or queue the request (backpressure)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_first_page(next_pos: int, window: int, page_size: int) -> int:
    """First page a query at `next_pos` (or later) can still see in a `window`-key window."""
    return max(0, next_pos - window + 1) // page_size


def runs(ids) -> list[tuple[int, int]]:
    """Sorted ids as maximal runs of consecutive ids, [start, end)."""
    out: list[tuple[int, int]] = []
    for b in sorted(ids):
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


class BlockAllocator:
    """The blocks of the pool: free, in use, or fenced (freed, not yet reusable).

    Free blocks are kept as sorted runs of consecutive ids; `allocate(n)` hands out one run when a
    long enough one exists (the smallest that fits), else the longest runs first, so a request's
    pages are mostly consecutive (consecutive blocks fuse into one transfer descriptor).
    """

    def __init__(self, num_blocks: int):
        self.num_total = num_blocks
        self._starts: list[int] = [0] if num_blocks else []  # free runs [start, end), sorted
        self._ends: list[int] = [num_blocks] if num_blocks else []
        self._num_free = num_blocks
        self._used: set[int] = set()
        self._refs: dict[int, int] = {}  # holders of blocks held more than once (absent: one)
        self._fenced: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_fenced(self) -> int:
        return sum(len(v) for v in self._fenced.values())

    def fences(self) -> list[Hashable]:
        return list(self._fenced)

    def is_free(self, block: int) -> bool:
        i = bisect.bisect_right(self._starts, block) - 1
        return i >= 0 and block < self._ends[i]

    def allocate(self, n: int) -> list[int]:
        if n > self._num_free:
            raise KVCacheFull(f"need {n} KV blocks, {self._num_free} free of {self.num_total}"
                              + (f" ({self.num_fenced} fenced until transfers into them end)"
                                 if self._fenced else ""))
        if n <= 0:
            return []
        fit = [(e - s, i) for i, (s, e) in enumerate(zip(self._starts, self._ends)) if e - s >= n]
        if fit:
            order = [min(fit)[1]]
        else:
            order = sorted(range(len(self._starts)), key=lambda i: self._starts[i] - self._ends[i])
        out: list[int] = []
        taken: list[int] = []
        for i in order:
            s, e = self._starts[i], self._ends[i]
            k = min(n - len(out), e - s)
            out.extend(range(s, s + k))
            if s + k == e:
                taken.append(i)
            else:
                self._starts[i] = s + k
            if len(out) == n:
                break
        for i in sorted(taken, reverse=True):
            del self._starts[i], self._ends[i]
        self._num_free -= n
        self._used.update(out)
        return out

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one holder."""
        return len(self._refs)

    def share(self, blocks) -> None:
        """One more holder for each of `blocks` (in use); each holder frees them once."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"KV block {b} is not in use: it cannot be shared")
        for b in blocks:
            self._refs[b] = self._refs.get(b, 1) + 1

    def free(self, blocks, fence: Hashable | None = None) -> None:
        """Give blocks back (a shared block: one holder's hold); under `fence` they are not
        reusable until `lift_fence(fence)`."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"KV block {b} freed twice or never allocated")
        last = []
        for b in blocks:
            holders = self._refs.get(b, 1)
            if holders > 2:
                self._refs[b] = holders - 1
            elif holders == 2:
                del self._refs[b]
            else:
                last.append(b)
        blocks = last
        self._used.difference_update(blocks)
        if fence is not None:
            self._fenced.setdefault(fence, []).extend(blocks)
        else:
            self._insert(blocks)

    def lift_fence(self, fence: Hashable) -> int:
        """Make the blocks freed under `fence` reusable; returns how many (0 for unknown fences)."""
        blocks = self._fenced.pop(fence, [])
        self._insert(blocks)
        return len(blocks)

    def _insert(self, blocks: list[int]) -> None:
        for s, e in runs(blocks):
            i = bisect.bisect_left(self._starts, s)
            if i > 0 and self._ends[i - 1] > s or i < len(self._starts) and self._starts[i] < e:
                raise RuntimeError(f"KV blocks [{s}, {e}) are already free")
            if i > 0 and self._ends[i - 1] == s:  # join the run before
                i -= 1
                self._ends[i] = e
            else:
                self._starts.insert(i, s)
                self._ends.insert(i, e)
            if i + 1 < len(self._starts) and self._starts[i + 1] == self._ends[i]:  # and after
                self._ends[i] = self._ends[i + 1]
                del self._starts[i + 1], self._ends[i + 1]
            self._num_free += e - s


@dataclass
class SeqBlocks:
    """The blocks one request holds. Page p of a full layer is full[p]; of a sliding layer it is
    sliding[p - sliding_first_page]."""

    full: list[int]
    sliding: list[int] = field(default_factory=list)
    sliding_first_page: int = 0
    sliding_spare: list[int] = field(default_factory=list)  # owned, not yet in the table
    sliding_quota: int = 0
    max_tokens: int = 0

    def owned_sliding(self) -> list[int]:
        return self.sliding + self.sliding_spare


class KVBlockManager:
    """Per-request block tables of the full-attention layers and (when the model has
    sliding-window layers: `window` > 0) of the sliding ones, over one pool of `num_blocks`."""

    def __init__(self, *, page_size: int, num_blocks: int, window: int = 0):
        if page_size < 1 or num_blocks < 1:
            raise ValueError("page_size and num_blocks must be positive")
        if window < 0:
            raise ValueError(f"window must be >= 0 (0: no sliding-window layers), got {window}")
        self.page_size = page_size
        self.window = window
        self.allocator = BlockAllocator(num_blocks)

    # -- sizing ---------------------------------------------------------------------------------
    @property
    def has_sliding(self) -> bool:
        return self.window > 0

    @property
    def sliding_window_pages(self) -> int:
        """The most sliding blocks a request keeps (0: no sliding layers)."""
        return cdiv(self.window, self.page_size) + 1 if self.has_sliding else 0

    def sliding_quota(self, max_tokens: int) -> int:
        """Sliding blocks a request keeps: the pages `window` consecutive keys can span."""
        return min(self.sliding_window_pages, cdiv(max_tokens, self.page_size))

    def blocks_needed(self, max_tokens: int, local_prompt_tokens: int = 0) -> tuple[int, int]:
        """(full, sliding) blocks a request of up to `max_tokens` positions needs at admission;
        a local prefill of `local_prompt_tokens` needs its whole prompt in sliding pages too."""
        full = cdiv(max_tokens, self.page_size)
        sliding = self.sliding_quota(max_tokens)
        if self.has_sliding and local_prompt_tokens:
            sliding = max(sliding, cdiv(local_prompt_tokens, self.page_size))
        return full, sliding

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def num_fenced_blocks(self) -> int:
        return self.allocator.num_fenced

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    def can_admit(self, max_tokens: int, local_prompt_tokens: int = 0) -> bool:
        return sum(self.blocks_needed(max_tokens, local_prompt_tokens)) <= self.allocator.num_free

    def _short(self, what: str, full: int, sliding: int) -> KVCacheFull:
        a = self.allocator
        fenced = f" ({a.num_fenced} fenced until transfers into them end)" if a.num_fenced else ""
        return KVCacheFull(f"{what} needs {full} full + {sliding} sliding KV blocks; "
                           f"{a.num_free} of {a.num_total} free{fenced}")

    # -- per request ----------------------------------------------------------------------------
    def reserve(self, max_tokens: int, local_prompt_tokens: int = 0) -> SeqBlocks:
        """Take every block the request needs up front, or raise KVCacheFull taking none."""
        full, sliding = self.blocks_needed(max_tokens, local_prompt_tokens)
        if full + sliding > self.allocator.num_free:
            raise self._short("request", full, sliding)
        seq = SeqBlocks(full=self.allocator.allocate(full), max_tokens=max_tokens)
        if self.has_sliding:
            seq.sliding_spare = self.allocator.allocate(sliding)
            seq.sliding_quota = self.sliding_quota(max_tokens)
        return seq

    def reserve_choice(self, num_prompt_tokens: int, max_tokens: int) -> SeqBlocks:
        """The blocks one more choice of a request needs besides the prompt's complete pages,
        which it will share (`fork`): its pages from the prompt's last one to `max_tokens`, and its
        own sliding quota. KVCacheFull taking none."""
        full = cdiv(max_tokens, self.page_size) - num_prompt_tokens // self.page_size
        sliding = self.sliding_quota(max_tokens)
        if full + sliding > self.allocator.num_free:
            raise self._short("another choice", full, sliding)
        seq = SeqBlocks(full=self.allocator.allocate(full), max_tokens=max_tokens)
        if self.has_sliding:
            seq.sliding_spare = self.allocator.allocate(sliding)
            seq.sliding_quota = sliding
        return seq

    def fork(self, parent: SeqBlocks, child: SeqBlocks, num_tokens: int) -> dict[str, list[tuple[int, int]]]:
        """Make `child` (from `reserve_choice`) continue `parent` after its first `num_tokens`
        positions: it shares the complete pages and gets copies of the partial last page and of
        the sliding pages in the parent's table. Returns the block copies, pool -> [(source,
        destination)], that must run on the KV before either writes (ModelRunner.decode)."""
        shared = num_tokens // self.page_size
        own = child.full
        child.full = parent.full[:shared] + own
        self.allocator.share(parent.full[:shared])
        copies: dict[str, list[tuple[int, int]]] = {"full": []}
        if num_tokens % self.page_size:
            copies["full"].append((parent.full[shared], own[0]))
        if self.has_sliding:
            n = len(parent.sliding)
            if n > len(child.sliding_spare):
                raise KVCacheFull(f"a forked choice needs {n} sliding blocks, it holds {len(child.sliding_spare)}")
            child.sliding, child.sliding_spare = child.sliding_spare[:n], child.sliding_spare[n:]
            child.sliding_first_page = parent.sliding_first_page
            copies["sliding"] = list(zip(parent.sliding, child.sliding))
        return copies

    def release(self, seq: SeqBlocks, fence: Hashable | None = None) -> None:
        """Give back every block of `seq`; under `fence`, see `lift_fence`."""
        self.allocator.free(seq.full + seq.owned_sliding(), fence)
        seq.full, seq.sliding, seq.sliding_spare = [], [], []

    def lift_fence(self, fence: Hashable) -> int:
        """Blocks released under `fence` become reusable (every write into them has ended)."""
        return self.allocator.lift_fence(fence)

    def prepare(self, seq: SeqBlocks, start: int, num_tokens: int, *, slide: bool = True) -> dict[str, torch.Tensor]:
        """Make pages for positions [start, start + num_tokens) writable; return the flat slot
        (block * page_size + offset) of each position in each pool. `slide=False` keeps the
        sliding pages before the window of `start` in the table (a chunked prefill's later chunks:
        the prefix cache adopts every page)."""
        end = start + num_tokens
        self._make_writable(seq, start, end, slide)
        pos = torch.arange(start, end)
        page, off = pos // self.page_size, pos % self.page_size
        slots = {"full": torch.tensor(seq.full)[page] * self.page_size + off}
        if self.has_sliding:
            table = torch.tensor(seq.sliding)
            slots["sliding"] = table[page - seq.sliding_first_page] * self.page_size + off
        return slots

    def prepare_one(self, seq: SeqBlocks, pos: int) -> dict[str, int]:
        """`prepare` for the one position of a decode step, in plain ints: a decode step of a
        large batch calls this per request, where tensor ops cost ~60 us of host time each."""
        self._make_writable(seq, pos, pos + 1)
        page, off = divmod(pos, self.page_size)
        slots = {"full": seq.full[page] * self.page_size + off}
        if self.has_sliding:
            slots["sliding"] = seq.sliding[page - seq.sliding_first_page] * self.page_size + off
        return slots

    def _make_writable(self, seq: SeqBlocks, start: int, end: int, slide: bool = True) -> None:
        if end > len(seq.full) * self.page_size:
            raise KVCacheFull(f"position {end - 1} is beyond the {len(seq.full)} reserved blocks")
        if self.has_sliding:
            if slide or not seq.sliding:
                self._slide(seq, start)
            last_page = (end - 1) // self.page_size
            while seq.sliding_first_page + len(seq.sliding) <= last_page:
                if not seq.sliding_spare:
                    raise KVCacheFull("sliding-window pages exhausted (prefill not reserved locally)")
                seq.sliding.append(seq.sliding_spare.pop(0))

    def _slide(self, seq: SeqBlocks, next_pos: int) -> None:
        first = sliding_first_page(next_pos, self.window, self.page_size)
        while seq.sliding and seq.sliding_first_page < first:
            seq.sliding_spare.append(seq.sliding.pop(0))
            seq.sliding_first_page += 1
        if not seq.sliding:
            seq.sliding_first_page = max(seq.sliding_first_page, first)

    def finish_prefill(self, seq: SeqBlocks, next_pos: int) -> None:
        """After a local prefill: drop pages out of the window and give back blocks beyond the
        request's quota."""
        if not self.has_sliding:
            return
        self._slide(seq, next_pos)
        excess = len(seq.owned_sliding()) - max(seq.sliding_quota, len(seq.sliding))
        if excess > 0:
            give = seq.sliding_spare[len(seq.sliding_spare) - excess :]
            del seq.sliding_spare[len(seq.sliding_spare) - excess :]
            self.allocator.free(give)

    def transfer_targets(self, seq: SeqBlocks, num_tokens: int) -> tuple[int, list[int]]:
        """(first sliding page, its blocks) that a remote prefill of `num_tokens` positions writes
        into on this side; `adopt_transferred` installs exactly these."""
        if not self.has_sliding or num_tokens == 0:
            return 0, []
        first = sliding_first_page(num_tokens, self.window, self.page_size)
        n = (num_tokens - 1) // self.page_size - first + 1
        return first, seq.sliding_spare[:n]

    def adopt_transferred(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Install the sliding table a remote prefill of `num_tokens` positions filled."""
        first, blocks = self.transfer_targets(seq, num_tokens)
        if blocks:
            seq.sliding_first_page = first
            seq.sliding, seq.sliding_spare = blocks, seq.sliding_spare[len(blocks):]

    def transfer_pages(self, seq: SeqBlocks, num_tokens: int) -> dict[str, list[tuple[int, int]]]:
        """(logical page, block) pairs of a request's first `num_tokens` positions that a decode
        worker needs: every full-layer page, and the sliding pages still inside the window."""
        last = (num_tokens - 1) // self.page_size
        out = {"full": [(p, seq.full[p]) for p in range(last + 1)]}
        if self.has_sliding:
            first = sliding_first_page(num_tokens, self.window, self.page_size)
            out["sliding"] = [
                (p, seq.sliding[p - seq.sliding_first_page]) for p in range(first, last + 1)
            ]
        return out

    def tables(self, seq: SeqBlocks, num_tokens: int) -> dict[str, tuple[list[int], int]]:
        """For attention over the first `num_tokens` positions: (block table, kv length) per pool,
        the sliding table starting at its first live page."""
        out = {"full": (seq.full, num_tokens)}
        if self.has_sliding:
            out["sliding"] = (seq.sliding, num_tokens - seq.sliding_first_page * self.page_size)
        return out
