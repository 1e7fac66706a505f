"""A rank's place in its worker's parallel groups, and the collectives the model needs.

A worker of `world_size` ranks runs attention tensor-parallel over all of them (query and KV heads
split) and the MoE as an EP x TP grid: experts split over `ep_size` groups, each expert's
intermediate dimension over `world_size // ep_size` ranks. Rank r is (ep_rank, moe_tp_rank) =
divmod(r, moe_tp_size). Vocabulary-parallel embedding and unembedding split over all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardSpec:
    rank: int = 0
    world_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.ep_size < 1 or self.world_size % self.ep_size:
            raise ValueError(f"EP {self.ep_size} does not divide {self.world_size} ranks")

    @property
    def tp_rank(self) -> int:  # attention / vocabulary
        return self.rank

    @property
    def tp_size(self) -> int:
        return self.world_size

    @property
    def moe_tp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    def split(self, n: int, parts: int, index: int, what: str) -> tuple[int, int]:
        if n % parts:
            raise ValueError(f"{what} ({n}) is not divisible by {parts}")
        step = n // parts
        return index * step, (index + 1) * step

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        return self.split(num_kv_heads, self.tp_size, self.tp_rank, "num_key_value_heads")

    def q_head_range(self, num_heads: int) -> tuple[int, int]:
        return self.split(num_heads, self.tp_size, self.tp_rank, "num_attention_heads")

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        return self.split(num_experts, self.ep_size, self.ep_rank, "num_local_experts")

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        step = -(-vocab // self.tp_size)
        return min(vocab, self.tp_rank * step), min(vocab, (self.tp_rank + 1) * step)


def all_reduce(t: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """Sum over the worker's ranks (in float32 for bf16 inputs: the reduction order must not
    change the result more than one bf16 rounding)."""
    if shard.world_size == 1:
        return t
    buf = t.float() if t.dtype == torch.bfloat16 else t
    dist.all_reduce(buf)
    return buf.to(t.dtype)


def all_gather_last(t: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """Concatenate each rank's [..., n_r] along the last dim (vocab-parallel logits)."""
    if shard.world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(shard.world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)
