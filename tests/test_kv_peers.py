"""The handshake: decode ranks' peer info as a protobuf message, learned once per decode worker."""

from __future__ import annotations

import random

import grpc
import pytest

from pdserve.prefill_worker.kv_peers import KVPeerDirectory, UnknownKVPeer
from pdserve.proto import pdserve_pb2 as pb


class FakeDecode:
    def __init__(self):
        self.calls: list[str] = []
        self.agents: dict[str, list[str]] = {}  # address -> its ranks' agent names
        self.down: set[str] = set()

    def __call__(self, address: str, timeout_s: float):
        self.calls.append(address)
        if address in self.down:
            raise _RpcError()
        return [pb.KVPeerInfo(agent_name=n, nixl_metadata=n.encode()) for n in self.agents.get(address, [])]


class _RpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def test_peers_are_fetched_once_per_decode_worker_and_refetched_after_a_restart():
    d = FakeDecode()
    ranks = random.randint(1, 4)
    d.agents["dec-a:1"] = [f"a-r{r}-x" for r in range(ranks)]
    d.agents["dec-b:1"] = ["b-r0-x"]
    peers = KVPeerDirectory(d)
    for _ in range(random.randint(2, 6)):  # many requests, one handshake per decode worker
        got = peers.resolve(d.agents["dec-a:1"], "dec-a:1")
        assert list(got) == d.agents["dec-a:1"]
        assert pb.KVPeerInfo.FromString(got["a-r0-x"]).nixl_metadata == b"a-r0-x"
        peers.resolve(["b-r0-x"], "dec-b:1")
    assert d.calls == ["dec-a:1", "dec-b:1"]
    d.agents["dec-a:1"] = [f"a-r{r}-y" for r in range(ranks)]  # restarted: new agents
    assert list(peers.resolve(d.agents["dec-a:1"], "dec-a:1")) == d.agents["dec-a:1"]
    assert d.calls == ["dec-a:1", "dec-b:1", "dec-a:1"]


def test_unknown_peers_give_a_clear_error():
    d = FakeDecode()
    d.agents["dec:1"] = ["r0"]
    peers = KVPeerDirectory(d, capacity=1)
    with pytest.raises(UnknownKVPeer, match="does not know KV agent 'gone'"):
        peers.resolve(["gone"], "dec:1")
    with pytest.raises(UnknownKVPeer, match="no decode worker address"):
        peers.resolve(["other"], "")
    d.down.add("dead:1")
    with pytest.raises(UnknownKVPeer, match="UNAVAILABLE: connection refused"):
        peers.resolve(["x"], "dead:1")
    d.agents["dec2:1"] = ["s0"]
    peers.resolve(["s0"], "dec2:1")
    peers.resolve(["r0"], "dec:1")  # evicted by capacity 1: asked again
    assert d.calls == ["dec:1", "dead:1", "dec2:1", "dec:1"]
