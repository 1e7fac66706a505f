"""Paged KV cache: two block pools (full-attention and sliding-window layers), exact accounting.

Pool tensors (bf16, one per layer group, the layout kernels.attention and kvtransfer address):
    full    [n_full_layers,    num_blocks,         2, page_size, num_kv_heads, head_dim]
    sliding [n_sliding_layers, num_sliding_blocks, 2, page_size, num_kv_heads, head_dim]
Block b of a pool holds page b of every layer in the group. A request owns
- full blocks for every page it can ever reach (prompt + max new tokens), taken at admission, so a
  running request never waits for memory;
- a fixed quota of sliding blocks, enough for the pages a window of `sliding_window` keys can
  span; pages that slide out of every future query's window are recycled to its end.
A local prefill of a prompt longer than the window briefly needs sliding blocks for the whole
prompt; they are taken from the pool and returned right after (`finish_prefill`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .config import ModelConfig


class KVCacheFull(RuntimeError):
    """Not enough free blocks: the caller should refuse or queue the request (backpressure)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_first_page(next_pos: int, window: int, page_size: int) -> int:
    """First page a query at `next_pos` (or later) can still see in a `window`-key window."""
    return max(0, next_pos - window + 1) // page_size


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"need {n} KV blocks, {len(self._free)} free of {self.num_total}")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks) -> None:
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"KV block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)


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


class PagedKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_blocks: int,
        num_sliding_blocks: int | None = None,
        page_size: int = 16,
        num_kv_heads: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ):
        if page_size < 1 or num_blocks < 1:
            raise ValueError("page_size and num_blocks must be positive")
        self.cfg = cfg
        self.page_size = page_size
        self.window = cfg.sliding_window
        self.num_kv_heads = num_kv_heads or cfg.num_key_value_heads
        self.layer_group: list[tuple[str, int]] = []
        counts = {"full": 0, "sliding": 0}
        for i in range(cfg.num_hidden_layers):
            g = "sliding" if cfg.is_sliding(i) and self.window > 0 else "full"
            self.layer_group.append((g, counts[g]))
            counts[g] += 1
        if num_sliding_blocks is None:
            num_sliding_blocks = num_blocks if counts["sliding"] else 0
        shape = (2, page_size, self.num_kv_heads, cfg.head_dim)
        dev = torch.device(device)
        self.pools: dict[str, torch.Tensor] = {
            "full": torch.zeros(counts["full"], num_blocks, *shape, dtype=dtype, device=dev)
        }
        self.allocators = {"full": BlockAllocator(num_blocks)}
        if counts["sliding"]:
            self.pools["sliding"] = torch.zeros(
                counts["sliding"], num_sliding_blocks, *shape, dtype=dtype, device=dev
            )
            self.allocators["sliding"] = BlockAllocator(num_sliding_blocks)

    # -- sizing ---------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_block(cfg: ModelConfig, page_size: int, num_kv_heads: int, n_layers: int) -> int:
        return n_layers * 2 * page_size * num_kv_heads * cfg.head_dim * 2

    @property
    def has_sliding(self) -> bool:
        return "sliding" in self.pools

    def layer_cache(self, layer: int) -> torch.Tensor:
        g, i = self.layer_group[layer]
        return self.pools[g][i]

    def sliding_quota(self, max_tokens: int) -> int:
        """Sliding blocks a request keeps: the pages `window` consecutive keys can span."""
        if not self.has_sliding:
            return 0
        return min(cdiv(self.window, self.page_size) + 1, cdiv(max_tokens, self.page_size))

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
        return self.allocators["full"].num_free

    @property
    def num_used_blocks(self) -> int:
        return sum(a.num_used for a in self.allocators.values())

    @property
    def num_total_blocks(self) -> int:
        return self.allocators["full"].num_total

    def can_admit(self, max_tokens: int, local_prompt_tokens: int = 0) -> bool:
        full, sliding = self.blocks_needed(max_tokens, local_prompt_tokens)
        ok = self.allocators["full"].num_free >= full
        if self.has_sliding:
            ok &= self.allocators["sliding"].num_free >= sliding
        return ok

    # -- per request ----------------------------------------------------------------------------
    def reserve(self, max_tokens: int, local_prompt_tokens: int = 0) -> SeqBlocks:
        """Take every block the request needs up front, or raise KVCacheFull taking none."""
        if not self.can_admit(max_tokens, local_prompt_tokens):
            full, sliding = self.blocks_needed(max_tokens, local_prompt_tokens)
            raise KVCacheFull(
                f"request needs {full} full + {sliding} sliding KV blocks; free: "
                + ", ".join(f"{g} {a.num_free}" for g, a in self.allocators.items())
            )
        full, sliding = self.blocks_needed(max_tokens, local_prompt_tokens)
        seq = SeqBlocks(full=self.allocators["full"].allocate(full), max_tokens=max_tokens)
        if self.has_sliding:
            seq.sliding_spare = self.allocators["sliding"].allocate(sliding)
            seq.sliding_quota = self.sliding_quota(max_tokens)
        return seq

    def release(self, seq: SeqBlocks) -> None:
        self.allocators["full"].free(seq.full)
        if self.has_sliding:
            self.allocators["sliding"].free(seq.owned_sliding())
        seq.full, seq.sliding, seq.sliding_spare = [], [], []

    def prepare(self, seq: SeqBlocks, start: int, num_tokens: int) -> dict[str, torch.Tensor]:
        """Make pages for positions [start, start + num_tokens) writable; return the flat slot
        (block * page_size + offset) of each position in each pool."""
        end = start + num_tokens
        self._make_writable(seq, start, end)
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

    def _make_writable(self, seq: SeqBlocks, start: int, end: int) -> None:
        if end > len(seq.full) * self.page_size:
            raise KVCacheFull(f"position {end - 1} is beyond the {len(seq.full)} reserved blocks")
        if self.has_sliding:
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
            self.allocators["sliding"].free(give)

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

    def write(self, layer: int, slots: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, num_kv_heads, head_dim] into the layer's pages at `slots` of its pool."""
        g, _ = self.layer_group[layer]
        cache = self.layer_cache(layer)
        s = slots[g]
        blk, off = s // self.page_size, s % self.page_size
        cache[blk, 0, off] = k.to(cache.dtype)
        cache[blk, 1, off] = v.to(cache.dtype)
