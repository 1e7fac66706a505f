"""Ray discovery: workers are the named actors `prefill-*` / `decode-*` of one Ray namespace.

The Ray launcher (`launch.ray_job`) runs each worker replica as a named actor that owns the
worker process and answers `endpoint()` with `{"role", "address", "name"}` once the worker serves
(None before that, and again as soon as the process has exited). Named actors are Ray's own
registry: a name is listed while its actor is alive or restarting and released when it is dead for
good, so no extra registry actor has to be kept consistent with the actors themselves.

A background thread polls every `poll_interval` seconds: list the namespace's named actors, ask
each worker actor for its endpoint (one call in flight per actor; an actor that has not answered
within `call_timeout`, is restarting, or has died is left out) and report the whole set when it
differs from the last report. Joins therefore show up within one poll of a worker becoming ready,
leaves within one poll of a process or actor dying; the router's own health probes cover the
time in between.

Built by `make_discovery("ray", namespace="pdserve")` (router/discovery.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pdserve.router.discovery import ROLES, DiscoveryError, OnChange, WorkerEndpoint, normalize_address

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "pdserve"


def worker_role(actor_name: str) -> str | None:
    """`prefill-3` -> "prefill"; None for names that are not worker actors (router, helpers)."""
    role, sep, index = actor_name.partition("-")
    return role if sep and role in ROLES and index else None


class RayDiscovery:
    """Polls one Ray namespace for worker actors (see the module docstring).

    Parameters
    ----------
    namespace : Ray namespace of the deployment's actors ("pdserve" by default, as the launcher).
    address : Ray cluster to connect to when this process is not connected yet ("auto" finds the
        local node's cluster or `RAY_ADDRESS`); inside a Ray actor the existing connection is used.
    poll_interval : seconds between two polls.
    call_timeout : seconds one `endpoint()` answer may take before that actor counts as absent.
    """

    def __init__(self, namespace: str = DEFAULT_NAMESPACE, address: str | None = None,
                 poll_interval: float = 2.0, call_timeout: float = 5.0) -> None:
        if not namespace:
            raise DiscoveryError("ray discovery needs a namespace")
        if not poll_interval > 0 or not call_timeout > 0:
            raise DiscoveryError("ray discovery: poll_interval and call_timeout must be > 0")
        self.namespace = namespace
        self.address = address
        self.poll_interval = float(poll_interval)
        self.call_timeout = float(call_timeout)
        self._handles: dict[str, Any] = {}  # actor name -> handle
        self._pending: dict[str, Any] = {}  # actor name -> endpoint() ref not answered yet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- Discovery protocol ----------------------------------------------------------------
    def start(self, on_change: OnChange) -> None:
        self._connect()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(on_change,), daemon=True,
                                        name="pdserve-ray-discovery")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.call_timeout + 1.0)

    # ---- polling ---------------------------------------------------------------------------
    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        try:
            ray.init(address=self.address or "auto", namespace=self.namespace, log_to_driver=False,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise DiscoveryError(f"ray discovery cannot reach a Ray cluster "
                                 f"(address {self.address or 'auto'}): {e}") from None

    def _run(self, on_change: OnChange) -> None:
        last: list[WorkerEndpoint] | None = None
        while not self._stop.is_set():
            try:
                current = self.poll()
            except Exception:  # a GCS hiccup must not end discovery; keep the last report
                log.warning("ray discovery: polling namespace %r failed", self.namespace,
                            exc_info=True)
                current = None
            if current is not None and current != last and not self._stop.is_set():
                joined = sorted(set(current) - set(last or []))
                left = sorted(set(last or []) - set(current))
                log.info("ray discovery: %d workers (joined %s, left %s)", len(current),
                         [e.name for e in joined], [e.name for e in left])
                on_change(current)
                last = current
            self._stop.wait(self.poll_interval)

    def poll(self) -> list[WorkerEndpoint]:
        """One round: the sorted endpoints of the namespace's worker actors that serve now."""
        import ray
        from ray.exceptions import RayError

        listed = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == self.namespace and worker_role(a["name"])}
        for name in set(self._handles) - listed:  # gone for good: the name was released
            self._handles.pop(name, None)
            self._pending.pop(name, None)
        for name in sorted(listed):
            if name in self._pending:
                continue  # the last question is still open (actor busy or restarting)
            handle = self._handles.get(name)
            if handle is None:
                try:
                    handle = self._handles[name] = ray.get_actor(name, namespace=self.namespace)
                except ValueError:  # died between listing and lookup
                    continue
            self._pending[name] = handle.endpoint.remote()
        if not self._pending:
            return []
        by_ref = {ref: name for name, ref in self._pending.items()}
        done, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=self.call_timeout)
        endpoints = set()
        for ref in done:
            name = by_ref[ref]
            del self._pending[name]
            try:
                info = ray.get(ref)
            except RayError as e:  # died or restarting: ask a fresh handle next round
                log.debug("ray discovery: %s did not answer: %s", name, e)
                self._handles.pop(name, None)
                continue
            endpoint = self._endpoint(name, info)
            if endpoint is not None:
                endpoints.add(endpoint)
        return sorted(endpoints)

    def _endpoint(self, name: str, info: Any) -> WorkerEndpoint | None:
        if info is None:  # not serving (loading weights, or its process just exited)
            return None
        try:
            role = info["role"]
            if role != worker_role(name):
                raise DiscoveryError(f"actor {name!r} says it is a {role!r} worker")
            return WorkerEndpoint(role, normalize_address(info["address"]), name)
        except (KeyError, TypeError, DiscoveryError) as e:
            log.warning("ray discovery: ignoring actor %s with a bad endpoint %r: %s", name, info, e)
            return None
