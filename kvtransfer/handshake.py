"""The opaque peer-info blob exchanged at handshake (over gRPC): NIXL agent metadata plus the
layouts of the rank's pools. It carries addresses and connection info, never KV bytes.

Wire format (no pickle: the blob comes from the network)::

    b"PDSKV1\\n" | u32 big-endian header length | UTF-8 JSON header | NIXL metadata bytes

with header ``{"name": str, "pools": [PoolLayout.to_dict(), ...]}``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from pdserve.kvtransfer.errors import KVLayoutError
from pdserve.kvtransfer.layout import PoolLayout

MAGIC = b"PDSKV1\n"
_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class PeerInfo:
    name: str
    pools: dict[str, PoolLayout]
    nixl_metadata: bytes


def encode_peer_info(name: str, pools: dict[str, PoolLayout], nixl_metadata: bytes) -> bytes:
    header = json.dumps({"name": name, "pools": [p.to_dict() for p in pools.values()]},
                        separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(header)) + header + bytes(nixl_metadata)


def decode_peer_info(blob: bytes) -> PeerInfo:
    """Parse and validate a blob from ``encode_peer_info``; KVLayoutError if malformed."""
    blob = bytes(blob)
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _LEN.size:
        raise KVLayoutError("not a pdserve KV peer-info blob (bad magic or truncated)")
    (n,) = _LEN.unpack_from(blob, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if start + n > len(blob):
        raise KVLayoutError("truncated KV peer-info blob")
    try:
        header = json.loads(blob[start:start + n].decode())
        name = header["name"]
        pools = [PoolLayout.from_dict(d) for d in header["pools"]]
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, KVLayoutError):
            raise
        raise KVLayoutError(f"malformed KV peer-info header: {e}") from e
    if not isinstance(name, str) or not name:
        raise KVLayoutError("KV peer-info blob has no agent name")
    by_name = {p.name: p for p in pools}
    if len(by_name) != len(pools):
        raise KVLayoutError(f"peer {name!r} lists a pool twice")
    metadata = blob[start + n:]
    if not metadata:
        raise KVLayoutError(f"peer {name!r} sent no NIXL metadata")
    return PeerInfo(name=name, pools=by_name, nixl_metadata=metadata)
