"""KubernetesDiscovery against a local HTTP server that speaks the EndpointSlice list/watch API.

The server keeps slices, a resourceVersion counter and an event log; `?watch=1` streams
newline-delimited JSON events over chunked HTTP like the real API server, and can drop its watch
connections mid-stream and answer the next watch with 410 Gone (as an ERROR event or an HTTP
status), which is what an API server does after its watch cache compacted past the client.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from pdserve.router.discovery import WorkerEndpoint
from pdserve.router.discovery_k8s import KubernetesDiscovery, endpoints_of_slice

NAMESPACE = "serving"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
PREFILL_SELECTOR = "kubernetes.io/service-name=pd-prefill"
DECODE_SELECTOR = "kubernetes.io/service-name=pd-decode"


def make_slice(name, service, endpoints, port=50061, port_name="grpc"):
    """endpoints: list of (ip, pod, ready, terminating)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "serving": ready,
                                               "terminating": terminating},
             "targetRef": {"kind": "Pod", "name": pod, "namespace": NAMESPACE}}
            for ip, pod, ready, terminating in endpoints
        ],
    }


class FakeKubeAPI:
    """Just enough of the API server for list + watch of EndpointSlices in one namespace."""

    def __init__(self):
        self.cond = threading.Condition()
        self.resource_version = 1000
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.list_requests = 0
        self.watch_requests = 0
        self.open_watches = 0
        self.compacted_rv = 0  # watches from an older resourceVersion get 410 Gone
        self.gone_as = "event"  # how 410 is answered: an ERROR watch event or an HTTP status
        self.drop_generation = 0
        self.closed = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlparse(self.path)
                if url.path != PATH:
                    return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                selector = query.get("labelSelector", "")
                if query.get("watch") in ("1", "true"):
                    return api._serve_watch(self, selector, query)
                with api.cond:
                    api.list_requests += 1
                    body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                            "metadata": {"resourceVersion": str(api.resource_version)},
                            "items": [s for s in api.slices.values() if _matches(s, selector)]}
                self._json(200, body)

            def _json(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    # -- state changes -------------------------------------------------------------------------
    def put(self, obj):
        with self.cond:
            self.resource_version += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.resource_version)
            kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
            self.slices[obj["metadata"]["name"]] = obj
            self.events.append((self.resource_version, kind, obj))
            self.cond.notify_all()

    def delete(self, name):
        with self.cond:
            self.resource_version += 1
            obj = self.slices.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.resource_version)
            self.events.append((self.resource_version, "DELETED", obj))
            self.cond.notify_all()

    def bookmark(self) -> int:
        """Advance the version with no change, announced to watchers as a BOOKMARK event."""
        with self.cond:
            self.resource_version += 1
            obj = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                   "metadata": {"resourceVersion": str(self.resource_version)}}
            self.events.append((self.resource_version, "BOOKMARK", obj))
            self.cond.notify_all()
            return self.resource_version

    def drop_watches(self, gone_as: str):
        """Cut every open watch mid-stream and compact history: resuming from any version seen
        so far answers 410 Gone (once per client: a fresh list returns a newer version)."""
        with self.cond:
            self.drop_generation += 1
            self.compacted_rv = self.resource_version + 1
            self.gone_as = gone_as
            self.cond.notify_all()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # -- watch ---------------------------------------------------------------------------------
    def _serve_watch(self, handler, selector, query):
        with self.cond:
            self.watch_requests += 1
            generation = self.drop_generation
            since = int(query.get("resourceVersion") or self.resource_version)
            gone = self.gone_as if since < self.compacted_rv else None
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                  "message": "too old resource version", "reason": "Expired", "code": 410}
        if gone == "status":
            return handler._json(410, status)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def chunk(payload: bytes):
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            handler.wfile.flush()

        if gone == "event":
            chunk(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            chunk(b"")
            return
        deadline = time.monotonic() + int(query.get("timeoutSeconds") or 60)
        with self.cond:
            self.open_watches += 1
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(
                        lambda: self.closed or self.drop_generation != generation
                        or self.events[-1:] and self.events[-1][0] > since,
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                    if self.closed or self.drop_generation != generation:
                        # abrupt end: no terminating chunk, the client sees a broken stream
                        handler.close_connection = True
                        handler.connection.shutdown(2)
                        return
                    if time.monotonic() >= deadline:
                        chunk(b"")
                        return
                    pending = [e for e in self.events if e[0] > since
                               and (e[1] == "BOOKMARK" or _matches(e[2], selector))]
                    since = self.events[-1][0]
                for _, kind, obj in pending:
                    chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        finally:
            with self.cond:
                self.open_watches -= 1


def _matches(obj, selector):
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class Recorder:
    def __init__(self):
        self.calls: queue.Queue[list[WorkerEndpoint]] = queue.Queue()
        self.latest: list[WorkerEndpoint] | None = None

    def __call__(self, endpoints):
        self.calls.put(list(endpoints))

    def wait_for(self, predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while True:
            if self.latest is not None and predicate(self.latest):
                return self.latest
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"discovery never reached the expected state; last: {self.latest}")
            try:
                self.latest = self.calls.get(timeout=remaining)
            except queue.Empty:
                pass


def addresses(endpoints, role):
    return sorted(e.address for e in endpoints if e.role == role)


@pytest.fixture
def api():
    server = FakeKubeAPI()
    yield server
    server.close()


@pytest.fixture
def discovery(api):
    configuration = client.Configuration(host=api.url)
    d = KubernetesDiscovery(NAMESPACE, PREFILL_SELECTOR, DECODE_SELECTOR, "grpc",
                            client.ApiClient(configuration),
                            watch_timeout_s=30, backoff_initial_s=0.05, backoff_max_s=0.2)
    yield d
    d.stop()


def _seed(api):
    api.put(make_slice("pd-prefill-abc", "pd-prefill", [
        ("10.0.0.1", "prefill-0", True, False),
        ("10.0.0.2", "prefill-1", True, False),
        ("10.0.0.3", "prefill-2", False, False),  # still loading weights
    ]))
    api.put(make_slice("pd-decode-abc", "pd-decode", [("10.0.1.1", "decode-0", True, False)],
                       port=50062))
    # an unrelated slice in the namespace that no selector matches
    api.put(make_slice("other-xyz", "other", [("10.0.9.9", "other-0", True, False)]))


def test_ready_workers_join_and_not_ready_or_deleted_leave(api, discovery):
    _seed(api)
    rec = Recorder()
    discovery.start(rec)
    first = rec.wait_for(lambda eps: len(eps) == 3)
    assert addresses(first, "prefill") == ["10.0.0.1:50061", "10.0.0.2:50061"]
    assert addresses(first, "decode") == ["10.0.1.1:50062"]
    assert WorkerEndpoint("prefill", "10.0.0.1:50061", "prefill-0") in first

    # prefill-2 finished loading, prefill-0 turns not ready (probe failing)
    api.put(make_slice("pd-prefill-abc", "pd-prefill", [
        ("10.0.0.1", "prefill-0", False, False),
        ("10.0.0.2", "prefill-1", True, False),
        ("10.0.0.3", "prefill-2", True, False),
    ]))
    now = rec.wait_for(lambda eps: addresses(eps, "prefill") == ["10.0.0.2:50061", "10.0.0.3:50061"])
    assert addresses(now, "decode") == ["10.0.1.1:50062"]

    # a rollout: prefill-1 is terminating (still serving in-flight work, but must get no new work)
    api.put(make_slice("pd-prefill-abc", "pd-prefill", [
        ("10.0.0.2", "prefill-1", True, True),
        ("10.0.0.3", "prefill-2", True, False),
    ]))
    rec.wait_for(lambda eps: addresses(eps, "prefill") == ["10.0.0.3:50061"])

    # a bookmark moves the resume point without touching the workers
    version = api.bookmark()
    expected = {"prefill": str(version), "decode": str(version)}
    deadline = time.monotonic() + 10
    while discovery._resource_version != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert discovery._resource_version == expected

    # a second decode slice appears, then the first one is deleted
    api.put(make_slice("pd-decode-def", "pd-decode", [("10.0.1.2", "decode-1", True, False)],
                       port=50062))
    rec.wait_for(lambda eps: addresses(eps, "decode") == ["10.0.1.1:50062", "10.0.1.2:50062"])
    api.delete("pd-decode-abc")
    last = rec.wait_for(lambda eps: addresses(eps, "decode") == ["10.0.1.2:50062"])
    assert addresses(last, "prefill") == ["10.0.0.3:50061"]
    assert api.list_requests == 2  # one list per role: everything since came from the watches


@pytest.mark.parametrize("gone", ["event", "status"])
def test_dropped_watch_and_410_relist_then_keep_watching(api, discovery, gone):
    _seed(api)
    rec = Recorder()
    discovery.start(rec)
    rec.wait_for(lambda eps: len(eps) == 3)
    assert api.list_requests == 2

    api.drop_watches(gone_as=gone)
    # a change while the watches are down: history is compacted, only a fresh list reveals it
    api.put(make_slice("pd-prefill-abc", "pd-prefill", [("10.0.0.2", "prefill-1", True, False)]))
    rec.wait_for(lambda eps: addresses(eps, "prefill") == ["10.0.0.2:50061"])

    # both roles listed again and re-established their watches, which keep delivering
    deadline = time.monotonic() + 10
    while api.open_watches < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert api.open_watches == 2
    assert api.list_requests == 4
    lists_before = api.list_requests
    api.put(make_slice("pd-decode-abc", "pd-decode", [("10.0.1.7", "decode-7", True, False)],
                       port=50062))
    rec.wait_for(lambda eps: addresses(eps, "decode") == ["10.0.1.7:50062"])
    assert api.list_requests == lists_before


def test_stop_returns_promptly_with_open_watches(api, discovery):
    _seed(api)
    rec = Recorder()
    discovery.start(rec)
    rec.wait_for(lambda eps: len(eps) == 3)
    deadline = time.monotonic() + 10
    while api.open_watches < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    discovery.stop()
    assert time.monotonic() - started < 1.0
    assert not any(t.is_alive() for t in discovery._threads)


def test_api_server_down_then_up(api):
    """Connection refused at first: the loop backs off and joins once the server answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    configuration = client.Configuration(host=f"http://127.0.0.1:{dead_port}")
    d = KubernetesDiscovery(NAMESPACE, PREFILL_SELECTOR, DECODE_SELECTOR, "grpc",
                            client.ApiClient(configuration), backoff_initial_s=0.05,
                            backoff_max_s=0.1)
    rec = Recorder()
    d.start(rec)
    try:
        time.sleep(0.3)
        assert rec.calls.empty()
        configuration.host = api.url  # the ApiClient reads the host per request
        _seed(api)
        rec.wait_for(lambda eps: len(eps) == 3)
    finally:
        d.stop()


def test_endpoints_of_slice_ports_and_ipv6():
    s = make_slice("x", "pd-prefill", [("fd00::5", "p0", True, False), ("fd00::6", None, None, None)])
    s["endpoints"][1]["conditions"] = {}  # no conditions reported: the API defines that as ready
    s["endpoints"][1].pop("targetRef")
    eps = endpoints_of_slice("prefill", s, "grpc")
    assert [e.address for e in eps] == ["[fd00::5]:50061", "[fd00::6]:50061"]
    assert [e.name for e in eps] == ["p0", "[fd00::6]:50061"]
    assert endpoints_of_slice("prefill", s, "http") == ()  # port name not in the slice


def test_invalid_configuration_is_rejected():
    from pdserve.router.discovery import DiscoveryError

    api_client = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))
    with pytest.raises(DiscoveryError, match="decode label selector"):
        KubernetesDiscovery("ns", PREFILL_SELECTOR, "", api_client=api_client)
    with pytest.raises(DiscoveryError, match="identical"):
        KubernetesDiscovery("ns", PREFILL_SELECTOR, PREFILL_SELECTOR, api_client=api_client)
