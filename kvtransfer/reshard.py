"""Re-sharding into a rank that holds more KV heads than the sender (prefill TP p > decode TP d):
slotted writes into the request's own pages, put in place by the receiver when all arrived.

Why: in a page (NHD) one (k/v, token) row interleaves the heads of several senders, so writing
each sender's heads straight into place costs one descriptor per (layer, page, k/v, token):
1.2M descriptors and >10 s for a 32k-token prompt. Instead each sender writes its pages whole,
unchanged, into a slot of the destination pages, and the receiver permutes them once.

Slot layout, per pool and layer: the destination pages of the request, concatenated in the order
of the pairs (blocks ``b_0 .. b_{n-1}``), are ``n * k`` slots of one source page each (``k`` =
destination heads / source heads). The sender owning the ``s``-th head slice of the destination
writes its page ``i`` into slot ``s * n + i``, i.e. page ``b_{(s*n+i) // k}`` at byte
``((s*n+i) % k) * source page bytes``. Over consecutive blocks on both sides that is ONE range
per layer (and per run of blocks otherwise): no staging memory, no extra round trip. The write's
notification carries the destination blocks (run-length encoded); once the receiver's heads are
covered (every slot written) the pages are gathered, their heads permuted into place and
scattered back (``unpack_slotted``) before the worker counts the request's KV as present. Slots
are assembled per push (an id every sender of one push shares), so the slots an earlier, failed
push left behind never complete a later one into the same blocks. The bytes a request's pages
hold are garbage until then, as for any write in flight; nothing reads them before the KV is
declared present.

Who unpacks, and when: a standalone receiver unpacks as soon as its slots are all there. The ranks
of a decode worker (``unpack_on_arrival=False``) only mark them ready and unpack when their
leader's scheduler says so (``unpack``, naming the blocks the request holds). It says so only
while the request holds its blocks, under the lock that guards every release of blocks, and the
command returns once every rank has unpacked (decode_worker.scheduler). Guarantee: a rank permutes pages
only of blocks their request still holds. A request that ends before its KV is on every rank is
never unpacked anywhere, so its blocks are reusable as soon as no write into them can land (the
prefill side's "ok"/"failed" fence), and a rank that polls its slots late, after the blocks went
to another request, leaves the new owner's KV alone. Any later write for the request (another
push) drops a ready entry: its pages are being rewritten.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kvtransfer.errors import KVLayoutError
from pdserve.kvtransfer.layout import PoolLayout
from pdserve.kvtransfer.notify import WRITE, covers, parse_notification

log = logging.getLogger(__name__)

SEP = b"|"  # notification | slotted blocks


def can_slot(src: PoolLayout, dst: PoolLayout) -> bool:
    """True when the source's heads are a strict, aligned subset of the destination's."""
    w = src.num_kv_heads_local
    return (dst.head_start <= src.head_start and src.head_end <= dst.head_end
            and src.heads != dst.heads and dst.num_kv_heads_local % w == 0
            and (src.head_start - dst.head_start) % w == 0)


def slot_offsets(src: PoolLayout, dst: PoolLayout, dst_blocks: np.ndarray) -> np.ndarray:
    """Destination byte offsets ``(n_layers, n)`` of the source's pages ``0 .. n-1`` (pair
    order) in the slot layout over ``dst_blocks``."""
    w = src.num_kv_heads_local
    k = dst.num_kv_heads_local // w
    slot = (src.head_start - dst.head_start) // w
    n = dst_blocks.shape[0]
    j = slot * n + np.arange(n, dtype=np.int64)
    within = dst_blocks[j // k] * dst.page_nbytes + (j % k) * src.page_nbytes
    layers = np.arange(dst.n_layers, dtype=np.int64)
    return layers[:, None] * dst.layer_nbytes + within[None, :]


def encode_blocks(blocks: dict[str, np.ndarray]) -> bytes:
    """pool -> destination blocks (in pair order) as b"full=3+16.40+4;sliding=7+9" (start+length runs)."""
    parts = []
    for name, b in blocks.items():
        b = np.asarray(b, dtype=np.int64)
        if b.shape[0] == 0:
            continue
        starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1] + 1]))
        lens = np.diff(np.concatenate([starts, [b.shape[0]]]))
        parts.append(name + "=" + ".".join(f"{b[s]}+{n}" for s, n in zip(starts, lens)))
    return ";".join(parts).encode()


def names_heads(notif: bytes) -> bool:
    """Is `notif` a KV-written notification naming its heads (b"<id>#<lo>:<hi>")? Only those get
    slots appended (b"<notif>|<push id>|<blocks>"), and only messages of that shape are read as
    slotted: any other notification, SEP or stray bytes in it or not, is delivered as it came."""
    if SEP in notif:
        return False
    try:
        n = parse_notification(notif)
    except UnicodeDecodeError:
        return False
    return n.kind == WRITE and n.heads is not None


def encode_slots(push_id: str, blocks: dict[str, np.ndarray]) -> bytes:
    """A slotted write's notification tail: b"<push id>|<encode_blocks>"."""
    if SEP.decode() in push_id:
        raise KVLayoutError(f"push id {push_id!r} contains {SEP!r}")
    return push_id.encode() + SEP + encode_blocks(blocks)


