"""Paged KV cache: the pool tensors that `block_manager` block ids index.

Pool tensors (bf16, one per layer group, the layout kernels.attention and kvtransfer address):
    full    [n_full_layers,    num_blocks,         2, page_size, num_kv_heads, head_dim]
    sliding [n_sliding_layers, num_sliding_blocks, 2, page_size, num_kv_heads, head_dim]
Block b of a pool holds page b of every layer in the group. Which request holds which blocks,
and when a freed block may be reused, is `KVBlockManager`'s business (inherited here, so one
object answers both).
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
        num_sliding_blocks: int | None = None,
        page_size: int = 16,
        num_kv_heads: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads or cfg.num_key_value_heads
        self.layer_group: list[tuple[str, int]] = []
        counts = {"full": 0, "sliding": 0}
        for i in range(cfg.num_hidden_layers):
            g = "sliding" if cfg.is_sliding(i) and cfg.sliding_window > 0 else "full"
            self.layer_group.append((g, counts[g]))
            counts[g] += 1
        if counts["sliding"]:
            num_sliding_blocks = num_blocks if num_sliding_blocks is None else num_sliding_blocks
        else:
            num_sliding_blocks = None
        super().__init__(page_size=page_size, num_blocks=num_blocks, window=cfg.sliding_window,
                         num_sliding_blocks=num_sliding_blocks)
        shape = (2, page_size, self.num_kv_heads, cfg.head_dim)
        dev = torch.device(device)
        self.pools: dict[str, torch.Tensor] = {
            "full": torch.zeros(counts["full"], num_blocks, *shape, dtype=dtype, device=dev)
        }
        if counts["sliding"]:
            self.pools["sliding"] = torch.zeros(
                counts["sliding"], num_sliding_blocks, *shape, dtype=dtype, device=dev
            )

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, page_size: int, num_kv_heads: int, n_layers: int) -> int:
        return n_layers * 2 * page_size * num_kv_heads * cfg.head_dim * 2

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
