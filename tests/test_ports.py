"""pdserve.launch.ports: ports for servers a local cluster starts, out of the kernel's reach for
port-0 binds."""

from __future__ import annotations

import socket

from pdserve.launch.ports import ephemeral_range, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = ephemeral_range()
    ports = free_ports(6)
    assert len(set(ports)) == 6 and all(p < lo for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    ephemeral = [socket.socket() for _ in range(20)]  # what a worker binding port 0 gets
    try:
        for s in ephemeral:
            s.bind(("127.0.0.1", 0))
        assert not set(ports) & {s.getsockname()[1] for s in ephemeral}
    finally:
        for s in ephemeral:
            s.close()
