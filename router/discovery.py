"""Where the router's workers are: the discovery interface and its static backend.

A backend reports the *whole* current set of workers every time it changes, never deltas: the
router's registry diffs the set against what it holds, so a missed or repeated call cannot leave
it inconsistent. Backends: `static` (addresses from flags), `kubernetes` (EndpointSlices of the
workers' headless Services, `router.discovery_k8s`); `ray` is added by the Ray launcher.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, runtime_checkable

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


class DiscoveryError(ValueError):
    """Discovery is misconfigured (unknown kind, bad address, missing credentials or options)."""


@dataclass(frozen=True, order=True)
class WorkerEndpoint:
    """One worker process: its role, its gRPC address `host:port` and a stable display name."""

    role: str  # "prefill" | "decode"
    address: str  # "host:port", IPv6 hosts in brackets: "[fd00::1]:50061"
    name: str  # pod name, actor name, or the address itself

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise DiscoveryError(f"worker role must be one of {ROLES}, not {self.role!r}")


OnChange = Callable[[list[WorkerEndpoint]], None]


@runtime_checkable
class Discovery(Protocol):
    def start(self, on_change: OnChange) -> None:
        """Begin reporting; `on_change` gets the full current set (sorted) whenever it changes.

        It may be called from any thread, never concurrently with itself for one backend.
        """

    def stop(self) -> None:
        """Stop reporting and release threads/connections; returns promptly."""


def normalize_address(address: str) -> str:
    """Check a `host:port` worker address and return it in canonical form.

    Accepts `host:port`, `1.2.3.4:port` and `[v6]:port`; a bare IPv6 address must be bracketed
    because its last colon would otherwise be read as the port separator.
    """
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port:
        raise DiscoveryError(f"worker address {address!r} is not host:port")
    if host.startswith("["):
        if not host.endswith("]"):
            raise DiscoveryError(f"worker address {address!r} has an unclosed '['")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise DiscoveryError(f"worker address {address!r}: {host} is not an IPv6 address") from None
    elif ":" in host:
        raise DiscoveryError(f"worker address {address!r}: write IPv6 hosts as [addr]:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(f"worker address {address!r} has an invalid port {port!r}")
    return f"{host}:{int(port)}"


def _split(addresses: Iterable[str] | str | None) -> list[str]:
    """Flatten `["a:1,b:2", "c:3"]` (or one comma string, as a CLI flag gives it) to addresses."""
    if addresses is None:
        return []
    if isinstance(addresses, str):
        addresses = [addresses]
    return [part for entry in addresses for part in entry.split(",") if part.strip()]


class StaticDiscovery:
    """A fixed set of workers given on the command line (local clusters, tests, fixed fleets)."""

    def __init__(self, prefill: Iterable[str] | str | None, decode: Iterable[str] | str | None):
        endpoints = set()
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in _split(addresses):
                canonical = normalize_address(address)
                endpoints.add(WorkerEndpoint(role, canonical, canonical))
        for role in ROLES:
            if not any(e.role == role for e in endpoints):
                log.warning("static discovery lists no %s workers; the router stays unhealthy", role)
        self._endpoints = sorted(endpoints)

    @property
    def endpoints(self) -> list[WorkerEndpoint]:
        return list(self._endpoints)

    def start(self, on_change: OnChange) -> None:
        on_change(list(self._endpoints))

    def stop(self) -> None:
        pass


def _make_static(options: dict) -> Discovery:
    unknown = set(options) - {"prefill", "decode"}
    if unknown:
        raise DiscoveryError(f"static discovery takes prefill= and decode=, not {sorted(unknown)}")
    return StaticDiscovery(options.get("prefill"), options.get("decode"))


def _make_kubernetes(options: dict) -> Discovery:
    from pdserve.router.discovery_k8s import KubernetesDiscovery  # imports the kubernetes client lazily

    allowed = {"namespace", "prefill_selector", "decode_selector", "port_name", "api_client"}
    unknown = set(options) - allowed
    if unknown:
        raise DiscoveryError(f"kubernetes discovery takes {sorted(allowed)}, not {sorted(unknown)}")
    return KubernetesDiscovery(**options)


def _make_ray(options: dict) -> Discovery:
    from pdserve.router.discovery_ray import RayDiscovery  # imports ray lazily

    allowed = {"namespace", "address", "poll_interval", "call_timeout"}
    unknown = set(options) - allowed
    if unknown:
        raise DiscoveryError(f"ray discovery takes {sorted(allowed)}, not {sorted(unknown)}")
    return RayDiscovery(**options)


_BACKENDS: dict[str, Callable[[dict], Discovery]] = {
    "static": _make_static,
    "kubernetes": _make_kubernetes,
    "ray": _make_ray,
}


def make_discovery(kind: str, **options) -> Discovery:
    """Build the discovery backend named `kind` ("static" | "kubernetes" | "ray").

    Options are backend-specific: static takes `prefill`, `decode` (lists of `host:port`, commas
    allowed); kubernetes takes `namespace`, `prefill_selector`, `decode_selector`, `port_name`,
    `api_client`. Options set to None are dropped so CLI defaults can be passed through as-is.
    """
    key = (kind or "").strip().lower()
    factory = _BACKENDS.get(key)
    if factory is None:
        raise DiscoveryError(
            f"unknown discovery kind {kind!r}; available: {', '.join(sorted(_BACKENDS))}"
        )
    return factory({k: v for k, v in options.items() if v is not None})
