"""The decode ranks a prefill worker writes to, learned once per decode worker (the handshake).

A Prefill request names its decode ranks by NIXL agent name only (KVPlacement.kv_agent_name) and
carries the decode worker's gRPC address. The first time a name is unknown, the worker asks that
decode worker once (`KVMetadata`) for the peer info of all its ranks and keeps it; later requests
to the same decode worker carry block ids only. A restarted decode worker has new agent names, so
a miss asks again; entries of decode workers that went away age out (least recently used first).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

import grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class UnknownKVPeer(RuntimeError):
    """The decode worker's ranks could not be learned (unreachable, or it does not know them)."""


def fetch_kv_peers(address: str, timeout_s: float) -> list[pb.KVPeerInfo]:
    """Ask the decode worker at `address` for the peer info of every one of its ranks."""
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.DecodeWorkerStub(channel).KVMetadata(pb.KVMetadataRequest(), timeout=timeout_s)
    return list(reply.peers)


class KVPeerDirectory:
    """agent name -> peer-info blob (serialized `KVPeerInfo`, what `KVTransferAgent.add_peer`
    takes), filled on demand from the decode workers. Thread-safe."""

    def __init__(self, fetch: Callable[[str, float], list] = fetch_kv_peers, *, capacity: int = 1024,
                 timeout_s: float = 10.0):
        self._fetch = fetch
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._peers: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def resolve(self, names: list[str], address: str) -> dict[str, bytes]:
        """Blobs of the agents `names`, asking the decode worker at `address` for missing ones."""
        with self._lock:
            missing = [n for n in names if n not in self._peers]
        if missing:
            if not address:
                raise UnknownKVPeer(f"decode KV agents {missing} are unknown and the request names no "
                                    "decode worker address to ask")
            try:
                infos = self._fetch(address, self.timeout_s)
            except grpc.RpcError as e:
                raise UnknownKVPeer(f"cannot ask decode worker {address} for its KV peers: "
                                    f"{e.code().name}: {e.details()}") from None
            log.info("learned KV peers %s from decode worker %s", [i.agent_name for i in infos], address)
            with self._lock:
                for info in infos:
                    self._peers[info.agent_name] = info.SerializeToString(deterministic=True)
        with self._lock:
            out = {}
            for n in names:
                if n not in self._peers:
                    raise UnknownKVPeer(f"decode worker {address} does not know KV agent {n!r} "
                                        "(restarted since it reserved?)")
                self._peers.move_to_end(n)
                out[n] = self._peers[n]
            while len(self._peers) > self.capacity:
                self._peers.popitem(last=False)
            return out
