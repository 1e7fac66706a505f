"""Free TCP ports on 127.0.0.1 for tests that start servers in other processes
(pdserve.launch.ports says why they come from below the kernel's ephemeral range)."""

from __future__ import annotations

from pdserve.launch.ports import free_ports, server_ports

__all__ = ["free_ports", "server_ports"]
