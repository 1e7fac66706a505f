"""Start-up check of the KV transfer path: how fast this worker's transports move bytes.

Two NIXL agents in this process, each with its own UCX context and a KV-shaped pool on the worker's
device, WRITE one pool into the other and time it. Separate agents cannot use UCX's in-process
`self` transport, so the bytes take the path UCX_TLS allows between processes: with the Helm
chart's RDMA settings (rc, no shared memory or cuda_ipc) that is a loopback through the HCA, GPU
memory registered for GPUDirect RDMA, the same path as to a peer pod on another node. A pod
without a usable HCA fails here, at start, instead of on the first request; a figure of about 1
GB/s or less says UCX runs over TCP.

The result is logged and reported in every LoadReport (`kv_selftest_bytes_per_second`), which the
router exports as `pdserve_worker_kv_selftest_bytes_per_second`.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.agent import KVTransferAgent
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.ucx_info import ucx_summary

log = logging.getLogger(__name__)

# one KV page of a gpt-oss layer at TP1: 16 tokens x 8 heads x 64 dims, K and V, bf16 = 32 KiB
_PAGE_SHAPE = (2, 16, 8, 64)
_PAGE_BYTES = 2 * 16 * 8 * 64 * 2


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    nbytes: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.seconds


def transfer_selftest(device: str, *, nbytes: int, listen_host: str = "127.0.0.1",
                      repeats: int = 3, timeout_s: float = 60.0) -> SelfTestResult:
    """WRITE `nbytes` (rounded to whole 32 KiB pages) between two agents on `device`, `repeats`
    times after one warm-up; returns the fastest. Raises KVTransferError when the path is broken."""
    if nbytes < _PAGE_BYTES or repeats < 1:
        raise ValueError(f"nbytes must be >= {_PAGE_BYTES} and repeats >= 1")
    pages = nbytes // _PAGE_BYTES
    source = torch.randint(-100, 100, (1, pages, *_PAGE_SHAPE), device=device).to(torch.bfloat16)
    target = torch.zeros_like(source)
    tag = uuid.uuid4().hex[:8]
    heads = (0, _PAGE_SHAPE[2])
    with KVTransferAgent(f"selftest-src-{tag}", {"full": source}, head_range=heads,
                         listen_host=listen_host) as src, \
         KVTransferAgent(f"selftest-dst-{tag}", {"full": target}, head_range=heads,
                         listen_host=listen_host) as dst:
        peer = src.add_peer(dst.peer_info())
        blocks = [(b, b) for b in range(pages)]
        best = float("inf")
        for i in range(repeats + 1):
            start = time.perf_counter()
            src.write_pages(peer, {"full": blocks}, f"selftest-{i}".encode()).wait(timeout_s)
            if i:  # the first one opens the connection
                best = min(best, time.perf_counter() - start)
        if not torch.equal(source, target):
            raise KVTransferError("KV self-test: the bytes that arrived differ from those sent")
    return SelfTestResult(pages * _PAGE_BYTES, best)


def run_selftest(device: str, nbytes: int, listen_host: str) -> float:
    """The worker's start-up check: log the result (and the UCX in use); returns bytes/s."""
    result = transfer_selftest(device, nbytes=nbytes, listen_host=listen_host)
    log.info("KV transfer self-test: %.2f GB/s (%d MiB in %.2f ms, %s); ~1 GB/s or less means TCP",
             result.bytes_per_second / 1e9, result.nbytes >> 20, result.seconds * 1e3, ucx_summary())
    return result.bytes_per_second
