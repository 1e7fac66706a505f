"""Keep UCX's sockets on the interface the operator chose.

What listens (measured with ``ss -ltnp`` on nixl 1.5.1 / its bundled UCX):

* The NIXL listener thread (``nixl_agent_config(enable_listen_thread=True)``, port 5555) is never
  started here: peer info travels over our own gRPC handshake instead.
* UCX's TCP transport opens one listening socket per network interface it uses, bound to that
  interface's address (e.g. ``127.0.0.1:<random>`` and ``192.0.2.2:<random>``), never 0.0.0.0.
  So restricting UCX's network devices to the interface owning ``listen_host`` restricts the
  listeners to ``listen_host``. The UCX plugin's own ``device_list`` parameter cannot do this
  (it appends ``:1`` to every name, which only fits RDMA ports), so the agent sets
  ``UCX_NET_DEVICES`` while it creates the backend.
* RDMA ports (``mlx5_0:1``...) open no sockets (endpoints connect from the worker address in
  the peer info), so they stay enabled; shared-memory and CUDA transports are not network
  devices and are unaffected.

A ``UCX_NET_DEVICES`` set by the user always wins; ``listen_host="0.0.0.0"`` keeps every device.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from pdserve.kvtransfer.errors import KVTransferError

_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_LOOPBACK = 0x8


def _ipv4_of(ifname: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return ipaddress.IPv4Address(res[20:24])


def _is_loopback(ifname: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return False
    return bool(struct.unpack_from("H", res, 16)[0] & _IFF_LOOPBACK)


def _ipv6_addrs() -> list[tuple[ipaddress.IPv6Address, str]]:
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [(ipaddress.IPv6Address(int(r[0], 16)), r[5]) for r in rows if len(r) >= 6]


def interface_of(host: str) -> str:
    """Name of the local network interface that owns ``host`` (an address or a host name)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise KVTransferError(f"listen_host {host!r} does not resolve: {e}") from e
    addrs = {ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos}
    names = [n for _, n in socket.if_nameindex()]
    for name in names:
        if _ipv4_of(name) in addrs:
            return name
    for addr6, name in _ipv6_addrs():
        if addr6 in addrs:
            return name
    if any(a.is_loopback for a in addrs):
        for name in names:
            if _is_loopback(name):
                return name
    raise KVTransferError(
        f"listen_host {host!r} ({', '.join(map(str, sorted(addrs, key=str)))}) is not an address "
        f"of any local interface ({', '.join(names)}); pass the address of the interface KV "
        "transfers should use, or 0.0.0.0 for all of them"
    )


def rdma_ports() -> list[str]:
    """UCX names (``dev:port``) of the host's RDMA ports; empty without RDMA hardware."""
    root = "/sys/class/infiniband"
    out = []
    try:
        devs = sorted(os.listdir(root))
    except OSError:
        return out
    for dev in devs:
        try:
            ports = sorted(os.listdir(os.path.join(root, dev, "ports")), key=int)
        except (OSError, ValueError):
            continue
        out += [f"{dev}:{p}" for p in ports]
    return out


def ucx_net_devices(listen_host: str) -> str | None:
    """Value for ``UCX_NET_DEVICES`` that keeps TCP listeners on ``listen_host``, or None to leave
    UCX's choice alone (user already set it, or ``listen_host`` is a wildcard)."""
    if os.environ.get("UCX_NET_DEVICES"):
        return None
    if listen_host in ("0.0.0.0", "::", "*", "all"):
        return None
    return ",".join([interface_of(listen_host)] + rdma_ports())
