"""The start-up KV transfer self-test (kvtransfer/selftest.py): it measures the path the workers'
UCX settings allow, fails fast and clearly when that path does not exist, and the router exports
what each worker measured."""

from __future__ import annotations

import random

import httpx
import pytest

from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.selftest import _PAGE_BYTES, run_selftest, transfer_selftest
from router_harness import Cluster, harmony_ids, wait_for


def test_selftest_moves_the_bytes_and_reports_a_bandwidth(caplog):
    pages = random.randrange(8, 64)
    result = transfer_selftest("cpu", nbytes=pages * _PAGE_BYTES + 100, repeats=2)
    assert result.nbytes == pages * _PAGE_BYTES  # whole pages; the bytes are compared inside
    assert result.seconds > 0 and result.bytes_per_second > 0
    with caplog.at_level("INFO", logger="pdserve.kvtransfer.selftest"):
        assert run_selftest("cpu", 1 << 20, "127.0.0.1") > 0
    assert "KV transfer self-test" in caplog.text and "UCX 1." in caplog.text


def test_selftest_fails_at_once_without_a_usable_device(monkeypatch):
    """A pod whose UCX cannot reach its network device: an error at start, not at the first request."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "pdserve-missing0")
    with pytest.raises(KVTransferError, match="cannot start NIXL agent"):
        transfer_selftest("cpu", nbytes=_PAGE_BYTES)


def test_router_exports_each_workers_selftest():
    cluster = Cluster(num_prefill=1, num_decode=1, script=harmony_ids("<|channel|>final<|message|>ok<|return|>"))
    try:
        (decode,) = cluster.decode
        decode.kv_selftest = measured = random.uniform(1e9, 5e10)
        line = f'pdserve_worker_kv_selftest_bytes_per_second{{role="decode",worker="{decode.address}"}}'
        assert wait_for(lambda: any(
            ln.startswith(line) and abs(float(ln.split()[-1]) - measured) < 1
            for ln in httpx.get(cluster.base_url + "/metrics").text.splitlines()))
    finally:
        cluster.close()
