"""Free TCP ports on 127.0.0.1 for tests that start servers in other processes."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel hands out now: all held open while choosing, so no two are the
    same (closing one before asking for the next can return it again). Another process can still
    take one before the server binds it; tests that cannot afford that retry on EADDRINUSE."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def server_ports() -> dict[str, int]:
    """`port` and `grpc_port` for a ClusterSpec (two distinct free ports)."""
    port, grpc_port = free_ports(2)
    return {"port": port, "grpc_port": grpc_port}
