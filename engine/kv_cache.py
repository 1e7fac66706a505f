"""Paged KV cache: the pool tensor that `block_manager` block ids index.

One tensor holds every block (bf16; the layout kernels.attention and kvtransfer address):
    storage [max(n_full_layers, n_sliding_layers), num_blocks, 2, page_size, num_kv_heads, head_dim]
and each layer group sees it through a view of its own layer count, `pools[group]`:
    full    [n_full_layers,    num_blocks, 2, page_size, num_kv_heads, head_dim]
    sliding [n_sliding_layers, num_blocks, 2, page_size, num_kv_heads, head_dim]
Block b, held for a group, holds page b of every layer in that group. The groups share the block
ids (one allocator), never a block: which request holds which blocks for which group, and when a
freed one may be reused, is `KVBlockManager`'s business (inherited here, so one object answers
both). gpt-oss alternates the two kinds of layer, so the groups are equal and no memory is idle.
"""

from __future__ import annotations

import torch

from .block_manager import (BlockAllocator, KVBlockManager, KVCacheFull, SeqBlocks, cdiv,
                            sliding_first_page)
from .config import ModelConfig

__all__ = ["BlockAllocator", "KVBlockManager", "KVCacheFull", "PagedKVCache", "SeqBlocks", "cdiv",
           "sliding_first_page"]


class PagedKVCache(KVBlockManager):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_blocks: int,
        page_size: int = 16,
        num_kv_heads: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads or cfg.num_key_value_heads
        counts = self.group_layers(cfg)
        self.layer_group: list[tuple[str, int]] = []
        seen = {"full": 0, "sliding": 0}
        for i in range(cfg.num_hidden_layers):
            g = "sliding" if counts["sliding"] and cfg.is_sliding(i) else "full"
            self.layer_group.append((g, seen[g]))
            seen[g] += 1
        super().__init__(page_size=page_size, num_blocks=num_blocks,
                         window=cfg.sliding_window if counts["sliding"] else 0)
        shape = (2, page_size, self.num_kv_heads, cfg.head_dim)
        self.storage = torch.zeros(max(counts.values()), num_blocks, *shape, dtype=dtype, device=torch.device(device))
        self.pools: dict[str, torch.Tensor] = {g: self.storage[:n] for g, n in counts.items()
                                               if n or g == "full"}

    @staticmethod
    def group_layers(cfg: ModelConfig) -> dict[str, int]:
        """Layers of each group: {"full": n, "sliding": m} (m = 0 without sliding-window layers)."""
        sliding = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_sliding(i)) if cfg.sliding_window > 0 else 0
        return {"full": cfg.num_hidden_layers - sliding, "sliding": sliding}

    @classmethod
    def prompt_blocks(cls, cfg: ModelConfig, num_tokens: int, page_size: int) -> int:
        """Blocks a local prefill of `num_tokens` holds while it runs: every page in each group
        (the sliding layers' beyond the window go back when it ends)."""
        return sum(1 for n in cls.group_layers(cfg).values() if n) * cdiv(num_tokens, page_size)

    @classmethod
    def bytes_per_block(cls, cfg: ModelConfig, page_size: int, num_kv_heads: int) -> int:
        """Bytes of one block: a page of every layer of the larger group."""
        return max(cls.group_layers(cfg).values()) * 2 * page_size * num_kv_heads * cfg.head_dim * 2

    def layer_cache(self, layer: int) -> torch.Tensor:
        g, i = self.layer_group[layer]
        return self.pools[g][i]

    def write(self, layer: int, slots: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, num_kv_heads, head_dim] into the layer's pages at `slots` of its pool."""
        g, _ = self.layer_group[layer]
        cache = self.layer_cache(layer)
        s = slots[g]
        blk, off = s // self.page_size, s % self.page_size
        cache[blk, 0, off] = k.to(cache.dtype)
        cache[blk, 1, off] = v.to(cache.dtype)
