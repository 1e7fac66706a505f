"""The peer info a worker rank hands out once per worker pair (the handshake): its NIXL agent
metadata plus the layouts of its KV pools, as a `KVPeerInfo` protobuf message (proto/pdserve.proto).
It carries addresses and connection info, never KV bytes. Bytes on the wire are the message's
deterministic serialization, so the same info always gives the same blob.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from pdserve.kvtransfer.errors import KVLayoutError
from pdserve.kvtransfer.layout import PoolLayout
from pdserve.proto import pdserve_pb2 as pb


@dataclass(frozen=True)
class PeerInfo:
    name: str
    pools: dict[str, PoolLayout]
    nixl_metadata: bytes


def peer_info_message(name: str, pools: dict[str, PoolLayout], nixl_metadata: bytes) -> pb.KVPeerInfo:
    return pb.KVPeerInfo(
        agent_name=name, nixl_metadata=bytes(nixl_metadata),
        pools=[pb.KVPoolLayout(name=p.name, addr=p.addr, shape=list(p.shape), dtype=p.dtype,
                               device=p.device, head_start=p.head_start, head_end=p.head_end)
               for p in pools.values()])


def encode_peer_info(name: str, pools: dict[str, PoolLayout], nixl_metadata: bytes) -> bytes:
    return peer_info_message(name, pools, nixl_metadata).SerializeToString(deterministic=True)


def decode_peer_info(blob: bytes) -> PeerInfo:
    """Parse and validate a blob from ``encode_peer_info``; KVLayoutError if malformed."""
    msg = pb.KVPeerInfo()
    try:
        msg.ParseFromString(bytes(blob))
    except DecodeError as e:
        raise KVLayoutError(f"not a KV peer-info message: {e}") from None
    if not msg.agent_name:
        raise KVLayoutError("KV peer info has no agent name")
    pools = [PoolLayout(name=p.name, addr=p.addr, shape=tuple(p.shape), dtype=p.dtype, device=p.device,
                        head_start=p.head_start, head_end=p.head_end) for p in msg.pools]
    if not pools:
        raise KVLayoutError(f"peer {msg.agent_name!r} lists no KV pool")
    by_name = {p.name: p for p in pools}
    if len(by_name) != len(pools):
        raise KVLayoutError(f"peer {msg.agent_name!r} lists a pool twice")
    if not msg.nixl_metadata:
        raise KVLayoutError(f"peer {msg.agent_name!r} sent no NIXL metadata")
    return PeerInfo(name=msg.agent_name, pools=by_name, nixl_metadata=msg.nixl_metadata)
