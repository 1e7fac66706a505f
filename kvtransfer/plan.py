"""Which bytes go where: page pairs of one request -> (src offset, dst offset) byte ranges.

numpy (plus one torch gather for packing); no NIXL. A source rank copies to a destination rank
only the KV heads both hold (``heads_overlap``), so with prefill TP=p and decode TP=d every
destination byte of a mapped page is written exactly once, by the prefill rank that computed it,
and nobody receives heads it does not own.

* Same head range on both sides: the pages are identical in layout, one range per
  (layer, page) of ``page_nbytes``.
* Otherwise: inside a page (NHD) the heads of one (k/v, token) row are contiguous, so one range
  per (layer, page, k/v, token) of ``(hi - lo) * head_dim * itemsize`` bytes. K and V rows of a
  page are uniformly spaced (row index ``kv * page_size + token``), so the 2*page_size rows of a
  page form one arithmetic sequence on each side.
* Staged (optional, destination heads a strict subset of the source's): the sender first packs
  the destination's heads of the pages into a scratch buffer laid out as destination pages
  (``pack_pages``), then sends one range per (layer, page) from there. See ``staging``.
* Slotted (optional, source heads a strict subset of the destination's): whole source pages go
  into slots of the destination pages, one range per (layer, page); the receiver puts the heads
  in place once every slot arrived. See ``reshard``.

``merge_contiguous`` then fuses ranges adjacent on both sides before they go to NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np
import torch

from pdserve.kvtransfer.errors import KVLayoutError
from pdserve.kvtransfer.layout import PoolLayout, heads_overlap
from pdserve.kvtransfer.reshard import can_slot, slot_offsets


@dataclass(frozen=True, eq=False)
class PoolCopy:
    """Byte ranges of one pool to copy; offsets are relative to each pool's base address.

    src_offsets, dst_offsets, lengths : int64 arrays of shape ``(m,)``.
    """

    pool: str
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    # Staged copies read from the staging buffer: src_offsets are relative to it, and
    # ``pack_pages`` must first fill ``[staging_offset, staging_offset + nbytes)`` from the
    # source pool's pages ``src_blocks`` (in order).
    staged: bool = False
    src_blocks: np.ndarray | None = None
    staging_offset: int = 0
    # Slotted copies write whole source pages into slots of the destination pages
    # ``dst_blocks`` (pair order); the receiver unpacks them (``reshard``).
    slotted: bool = False
    dst_blocks: np.ndarray | None = None

    @property
    def num_descs(self) -> int:
        return int(self.src_offsets.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def as_block_pairs(pairs, pool: str = "") -> np.ndarray:
    """``[(src_block, dst_block), ...]`` -> int64 array ``(n, 2)``; rejects non-integers."""
    arr = np.asarray(pairs)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise KVLayoutError(f"pool {pool!r}: pages must be (local_block, remote_block) pairs")
    if arr.dtype.kind not in "iu":
        raise KVLayoutError(f"pool {pool!r}: block ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_compatible(src: PoolLayout, dst: PoolLayout) -> tuple[int, int]:
    """Raise unless pages of ``src`` can be copied into ``dst``; return the shared heads."""
    for what, a, b in (("dtype", src.dtype, dst.dtype), ("n_layers", src.n_layers, dst.n_layers),
                       ("page_size", src.page_size, dst.page_size),
                       ("head_dim", src.head_dim, dst.head_dim)):
        if a != b:
            raise KVLayoutError(f"pool {src.name!r}: {what} differs between source ({a}) and "
                                f"destination ({b})")
    overlap = heads_overlap(src.heads, dst.heads)
    if overlap is None:
        raise KVLayoutError(f"pool {src.name!r}: source heads {list(src.heads)} and destination "
                            f"heads {list(dst.heads)} do not intersect; nothing to send")
    return overlap


def can_stage(src: PoolLayout, dst: PoolLayout) -> bool:
    """True when the destination's heads are a strict subset of the source's."""
    return (src.head_start <= dst.head_start and dst.head_end <= src.head_end
            and src.heads != dst.heads)


def _checked_pairs(src: PoolLayout, dst: PoolLayout, pairs) -> tuple[tuple[int, int], np.ndarray]:
    overlap = check_compatible(src, dst)
    p = as_block_pairs(pairs, src.name)
    for col, side in ((0, src), (1, dst)):
        if p.shape[0] and (p[:, col].min() < 0 or p[:, col].max() >= side.n_blocks):
            bad = p[(p[:, col] < 0) | (p[:, col] >= side.n_blocks), col]
            which = "source" if col == 0 else "destination"
            raise KVLayoutError(f"pool {src.name!r}: {which} block ids {bad[:8].tolist()} outside "
                                f"[0, {side.n_blocks})")
    if np.unique(p[:, 1]).shape[0] != p.shape[0]:
        raise KVLayoutError(f"pool {src.name!r}: a destination block appears more than once")
    return overlap, p


def plan_pool_copy(src: PoolLayout, dst: PoolLayout, pairs,
                   staging_offset: int | None = None, slotted: bool = False) -> PoolCopy:
    """Byte ranges that copy page ``pairs[i, 0]`` of ``src`` into page ``pairs[i, 1]`` of ``dst``
    for every layer, restricted to the KV heads both sides hold.

    Parameters
    ----------
    src, dst : layouts of the same pool on the two ranks.
    pairs : ``(n, 2)`` integers, (src_block, dst_block). A destination block may appear once.
    staging_offset : where in the sender's staging buffer to pack, if ``can_stage(src, dst)``
        (needs ``staged_nbytes(dst, n)`` bytes there); None for direct ranges.
    slotted : if ``can_slot(src, dst)``, write whole pages into the slot layout of ``reshard``
        (the receiver must unpack them).
    """
    (lo, hi), p = _checked_pairs(src, dst, pairs)
    layers = np.arange(src.n_layers, dtype=np.int64)
    if slotted and can_slot(src, dst):
        src_page = layers[:, None] * src.layer_nbytes + p[None, :, 0] * src.page_nbytes
        return PoolCopy(src.name, src_page.reshape(-1), slot_offsets(src, dst, p[:, 1]).reshape(-1),
                        _full(src_page.size, src.page_nbytes), slotted=True,
                        dst_blocks=p[:, 1].copy())
    dst_page = layers[:, None] * dst.layer_nbytes + p[None, :, 1] * dst.page_nbytes  # (L, n)
    if staging_offset is not None and can_stage(src, dst):
        staged = staging_offset + (layers[:, None] * p.shape[0] + np.arange(p.shape[0])[None, :]
                                   ) * dst.page_nbytes
        return PoolCopy(src.name, staged.reshape(-1), dst_page.reshape(-1),
                        _full(staged.size, dst.page_nbytes), staged=True,
                        src_blocks=p[:, 0].copy(), staging_offset=staging_offset)
    src_page = layers[:, None] * src.layer_nbytes + p[None, :, 0] * src.page_nbytes
    if src.heads == dst.heads:
        return PoolCopy(src.name, src_page.reshape(-1), dst_page.reshape(-1),
                        _full(src_page.size, src.page_nbytes))

    rows = np.arange(2 * src.page_size, dtype=np.int64)  # kv * page_size + token
    src_row = rows * src.row_nbytes + (lo - src.head_start) * src.head_nbytes
    dst_row = rows * dst.row_nbytes + (lo - dst.head_start) * dst.head_nbytes
    return PoolCopy(src.name,
                    (src_page[:, :, None] + src_row[None, None, :]).reshape(-1),
                    (dst_page[:, :, None] + dst_row[None, None, :]).reshape(-1),
                    _full(src_page.size * rows.size, (hi - lo) * src.head_nbytes))


def _full(n: int, value: int) -> np.ndarray:
    return np.full(n, value, dtype=np.int64)


def merge_contiguous(copy: PoolCopy) -> PoolCopy:
    """Fuse runs of ranges that are back to back on both sides into one range (consecutive
    pages of consecutive blocks, e.g. block runs from an allocator). Same bytes, fewer
    descriptors: transports pay per descriptor (~10 us each with UCX cuda_ipc or TCP)."""
    s, d, n = copy.src_offsets, copy.dst_offsets, copy.lengths
    if s.shape[0] < 2:
        return copy
    cont = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    if not cont.any():
        return copy
    starts = np.flatnonzero(np.concatenate([[True], ~cont]))
    return replace(copy, src_offsets=s[starts], dst_offsets=d[starts],
                   lengths=np.add.reduceat(n, starts))


def staged_nbytes(dst: PoolLayout, n_pages: int) -> int:
    """Staging bytes for ``n_pages`` destination pages of every layer."""
    return dst.n_layers * n_pages * dst.page_nbytes


def pack_pages(pool: torch.Tensor, src: PoolLayout, dst: PoolLayout, copy: PoolCopy,
               staging: torch.Tensor) -> None:
    """Fill a staged copy's region of ``staging`` (uint8 ``(nbytes,)``, same device as ``pool``)
    with ``pool[l, src_blocks[i], :, :, dst heads, :]`` as ``(n_layers, n, 2, page_size,
    dst heads, head_dim)``. Asynchronous on CUDA: synchronize before NIXL reads it."""
    n = copy.src_blocks.shape[0]
    shape = (dst.n_layers, n, 2, dst.page_size, dst.num_kv_heads_local, dst.head_dim)
    nbytes = staged_nbytes(dst, n)
    out = staging[copy.staging_offset:copy.staging_offset + nbytes].view(pool.dtype).view(shape)
    heads = pool[..., dst.head_start - src.head_start:dst.head_end - src.head_start, :]
    idx = torch.as_tensor(copy.src_blocks, dtype=torch.long, device=pool.device)
    torch.index_select(heads, 1, idx, out=out)


def plan_copy(src_pools: Mapping[str, PoolLayout], dst_pools: Mapping[str, PoolLayout],
              pages: Mapping[str, object], staging_offset: int | None = None,
              slotted: bool = False) -> list[PoolCopy]:
    """Plan every pool named in ``pages`` (pool -> (src_block, dst_block) pairs).

    Pools with no pairs or no layers move nothing and may be absent on either side. With
    ``staging_offset``, stageable pools are packed back to back from there
    (``plan_staging_nbytes`` bytes in all); with ``slotted``, pools a rank with more heads
    receives are slotted. Validates everything before returning.
    """
    out = []
    off = staging_offset
    for name, pairs in pages.items():
        p = as_block_pairs(pairs, name)
        if p.shape[0] == 0:
            continue
        for side, pools in (("source", src_pools), ("destination", dst_pools)):
            if name not in pools:
                raise KVLayoutError(f"pool {name!r} does not exist on the {side} "
                                    f"(has {sorted(pools)})")
        src, dst = src_pools[name], dst_pools[name]
        copy = plan_pool_copy(src, dst, p, off, slotted)
        if copy.staged:
            off += staged_nbytes(dst, p.shape[0])
        if copy.num_descs:
            out.append(copy)
    return out


def plan_staging_nbytes(src_pools: Mapping[str, PoolLayout], dst_pools: Mapping[str, PoolLayout],
                        pages: Mapping[str, object]) -> int:
    """Staging bytes ``plan_copy(..., staging_offset=...)`` packs; 0 if nothing is stageable."""
    total = 0
    for name, pairs in pages.items():
        if name in src_pools and name in dst_pools and can_stage(src_pools[name], dst_pools[name]):
            total += staged_nbytes(dst_pools[name], as_block_pairs(pairs, name).shape[0])
    return total
