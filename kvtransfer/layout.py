"""What a peer needs to address one KV pool of a worker rank remotely.

A pool is one contiguous tensor of shape
``[n_layers, n_blocks, 2, page_size, num_kv_heads_local, head_dim]`` (index 2 is K/V, layout NHD
inside a page). Page ``b`` of layer ``l`` is ``pool[l, b]``, a contiguous run of
``page_nbytes`` bytes. The rank holds the global KV heads ``[head_start, head_end)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.errors import KVLayoutError

_DEVICE_RE = re.compile(r"^(cpu|cuda:\d+)$")


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV heads ``[start, end)`` held by rank ``tp_rank`` of a TP group of ``tp_size``."""
    if num_kv_heads < 1 or tp_size < 1 or num_kv_heads % tp_size:
        raise KVLayoutError(
            f"tp_size={tp_size} must be positive and divide num_kv_heads={num_kv_heads}"
        )
    if not 0 <= tp_rank < tp_size:
        raise KVLayoutError(f"tp_rank={tp_rank} outside [0, {tp_size})")
    per = num_kv_heads // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def heads_overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Intersection of two head ranges, or None when they share no head."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype given by name ("bfloat16")."""
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise KVLayoutError(f"unknown dtype {dtype!r}")
    return dt.itemsize


@dataclass(frozen=True)
class PoolLayout:
    """Address, shape and head range of one registered KV pool of one rank.

    Parameters
    ----------
    name : pool name ("full", "sliding").
    addr : address of element 0 in the owner's process (host or device pointer).
    shape : ``(n_layers, n_blocks, 2, page_size, num_kv_heads_local, head_dim)``.
    dtype : torch dtype name, e.g. ``"bfloat16"``.
    device : ``"cpu"`` or ``"cuda:N"`` in the owner's process.
    head_start, head_end : global KV head range ``[head_start, head_end)`` of the rank.
    """

    name: str
    addr: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    head_start: int
    head_end: int

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.name or not isinstance(self.name, str):
            raise KVLayoutError(f"pool name must be a non-empty string, got {self.name!r}")
        if len(self.shape) != 6 or self.shape[2] != 2 or min(self.shape) < 0:
            raise KVLayoutError(
                f"pool {self.name!r}: shape {self.shape} is not "
                "[n_layers, n_blocks, 2, page_size, num_kv_heads_local, head_dim]"
            )
        if min(self.shape[2:]) < 1:
            raise KVLayoutError(f"pool {self.name!r}: shape {self.shape} has an empty page")
        if not 0 <= self.head_start < self.head_end:
            raise KVLayoutError(
                f"pool {self.name!r}: bad head range [{self.head_start}, {self.head_end})"
            )
        if self.head_end - self.head_start != self.shape[4]:
            raise KVLayoutError(
                f"pool {self.name!r}: head range [{self.head_start}, {self.head_end}) does not "
                f"match num_kv_heads_local={self.shape[4]}"
            )
        if not _DEVICE_RE.match(self.device):
            raise KVLayoutError(f"pool {self.name!r}: device {self.device!r} is not cpu or cuda:N")
        if self.addr < 0 or (self.addr == 0 and self.nbytes > 0):
            raise KVLayoutError(f"pool {self.name!r}: bad address {self.addr:#x}")
        dtype_itemsize(self.dtype)

    @classmethod
    def from_tensor(cls, name: str, pool: torch.Tensor, head_range: tuple[int, int]) -> PoolLayout:
        """Layout of a local pool tensor; it must be contiguous (pages are addressed by offset)."""
        if not isinstance(pool, torch.Tensor):
            raise KVLayoutError(f"pool {name!r} must be a torch.Tensor, got {type(pool).__name__}")
        if not pool.is_contiguous():
            raise KVLayoutError(f"pool {name!r} must be contiguous")
        if pool.device.type not in ("cpu", "cuda"):
            raise KVLayoutError(f"pool {name!r}: unsupported device {pool.device}")
        dev = "cpu" if pool.device.type == "cpu" else f"cuda:{pool.device.index}"
        return cls(name=name, addr=pool.data_ptr(), shape=tuple(pool.shape),
                   dtype=str(pool.dtype).removeprefix("torch."), device=dev,
                   head_start=int(head_range[0]), head_end=int(head_range[1]))

    # -- derived sizes (bytes) ----------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.shape[0]

    @property
    def n_blocks(self) -> int:
        return self.shape[1]

    @property
    def page_size(self) -> int:
        return self.shape[3]

    @property
    def num_kv_heads_local(self) -> int:
        return self.shape[4]

    @property
    def head_dim(self) -> int:
        return self.shape[5]

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def head_nbytes(self) -> int:
        return self.head_dim * self.itemsize

    @property
    def row_nbytes(self) -> int:
        """One (k/v, token) row: all local heads of one position."""
        return self.num_kv_heads_local * self.head_nbytes

    @property
    def page_nbytes(self) -> int:
        return 2 * self.page_size * self.row_nbytes

    @property
    def layer_nbytes(self) -> int:
        return self.n_blocks * self.page_nbytes

    @property
    def nbytes(self) -> int:
        return self.n_layers * self.layer_nbytes

    @property
    def heads(self) -> tuple[int, int]:
        return self.head_start, self.head_end

    @property
    def device_id(self) -> int:
        """NIXL device id: the CUDA index, 0 for host memory."""
        return 0 if self.device == "cpu" else int(self.device.split(":")[1])

    @property
    def mem_type(self) -> str:
        """NIXL memory segment type."""
        return "DRAM" if self.device == "cpu" else "VRAM"