def decode_blocks(text: bytes) -> dict[str, np.ndarray]:
    out = {}
    try:
        for part in text.decode().split(";"):
            name, _, runs = part.partition("=")
            blocks = []
            for run in runs.split("."):
                start, _, n = run.partition("+")
                blocks.append(np.arange(int(start), int(start) + int(n), dtype=np.int64))
            out[name] = np.concatenate(blocks)
    except (ValueError, UnicodeDecodeError) as e:
        raise KVLayoutError(f"malformed slotted-write blocks {text[:80]!r}: {e}") from None
    return out


def unpack_slotted(pool: torch.Tensor, blocks: np.ndarray, k: int) -> None:
    """Put ``k`` slotted senders' heads in place in pages ``blocks`` (pair order) of ``pool``
    ``[n_layers, n_blocks, 2, page_size, heads, head_dim]``: one gather, permute and scatter
    per layer (a layer's pages of the request as scratch). Asynchronous on CUDA."""
    n_layers, _, two, page, heads, dim = pool.shape
    if heads % k:
        raise KVLayoutError(f"{k} slots do not divide the rank's {heads} KV heads")
    n = blocks.shape[0]
    idx = torch.as_tensor(blocks, dtype=torch.long, device=pool.device)
    for layer in range(n_layers):
        pages = pool[layer].index_select(0, idx)  # (n, 2, page, heads, dim), slot order
        placed = pages.view(k, n, two, page, heads // k, dim).permute(1, 2, 3, 0, 4, 5)
        pool[layer].index_copy_(0, idx, placed.reshape(n, two, page, heads, dim))


@dataclass
class _Held:
    since: float
    push_id: bytes
    width: int
    blocks: dict[str, np.ndarray]
    heads: list[tuple[int, int]] = field(default_factory=list)
    notifs: list[bytes] = field(default_factory=list)


@dataclass
class _Ready:
    """A request's slots, all here, waiting for the leader's word to unpack (deferred mode)."""

    since: float
    push_id: bytes
    blocks: dict[str, np.ndarray]
    k: int


class SlottedArrivals:
    """Receiver side: holds the notifications of slotted writes until this rank's heads are
    covered for the request, then unpacks its pages and releases them (``feed``), or with
    ``unpack_on_arrival=False`` releases them and keeps the pages ready for ``unpack``.

    pools : the rank's pool tensors by name; heads : its global KV heads ``[lo, hi)``.
    A request whose slots never all arrive (its push failed or was cancelled), or that is ready
    and never unpacked (it ended meanwhile), is dropped after ``ttl_s``; its pages are never
    touched. One caller at a time (the agent's lock).
    """

    def __init__(self, pools: dict[str, torch.Tensor], heads: tuple[int, int], ttl_s: float = 600.0,
                 clock=time.monotonic, unpack_on_arrival: bool = True):
        self.pools = pools
        self.heads = heads
        self.ttl_s = ttl_s
        self.clock = clock
        self.unpack_on_arrival = unpack_on_arrival
        self._held: dict[str, _Held] = {}
        self._ready: dict[str, _Ready] = {}
        self._stream = None

    def __len__(self) -> int:
        return len(self._held) + len(self._ready)

    def feed(self, raw: bytes) -> list[bytes]:
        """One received notification -> the notifications to deliver now (plain ones at once)."""
        self._expire()
        parts = raw.split(SEP)
        if len(parts) != 3 or not names_heads(parts[0]):  # not what a slotted write sends: plain
            if self._ready:
                self._rewritten(raw)
            return [raw]
        notif, push_id, tail = parts
        n = parse_notification(notif)
        width = n.heads[1] - n.heads[0]
        try:
            blocks = self._check(decode_blocks(tail), n.heads)
        except KVLayoutError as e:
            log.error("request %s: bad slotted write dropped: %s", n.request_id, e)
            return []
        ready = self._ready.get(n.request_id)
        if ready is not None and ready.push_id != push_id:
            del self._ready[n.request_id]  # another push rewrites the pages
        held = self._held.get(n.request_id)
        if held is None or held.push_id != push_id or held.width != width or any(
                not np.array_equal(held.blocks.get(g, ()), b) for g, b in blocks.items()):
            held = self._held[n.request_id] = _Held(self.clock(), push_id, width, blocks)  # a new push
        held.heads.append(n.heads)
        held.notifs.append(notif)
        if not covers(held.heads, self.heads):
            return []
        del self._held[n.request_id]
        k = (self.heads[1] - self.heads[0]) // width
        if self.unpack_on_arrival:
            self._unpack(blocks, k)
        else:
            self._ready[n.request_id] = _Ready(self.clock(), push_id, blocks, k)
        return held.notifs

    def unpack(self, request_id: str, holds: dict[str, np.ndarray]) -> bool:
        """Deferred mode: put the request's ready slots in place, provided they lie in the blocks
        it holds (``holds``: pool -> block ids); True if pages were unpacked, False when there
        was nothing ready (its writes to this rank were not slotted) or it lay elsewhere."""
        ready = self._ready.pop(request_id, None)
        if ready is None:
            return False
        for g, b in ready.blocks.items():
            if not np.isin(b, np.asarray(holds.get(g, ()), dtype=np.int64)).all():
                log.error("request %s: slotted KV in %s blocks it does not hold: not unpacked", request_id, g)
                return False
        self._unpack(ready.blocks, ready.k)
        return True

    def _rewritten(self, raw: bytes) -> None:
        """A plain write for a request with ready slots: a later push writes its pages in place."""
        try:
            n = parse_notification(raw)
        except UnicodeDecodeError:
            return
        if n.kind == WRITE:
            self._ready.pop(n.request_id, None)

    def _check(self, blocks: dict[str, np.ndarray], heads: tuple[int, int]) -> dict[str, np.ndarray]:
        lo, hi = self.heads
        w = heads[1] - heads[0]
        if not (lo <= heads[0] < heads[1] <= hi and (hi - lo) % w == 0 and (heads[0] - lo) % w == 0):
            raise KVLayoutError(f"heads {heads} are not a slot of this rank's heads {self.heads}")
        for g, b in blocks.items():
            if g not in self.pools:
                raise KVLayoutError(f"unknown pool {g!r}")
            if b.shape[0] and (b.min() < 0 or b.max() >= self.pools[g].shape[1]
                               or np.unique(b).shape[0] != b.shape[0]):
                raise KVLayoutError(f"pool {g!r}: blocks outside [0, {self.pools[g].shape[1]}) or repeated")
        return blocks

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self._ready.pop(request_id, None)

    def _unpack(self, blocks: dict[str, np.ndarray], k: int) -> None:
        pool0 = next(iter(self.pools.values()))
        if pool0.is_cuda:
            # on its own stream, beside the decode steps (they touch other blocks; NIXL's bytes
            # are in memory once the notification came), and finished before the release
            if self._stream is None:
                self._stream = torch.cuda.Stream(pool0.device)
            with torch.cuda.stream(self._stream):
                for g, b in blocks.items():
                    unpack_slotted(self.pools[g], b, k)
            self._stream.synchronize()
        else:
            for g, b in blocks.items():
                unpack_slotted(self.pools[g], b, k)

    def _expire(self) -> None:
        if self._held or self._ready:
            now = self.clock()
            for rid in [r for r, h in self._held.items() if now - h.since > self.ttl_s]:
                log.warning("request %s: slotted KV writes incomplete after %g s: dropped", rid, self.ttl_s)
                del self._held[rid]
            for rid in [r for r, h in self._ready.items() if now - h.since > self.ttl_s]:
                del self._ready[rid]  # its request ended before every rank had its KV
