"""Free TCP ports on 127.0.0.1 for servers that a local cluster is about to start (the router of a
spawned benchmark cluster, the servers of the tests)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# above the well-known ports and Ray's default worker port range (10002-19999), which `ray start`
# checks every port it is given against
LOWEST = 20_000


def ephemeral_range() -> tuple[int, int]:
    """The range the kernel hands out for port 0 (Linux: ip_local_port_range)."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """n distinct ports, free now, chosen *below* the kernel's ephemeral range. A port taken from
    that range (bind to port 0, then close) can be handed out again to any socket bound to port 0
    before the server that was meant to have it binds it: the workers, UCX listeners and clients
    started first do exactly that (a router then failed with "already in use"). Below the range only
    an explicit bind can take it. All are held open while choosing, so no two are the same."""
    lo, _ = ephemeral_range()
    candidates = random.sample(range(LOWEST, lo), min(lo - LOWEST, 64 * n))
    socks, ports = [], []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
            if len(ports) == n:
                return ports
    finally:
        for s in socks:
            s.close()
    raise RuntimeError(f"no {n} free ports in [{LOWEST}, {lo}) on 127.0.0.1")


def server_ports() -> dict[str, int]:
    """`port` and `grpc_port` for a ClusterSpec (two distinct free ports)."""
    port, grpc_port = free_ports(2)
    return {"port": port, "grpc_port": grpc_port}
