"""Kubernetes discovery: workers are the ready endpoints of their pools' EndpointSlices.

Why EndpointSlices and not pods: the EndpointSlice controller already folds everything that makes
a pod routable into one place: the readiness probe result (our workers' gRPC health check), the
terminating state during a rollout or drain, and the numeric port behind the Service's named
port. Watching pods would mean re-deriving all of that (and reading pod specs, which carry env).
Each pool has a headless Service; the chart selects its slices with
`kubernetes.io/service-name=<service>` (the Service's own labels are copied onto its slices too).

Each role runs one thread: list (remember `resourceVersion`), then watch from it. A watch that
ends normally is resumed from the last seen version; one that breaks is resumed after a backoff;
a 410 Gone (version too old, compacted) triggers a fresh list, whose result replaces that role's
state, so nothing missed while disconnected survives.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

from pdserve.router.discovery import ROLES, DiscoveryError, OnChange, WorkerEndpoint

log = logging.getLogger(__name__)

_SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_HTTP_GONE = 410


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


def _api_client_from_environment():
    """In-cluster ServiceAccount credentials first, then the local kubeconfig."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as in_cluster:
        try:
            config.load_kube_config(client_configuration=configuration)
        except Exception as kubeconfig:  # ConfigException, missing file, bad YAML
            raise DiscoveryError(
                "kubernetes discovery needs in-cluster credentials (run the router with a "
                f"ServiceAccount) or a kubeconfig; in-cluster: {in_cluster}; kubeconfig: {kubeconfig}"
            ) from None
    return client.ApiClient(configuration)


def _default_namespace() -> str:
    try:
        return _SA_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def endpoints_of_slice(role: str, endpoint_slice: dict, port_name: str) -> tuple[WorkerEndpoint, ...]:
    """The routable workers of one EndpointSlice (a JSON dict as the API serves it).

    An endpoint joins when `conditions.ready` is not false (the API defines a missing value as
    ready) and it is not terminating; its first address is used, as the API asks consumers to.
    """
    port = next(
        (p.get("port") for p in endpoint_slice.get("ports") or [] if p.get("name") == port_name),
        None,
    )
    if port is None:
        name = (endpoint_slice.get("metadata") or {}).get("name")
        log.warning("EndpointSlice %s has no port named %r; ignoring it", name, port_name)
        return ()
    found = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses") or []
        if not addresses:
            continue
        address = _format_address(addresses[0], int(port))
        pod = (endpoint.get("targetRef") or {}).get("name") or endpoint.get("hostname") or address
        found.append(WorkerEndpoint(role, address, pod))
    return tuple(found)


