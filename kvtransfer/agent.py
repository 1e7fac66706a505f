"""One NIXL agent per worker rank: registers the rank's KV pools, learns peers from their
peer-info blobs, and moves pages to (WRITE) or from (READ) a peer with a completion
notification.

Flow for one request (prefill rank -> decode rank)::

    decode: blob = agent.peer_info()                      # sent to prefill over gRPC once
    prefill: peer = agent.add_peer(blob)                  # cached, idempotent
    prefill: h = agent.write_pages(peer, {"full": [(3, 17), ...], "sliding": [...]}, b"req-42")
    prefill: h.wait(timeout=30)                           # data is in the decode pages now
    decode:  agent.wait_notification(b"req-42", timeout=30)

Each ``write_pages`` is one NIXL transfer request whose notification NIXL delivers to the peer
after all its bytes landed (sent from the sender's ``wait``/``done`` polling, so always wait). Failures (unknown peer, bad ids, peer gone, timeout) raise
``KVTransferError`` and release or cancel the NIXL request, so the agent keeps working for other
peers. After a failed or aborted WRITE the destination pages hold garbage; the decode side frees
them with the request, and should ignore a notification for a request it already dropped.

Cost: transports pay per descriptor (measured ~10 us each with UCX over TCP and over cuda_ipc
on an H200), and NIXL posts synchronously. So ranges adjacent on both sides are fused
(``plan.merge_contiguous``: a run of consecutive blocks of a layer is one descriptor), and with
``staging_bytes`` a re-sharded WRITE to a rank owning a subset of our heads is packed into whole
pages first (``kvtransfer.staging``), and a WRITE to a rank owning more heads than ours whose
notification names the request and heads (``notify.kv_notification``) writes whole pages into
slots the receiving agent unpacks before it delivers the notification, or when the blocks'
owner says so (``unpack``; ``kvtransfer.reshard``).
Either way a run of consecutive destination blocks is one descriptor per layer; scattered
blocks cost one per (layer, page); other re-shardings one per (layer, page, k/v, token).

Transports: UCX_TLS is left to the user. UCX's default ("all") includes tcp, shared memory and,
on GPU hosts, cuda_ipc/cuda_copy; NIXL refuses a UCX_TLS without cuda when GPUs are present.
UCX_NET_DEVICES follows ``listen_host`` (see ``kvtransfer.netdev``).

Threads: all NIXL calls go through one lock (held while NIXL posts); waiting happens outside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from pdserve.kvtransfer.errors import KVLayoutError, KVTransferError
from pdserve.kvtransfer.handshake import PeerInfo, decode_peer_info, encode_peer_info
from pdserve.kvtransfer.layout import PoolLayout
from pdserve.kvtransfer.netdev import ucx_net_devices
from pdserve.kvtransfer.plan import (
    PoolCopy,
    as_block_pairs,
    merge_contiguous,
    pack_pages,
    plan_copy,
    plan_staging_nbytes,
)
from pdserve.kvtransfer.reshard import SEP, SlottedArrivals, encode_slots, names_heads
from pdserve.kvtransfer.staging import StagingBuffer
from pdserve.kvtransfer.ucx_info import ucx_summary

log = logging.getLogger(__name__)

_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _scoped_env(updates: Mapping[str, str]):
    """Set environment variables while a NIXL backend reads its UCX config, then restore."""
    with _ENV_LOCK:
        old = {k: os.environ.get(k) for k in updates}
        os.environ.update(updates)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:  # pragma: no cover - nixl is a hard dependency
        raise KVTransferError(f"NIXL is not importable: {e}") from e
    return nixl_agent, nixl_agent_config


def _core_agent(name: str, progress_poll_us: int):
    """The C++ agent behind ``nixl_agent``, built as its wrapper does (progress thread on,
    listener off, no telemetry) except for the progress thread's poll period, which the
    wrapper hard-codes to 0 (a busy loop). The wrapper reaches NIXL only through ``.agent``,
    so we swap it in before any backend exists."""
    import nixl._bindings as nixl_bindings

    if progress_poll_us < 0:
        raise KVLayoutError(f"progress_poll_us={progress_poll_us} must be >= 0")
    cfg = nixl_bindings.nixlAgentConfig()
    cfg.useProgThread = True
    cfg.useListenThread = False
    cfg.syncMode = nixl_bindings.NIXL_THREAD_SYNC_NONE  # our lock serializes calls
    cfg.pthrDelay = int(progress_poll_us)
    cfg.lthrDelay = 100000
    cfg.captureTelemetry = False
    return nixl_bindings.nixlAgent(name, cfg)


@dataclass
class _Peer:
    blob: bytes
    info: PeerInfo


class TransferHandle:
    """One posted transfer. Poll with ``done()`` or block with ``wait()``; both raise
    ``KVTransferError`` on failure and release the NIXL request once it finished or failed."""

    def __init__(self, agent: KVTransferAgent, peer: str, op: str, xfer, nbytes: int,
                 num_descs: int, staging_offset: int | None = None):
        self._agent = agent
        self._xfer = xfer  # None once released
        self._staging_offset = staging_offset  # packed source bytes NIXL reads from
        self._error: KVTransferError | None = None
        self._finished = xfer is None
        self._unreleased = False  # finished, but NIXL has not let go of the request yet
        self.peer = peer
        self.op = op
        self.nbytes = nbytes
        self.num_descs = num_descs

    def done(self) -> bool:
        """True once every byte is at its destination; False while in flight; raises on failure."""
        with self._agent._lock:
            if self._error is not None:
                raise self._error
            if self._finished:
                return True
            try:
                state = self._agent._nixl.check_xfer_state(self._xfer)
                cause = None
            except Exception as e:  # NIXL raises e.g. nixlRemoteDisconnectError
                state, cause = "ERR", e
            if state == "DONE":
                self._finish(None)
                return True
            if state == "ERR":
                self._finish(KVTransferError(
                    f"{self.op} of {self.nbytes} bytes with peer {self.peer!r} failed"
                    + (f": {type(cause).__name__}: {cause}" if cause else
                       " (peer unreachable or gone?)")))
                raise self._error
            return False

    def wait(self, timeout: float) -> None:
        """Block until done; on failure or after ``timeout`` seconds raise ``KVTransferError``
        (a timed-out transfer is cancelled first)."""
        deadline = time.monotonic() + timeout
        delay = 20e-6
        while not self.done():
            if time.monotonic() >= deadline:
                self.abort(f"timed out after {timeout:g} s")
                raise self._error
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)

    @property
    def settled(self) -> bool:
        """Finished and released by NIXL: none of its bytes can move any more."""
        with self._agent._lock:
            self._agent._retry_stuck()
            return self._finished and not self._unreleased

    def abort(self, reason: str = "aborted") -> None:
        """Cancel the transfer if still in flight (no-op once finished)."""
        with self._agent._lock:
            if not self._finished:
                self._finish(KVTransferError(
                    f"{self.op} of {self.nbytes} bytes with peer {self.peer!r} {reason}; "
                    "destination pages are undefined"))

    def _finish(self, error: KVTransferError | None) -> None:
        # lock held
        self._finished = True
        self._error = error
        self._agent._release_xfer(self._xfer, self._staging_offset, self)
        self._xfer = self._staging_offset = None
        self._agent._inflight.discard(self)


def _distinct_regions(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The non-empty tensors to register, one per memory region: of views starting at the same
    address, the largest (the others lie inside it)."""
    largest: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t.numel() and (t.data_ptr() not in largest or t.nbytes > largest[t.data_ptr()].nbytes):
            largest[t.data_ptr()] = t
    return list(largest.values())


