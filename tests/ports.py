"""Free TCP ports on 127.0.0.1 for tests that start servers in other processes
(pdserve.launch.ports says why they come from below the kernel's ephemeral range)."""

from __future__ import annotations

from pdserve.launch.ports import free_ports

__all__ = ["free_ports", "server_ports"]


def server_ports() -> dict[str, int]:
    """`port` and `grpc_port` for a ClusterSpec (two distinct free ports)."""
    port, grpc_port = free_ports(2)
    return {"port": port, "grpc_port": grpc_port}