class KubernetesDiscovery:
    """List + watch the prefill and decode pools' EndpointSlices in one namespace.

    Parameters
    ----------
    namespace : namespace of the worker Services; None reads the pod's own (ServiceAccount file).
    prefill_selector, decode_selector : label selectors of each pool's EndpointSlices, e.g.
        `kubernetes.io/service-name=pdserve-prefill`.
    port_name : name of the gRPC port in the Services (`grpc` in the chart).
    api_client : a `kubernetes.client.ApiClient`; None loads in-cluster config, then kubeconfig.
    watch_timeout_s : the server ends each watch after this long; it is then resumed.
    backoff_initial_s, backoff_max_s : retry delays after an error (doubling, with jitter).
    """

    def __init__(
        self,
        namespace: str | None = None,
        prefill_selector: str | None = None,
        decode_selector: str | None = None,
        port_name: str = "grpc",
        api_client: Any = None,
        *,
        watch_timeout_s: int = 240,
        request_timeout_s: float = 30.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        selectors = {"prefill": prefill_selector, "decode": decode_selector}
        for role, selector in selectors.items():
            if not selector or not str(selector).strip():
                raise DiscoveryError(
                    f"kubernetes discovery needs a {role} label selector "
                    f"(e.g. kubernetes.io/service-name=pdserve-{role})"
                )
        if prefill_selector == decode_selector:
            raise DiscoveryError("prefill and decode selectors are identical; each pool needs its own")
        if not port_name:
            raise DiscoveryError("kubernetes discovery needs the name of the workers' gRPC port")
        if watch_timeout_s <= 0 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise DiscoveryError("watch_timeout_s and backoffs must be positive, max >= initial")
        from kubernetes import client

        self.namespace = namespace or _default_namespace()
        self.selectors = selectors
        self.port_name = port_name
        self._api = client.DiscoveryV1Api(api_client or _api_client_from_environment())
        self._watch_timeout_s = int(watch_timeout_s)
        self._request_timeout_s = float(request_timeout_s)
        self._backoff = (float(backoff_initial_s), float(backoff_max_s))

        self._stop = threading.Event()
        self._lock = threading.Lock()  # state + ordered on_change calls
        self._slices: dict[str, dict[str, tuple[WorkerEndpoint, ...]]] = {r: {} for r in ROLES}
        self._synced = {r: False for r in ROLES}
        self._resource_version: dict[str, str | None] = {r: None for r in ROLES}
        self._published: frozenset[WorkerEndpoint] | None = None
        self._on_change: OnChange | None = None
        self._threads: list[threading.Thread] = []
        self._responses_lock = threading.Lock()
        self._responses: set[Any] = set()  # open watch streams, aborted by stop()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, on_change: OnChange) -> None:
        if self._threads:
            raise RuntimeError("KubernetesDiscovery.start() was already called")
        self._on_change = on_change
        for role in ROLES:
            thread = threading.Thread(
                target=self._run, args=(role,), name=f"k8s-discovery-{role}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Abort open watches and join the threads (a list in flight ends by its own timeout)."""
        self._stop.set()
        with self._responses_lock:
            responses = list(self._responses)
        for response in responses:
            _abort(response)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout_s)

    # -- one role's loop ---------------------------------------------------------------------------
    def _run(self, role: str) -> None:
        delay = self._backoff[0]
        while not self._stop.is_set():
            try:
                if self._resource_version[role] is None:
                    self._list(role)
                started = time.monotonic()
                self._watch(role)  # returns when the server ends the watch (timeout_seconds)
                if time.monotonic() - started >= 1.0:
                    delay = self._backoff[0]
                    continue
                # a watch that ends at once, again and again, must not spin: back off as on errors
            except _Gone:
                log.info("%s EndpointSlice watch expired (410 Gone); listing again", role)
                self._resource_version[role] = None
            except Exception as exc:  # API errors, dropped connections, malformed events
                if self._stop.is_set():
                    break
                log.warning("%s discovery in namespace %s failed (%s: %s); retrying in %.1fs",
                            role, self.namespace, type(exc).__name__, exc, delay)
            self._stop.wait(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self._backoff[1])

    def _list(self, role: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            response = self._api.list_namespaced_endpoint_slice(
                self.namespace,
                label_selector=self.selectors[role],
                _preload_content=False,
                _request_timeout=(10, self._request_timeout_s),
            )
        except ApiException as exc:
            if exc.status == 403:
                raise DiscoveryError(
                    f"forbidden to list endpointslices in namespace {self.namespace}: the router's "
                    "ServiceAccount needs get/list/watch on discovery.k8s.io endpointslices"
                ) from None
            raise
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        slices = {
            item["metadata"]["name"]: endpoints_of_slice(role, item, self.port_name)
            for item in body.get("items") or []
        }
        with self._lock:
            self._slices[role] = slices
            self._synced[role] = True
            self._resource_version[role] = (body.get("metadata") or {}).get("resourceVersion") or ""
            self._publish_locked()

    def _watch(self, role: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            response = self._api.list_namespaced_endpoint_slice(
                self.namespace,
                label_selector=self.selectors[role],
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=self._resource_version[role] or None,
                timeout_seconds=self._watch_timeout_s,
                _preload_content=False,
                # a silent connection is dead once the server's own timeout has clearly passed
                _request_timeout=(10, self._watch_timeout_s + 30),
            )
        except ApiException as exc:
            if exc.status == _HTTP_GONE:
                raise _Gone() from None
            raise
        with self._responses_lock:
            self._responses.add(response)
        try:
            if self._stop.is_set():  # stop() ran before this stream was registered
                return
            for line in _lines(response):
                if self._stop.is_set():
                    return
                self._apply(role, json.loads(line))
        finally:
            with self._responses_lock:
                self._responses.discard(response)
            response.close()
            response.release_conn()

    def _apply(self, role: str, event: dict) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == _HTTP_GONE:
                raise _Gone()
            raise RuntimeError(f"watch error {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        metadata = obj.get("metadata") or {}
        with self._lock:
            if kind in ("ADDED", "MODIFIED"):
                self._slices[role][metadata["name"]] = endpoints_of_slice(role, obj, self.port_name)
            elif kind == "DELETED":
                self._slices[role].pop(metadata["name"], None)
            elif kind != "BOOKMARK":
                log.debug("ignoring %s watch event of type %r", role, kind)
            if metadata.get("resourceVersion"):
                self._resource_version[role] = metadata["resourceVersion"]
            if kind != "BOOKMARK":
                self._publish_locked()

    def _publish_locked(self) -> None:
        """Report the union of both roles once both have listed, and only when it changed."""
        if not all(self._synced.values()):
            return
        current = frozenset(e for slices in self._slices.values() for eps in slices.values() for e in eps)
        if current == self._published:
            return
        self._published = current
        try:
            self._on_change(sorted(current))
        except Exception:
            log.exception("discovery on_change callback failed")


def _lines(response):
    """Newline-delimited watch events from a streaming urllib3 response."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=True):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


def _abort(response) -> None:
    """Unblock a thread reading `response` from another thread (urllib3 >= 2.3 has shutdown())."""
    try:
        shutdown = getattr(response, "shutdown", None)
        if shutdown is not None:
            shutdown()
            return
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