class KVTransferAgent:
    """NIXL agent of one worker rank owning the KV ``pools`` for heads ``head_range``.

    Parameters
    ----------
    name : unique agent name across the cluster (e.g. ``"decode-0-rank1"``).
    pools : pool name -> contiguous tensor ``[n_layers, n_blocks, 2, page_size,
        num_kv_heads_local, head_dim]``, all on one device (CPU -> DRAM, CUDA -> VRAM); pools may
        be views of one tensor (engine.kv_cache: the layer groups share their blocks' memory),
        which is registered once.
    head_range : global KV heads ``[start, end)`` held by this rank.
    backend : NIXL backend plugin ("UCX").
    listen_host : address whose interface UCX may open TCP listeners on (see
        ``kvtransfer.netdev``); "0.0.0.0" for every interface.
    staging_bytes : size of a registered scratch buffer (on the pools' device) for packing
        re-sharded WRITEs to ranks holding a strict subset of our heads into whole pages (see
        ``kvtransfer.staging``); 0 disables it. A WRITE that does not fit in what is free falls
        back to per-token descriptors. Sizing: ``n_layers * pages * page_nbytes`` of the
        destination rank, summed over pools and over the transfers in flight at once.
    progress_poll_us : fallback wake-up period of NIXL's UCX progress thread, which otherwise
        sleeps in poll() until UCX has work. nixl's Python wrapper passes 0, which makes that
        thread spin a core per agent even when idle (measured); >= 1000 costs ~3% of a core.
    unpack_on_arrival : put slotted writes' heads in place as soon as this rank's slots of a
        request are all here; False leaves that to ``unpack``, which the owner of the blocks calls
        while the request still holds them (a decode worker's leader; kvtransfer.reshard).
    """

    def __init__(self, name: str, pools: Mapping[str, torch.Tensor], *,
                 head_range: tuple[int, int], backend: str = "UCX",
                 listen_host: str = "127.0.0.1", staging_bytes: int = 0,
                 progress_poll_us: int = 1000, unpack_on_arrival: bool = True):
        if not name or not isinstance(name, str):
            raise KVLayoutError("agent name must be a non-empty string")
        if not pools:
            raise KVLayoutError("an agent needs at least one KV pool")
        self.name = name
        self.backend = backend
        self._layouts = {g: PoolLayout.from_tensor(g, t, head_range) for g, t in pools.items()}
        devices = {lay.device for lay in self._layouts.values()}
        if len(devices) != 1:
            raise KVLayoutError(f"all pools of a rank must be on one device, got {sorted(devices)}")
        self._pools = dict(pools)  # keep the registered memory alive
        self._slotted = SlottedArrivals(self._pools, head_range, unpack_on_arrival=unpack_on_arrival)
        self._lock = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self._notifs: list[bytes] = []
        self._inflight: set[TransferHandle] = set()
        # (xfer, staging offset, handle) NIXL could not cancel yet; retried later, staging kept busy.
        self._stuck: list[tuple[object, int | None, TransferHandle | None]] = []
        self._reg: list = []
        self._closed = False
        if staging_bytes < 0:
            raise KVLayoutError(f"staging_bytes={staging_bytes} must be >= 0")
        lay0 = next(iter(self._layouts.values()))
        self._staging = (StagingBuffer(torch.empty(staging_bytes, dtype=torch.uint8,
                                                   device=lay0.device))
                         if staging_bytes else None)

        nixl_agent, nixl_agent_config = _nixl()
        env = {}
        if backend == "UCX":
            devs = ucx_net_devices(listen_host)
            if devs is not None:
                env["UCX_NET_DEVICES"] = devs
        try:
            # No NIXL listener thread: peer info travels over our gRPC handshake.
            self._nixl = nixl_agent(name, nixl_agent_config(enable_listen_thread=False,
                                                            backends=[]))
            self._nixl.agent = _core_agent(name, progress_poll_us)
            if backend not in self._nixl.get_plugin_list():
                raise KVTransferError(f"NIXL backend {backend!r} is not available "
                                      f"(have {self._nixl.get_plugin_list()})")
            with _scoped_env(env):
                self._nixl.create_backend(backend)
            for t in _distinct_regions(list(self._pools.values())) + ([self._staging.buf] if self._staging else []):
                self._reg.append(self._nixl.register_memory(t, backends=[backend]))
        except KVTransferError:
            raise
        except Exception as e:
            tls = os.environ.get("UCX_TLS", "<UCX default>")
            raise KVTransferError(f"cannot start NIXL agent {name!r} with backend {backend} "
                                  f"(UCX_TLS={tls}, {env}; NIXL's log above says why): "
                                  f"{type(e).__name__}: {e}") from e
        log.info("KV agent %s: pools %s, heads %s; %s (UCX_NET_DEVICES here: %s)", name,
                 {g: lay.shape for g, lay in self._layouts.items()}, head_range, ucx_summary(),
                 env.get("UCX_NET_DEVICES", os.environ.get("UCX_NET_DEVICES", "<all>")))

    # -- handshake ------------------------------------------------------------------------------
    @property
    def layouts(self) -> dict[str, PoolLayout]:
        return dict(self._layouts)

    @property
    def head_range(self) -> tuple[int, int]:
        return next(iter(self._layouts.values())).heads

    def peer_info(self) -> bytes:
        """NIXL metadata + pool layouts as one blob for the peer's ``add_peer`` (no KV bytes)."""
        with self._lock:
            self._check_open()
            return encode_peer_info(self.name, self._layouts, self._nixl.get_agent_metadata())

    def add_peer(self, peer_info: bytes) -> str:
        """Learn a peer from its ``peer_info()`` blob; returns its name. Adding the same blob
        again is a no-op; a new blob under a known name (peer restarted) replaces the old one."""
        info = decode_peer_info(peer_info)
        if len({lay.device for lay in info.pools.values()}) > 1:
            raise KVLayoutError(f"peer {info.name!r} has pools on several devices")
        with self._lock:
            self._check_open()
            if info.name == self.name:
                raise KVLayoutError(f"peer name {info.name!r} is this agent's own name")
            old = self._peers.get(info.name)
            if old is not None:
                if old.blob == bytes(peer_info):
                    return info.name
                self._forget_peer(info.name)
            try:
                loaded = self._nixl.add_remote_agent(info.nixl_metadata)
                if isinstance(loaded, bytes):
                    loaded = loaded.decode()
            except Exception as e:
                raise KVTransferError(f"cannot load metadata of peer {info.name!r}: "
                                      f"{type(e).__name__}: {e}") from e
            if loaded != info.name:
                self._invalidate(loaded)
                raise KVLayoutError(f"peer-info names {info.name!r} but its NIXL metadata "
                                    f"belongs to {loaded!r}")
            self._peers[info.name] = _Peer(bytes(peer_info), info)
            return info.name

    def remove_peer(self, peer_name: str) -> None:
        """Forget a peer (cancels transfers still in flight with it); unknown names are ignored."""
        with self._lock:
            self._check_open()
            if peer_name in self._peers:
                self._forget_peer(peer_name)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def peer_pools(self, peer_name: str) -> dict[str, PoolLayout]:
        """Pool layouts a peer published (e.g. to pick the decode ranks sharing our heads)."""
        with self._lock:
            return dict(self._peer(peer_name).info.pools)

    # -- transfers ------------------------------------------------------------------------------
    def write_pages(self, peer_name: str, pages: Mapping[str, object],
                    notif: bytes, push_id: str = "") -> TransferHandle:
        """WRITE local pages into the peer's pages: pool -> [(local_block, remote_block)], every
        layer of the pool, only the KV heads both ranks hold. ``notif`` reaches the peer's
        ``take_notifications``/``wait_notification`` once all bytes landed. ``push_id`` names
        the push this write belongs to (the same on every sender of it; kvtransfer.reshard).

        NIXL sends ``notif`` when this side sees the data complete, i.e. inside the handle's
        ``done()``/``wait()``: always wait on (or poll) the handle, or the peer never hears."""
        return self._post("WRITE", peer_name, pages, notif, push_id)

    def read_pages(self, peer_name: str, pages: Mapping[str, object],
                   notif: bytes = b"") -> TransferHandle:
        """READ the peer's pages into local pages (pull): pool -> [(local_block, remote_block)].
        A non-empty ``notif`` tells the peer once the read finished (it may free its pages)."""
        flipped = {g: as_block_pairs(p, g)[:, ::-1] for g, p in pages.items()}
        return self._post("READ", peer_name, flipped, notif)

    def _post(self, op: str, peer_name: str, pages, notif: bytes, push_id: str = "") -> TransferHandle:
        if not isinstance(notif, (bytes, bytearray)):
            raise KVLayoutError(f"notif must be bytes, got {type(notif).__name__}")
        notif = bytes(notif)
        with self._lock:
            self._check_open()
            peer = self._peer(peer_name)
            # ``pages`` pairs are (src_block, dst_block): local -> remote for WRITE.
            if op == "WRITE":
                src, dst = self._layouts, peer.info.pools
            else:
                src, dst = peer.info.pools, self._layouts
            staging = None
            try:
                if op == "WRITE" and self._staging is not None:
                    need = plan_staging_nbytes(src, dst, pages)
                    staging = self._staging.alloc(need) if need else None
                    if need and staging is None:
                        log.debug("KV agent %s: staging full (%d of %d bytes used), sending %d "
                                  "bytes per token", self.name, self._staging.used,
                                  self._staging.nbytes, need)
                slotted = op == "WRITE" and names_heads(notif)
                copies = [merge_contiguous(c) for c in plan_copy(src, dst, pages, staging, slotted)]
                slots = {c.pool: c.dst_blocks for c in copies if c.slotted}
                if slots:
                    notif = notif + SEP + encode_slots(push_id, slots)
            except KVLayoutError as e:
                self._free_staging(staging)
                raise KVLayoutError(f"{op} with peer {peer_name!r}: {e}") from None
            nbytes = sum(c.nbytes for c in copies)
            num_descs = sum(c.num_descs for c in copies)
            if num_descs == 0:
                self._free_staging(staging)
                if notif:
                    self._send_notif(peer_name, notif)
                return TransferHandle(self, peer_name, op, None, 0, 0)
            try:
                if staging is not None:
                    self._pack(copies, peer.info.pools)
                local, remote = self._descs(op, copies, peer.info.pools)
                xfer = self._nixl.initialize_xfer(
                    op, self._nixl.get_xfer_descs(local, self._mem_type(self._layouts)),
                    self._nixl.get_xfer_descs(remote, self._mem_type(peer.info.pools)),
                    peer_name, notif, backends=[self.backend])
            except Exception as e:
                self._free_staging(staging)
                raise KVTransferError(f"cannot create {op} of {nbytes} bytes with peer "
                                      f"{peer_name!r}: {type(e).__name__}: {e}") from e
            handle = TransferHandle(self, peer_name, op, xfer, nbytes, num_descs, staging)
            self._inflight.add(handle)
            try:
                state = self._nixl.transfer(xfer)
            except Exception as e:
                handle._finish(KVTransferError(f"cannot post {op} of {nbytes} bytes with peer "
                                               f"{peer_name!r}: {type(e).__name__}: {e}"))
                raise handle._error from e
            if state == "ERR":
                handle._finish(KVTransferError(f"{op} of {nbytes} bytes with peer {peer_name!r} "
                                               "failed when posted (peer unreachable or gone?)"))
                raise handle._error
            if state == "DONE":
                handle._finish(None)
            return handle

    def _pack(self, copies: list[PoolCopy], remote: Mapping[str, PoolLayout]) -> None:
        """Gather the staged copies' pages into the staging buffer; wait for the device."""
        for c in copies:
            if c.staged:
                pack_pages(self._pools[c.pool], self._layouts[c.pool], remote[c.pool], c,
                           self._staging.buf)
        if self._staging.buf.is_cuda:
            torch.cuda.current_stream(self._staging.buf.device).synchronize()

    def _descs(self, op: str, copies: list[PoolCopy],
               remote: Mapping[str, PoolLayout]) -> tuple[np.ndarray, np.ndarray]:
        """NIXL descriptor rows ``(addr, len, device_id)``, uint64 ``(m, 3)``, local and remote."""
        write = op == "WRITE"
        local_rows, remote_rows = [], []
        for c in copies:
            lay, rlay = self._layouts[c.pool], remote[c.pool]
            local_base = self._staging.buf.data_ptr() if c.staged else lay.addr
            for rows, base, off, dev in (
                    (local_rows, local_base, c.src_offsets if write else c.dst_offsets,
                     lay.device_id),
                    (remote_rows, rlay.addr, c.dst_offsets if write else c.src_offsets,
                     rlay.device_id)):
                r = np.empty((off.shape[0], 3), dtype=np.uint64)
                r[:, 0] = off + base
                r[:, 1] = c.lengths
                r[:, 2] = dev
                rows.append(r)
        return np.concatenate(local_rows), np.concatenate(remote_rows)

    @staticmethod
    def _mem_type(pools: Mapping[str, PoolLayout]) -> str:
        return next(iter(pools.values())).mem_type

    # -- notifications (receiver side) ----------------------------------------------------------
    def take_notifications(self) -> list[bytes]:
        """Notifications from any peer that arrived since the last call (oldest first)."""
        with self._lock:
            self._check_open()
            self._pull_notifs()
            out, self._notifs = self._notifs, []
            return out

    def wait_notification(self, notif: bytes, timeout: float) -> bool:
        """True once ``notif`` arrived (consumed); False after ``timeout`` seconds. Other
        notifications stay queued for ``take_notifications``."""
        deadline = time.monotonic() + timeout
        delay = 20e-6
        while True:
            with self._lock:
                self._check_open()
                self._pull_notifs()
                if notif in self._notifs:
                    self._notifs.remove(notif)
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)

    def unpack(self, requests: list[tuple[str, dict[str, list[int]]]]) -> list[str]:
        """With ``unpack_on_arrival=False``: put in place the slotted writes of these requests
        whose slots are all here, each given with the blocks it holds (pool -> block ids); the
        ids of those unpacked (finished on the device) before this returns."""
        with self._lock:
            self._check_open()
            return [rid for rid, holds in requests if self._slotted.unpack(rid, holds)]

    def send_notification(self, peer_name: str, notif: bytes) -> None:
        """Send a notification not tied to a transfer (e.g. "request cancelled")."""
        with self._lock:
            self._check_open()
            self._peer(peer_name)
            self._send_notif(peer_name, bytes(notif))

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel transfers in flight, disconnect peers, deregister pools. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for h in list(self._inflight):
                h.abort("aborted: agent closed")
            for name in list(self._peers):
                self._forget_peer(name)
            self._retry_stuck()
            for reg in self._reg:
                try:
                    self._nixl.deregister_memory(reg)
                except Exception as e:  # best effort: the process may be going down
                    log.warning("KV agent %s: deregister failed: %s", self.name, e)
            self._reg.clear()
            self._closed = True
            self._nixl = None

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals (lock held) ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"KV agent {self.name!r} is closed")

    def _peer(self, name: str) -> _Peer:
        try:
            return self._peers[name]
        except KeyError:
            raise KVLayoutError(f"unknown peer {name!r}; add_peer() its peer_info first "
                                f"(known: {sorted(self._peers)})") from None

    def _forget_peer(self, name: str) -> None:
        for h in [h for h in self._inflight if h.peer == name]:
            h.abort("aborted: peer removed")
        del self._peers[name]
        self._invalidate(name)

    def _invalidate(self, name: str) -> None:
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as e:  # already gone on NIXL's side
            log.warning("KV agent %s: removing peer %s: %s", self.name, name, e)

    def _send_notif(self, peer_name: str, notif: bytes) -> None:
        try:
            # (nixl 1.5.1's send_notif(backend=...) passes a bare handle where a list is needed,
            # so let NIXL pick; the agent has one backend anyway.)
            self._nixl.send_notif(peer_name, notif)
        except Exception as e:
            raise KVTransferError(f"cannot notify peer {peer_name!r}: "
                                  f"{type(e).__name__}: {e}") from e

    def _pull_notifs(self) -> None:
        try:
            new = self._nixl.get_new_notifs()
        except Exception as e:
            raise KVTransferError(f"reading notifications failed: {type(e).__name__}: {e}") from e
        for msgs in new.values():
            for m in msgs:
                self._notifs.extend(self._slotted.feed(bytes(m)))

    def _free_staging(self, offset: int | None) -> None:
        if offset is not None:
            self._staging.free(offset)

    def _release_xfer(self, xfer, staging: int | None, handle: TransferHandle | None = None) -> None:
        """Release (cancelling if active) a NIXL request, then its staging region. If NIXL
        refuses, keep both for a retry: the request may still read the staging bytes (and write
        the peer's pages: the handle is not `settled` until then)."""
        self._retry_stuck()
        if xfer is not None:
            try:
                xfer.release()
            except Exception as e:
                log.warning("KV agent %s: NIXL could not release a transfer yet (%s); "
                            "retrying later", self.name, e)
                self._stuck.append((xfer, staging, handle))
                if handle is not None:
                    handle._unreleased = True
                return
        self._free_staging(staging)

    def _retry_stuck(self) -> None:
        still = []
        for xfer, staging, handle in self._stuck:
            try:
                xfer.release()
            except Exception:
                still.append((xfer, staging, handle))
            else:
                self._free_staging(staging)
                if handle is not None:
                    handle._unreleased = False
        self._stuck = still
