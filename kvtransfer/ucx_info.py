"""What UCX a worker runs: the version of the UCX library NIXL loaded and the transport settings,
logged when a KV agent starts so an operator can tell from the log alone which UCX moves the KV.

The per-peer transport UCX picks (rc_mlx5/mlx5_0:1 for RDMA, tcp/eth0 when it fell back) is
printed by UCX itself with UCX_PROTO_INFO=y, which the Helm chart sets.
"""

from __future__ import annotations

import ctypes
import glob
import os
from functools import cache

_SETTINGS = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_IB_GPU_DIRECT_RDMA", "UCX_PROTO_INFO")


@cache
def ucx_version() -> str:
    """Version string of the libucp bundled with the installed NIXL wheel ("unknown" if none)."""
    import importlib.util

    for package in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = os.path.dirname(next(iter(spec.submodule_search_locations)))
        for path in sorted(glob.glob(os.path.join(root, f"{package}.libs", "libucp*.so*"))):
            try:
                get = ctypes.CDLL(path).ucp_get_version_string
            except (OSError, AttributeError):
                continue
            get.restype = ctypes.c_char_p
            return get().decode()
    return "unknown"


def ucx_summary() -> str:
    """One log line's worth: UCX version and the UCX_* settings in force."""
    settings = ", ".join(f"{name}={os.environ.get(name, '<default>')}" for name in _SETTINGS)
    return f"UCX {ucx_version()}, {settings}"
