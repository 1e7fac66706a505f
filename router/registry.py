"""The router's view of its workers: who exists (from discovery), who is healthy, how loaded.

A background task polls every worker's `Load` and standard gRPC health check with deadlines; a
per-worker circuit breaker turns repeated probe failures, or one sign of death on the request path,
into "not routable" until a later probe succeeds. Everything here runs on the router's event loop;
discovery callbacks from other threads are handed over with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.circuit_breaker import CircuitBreaker
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery, WorkerEndpoint
from pdserve.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

# Keepalive pings on channels with calls in flight notice a worker host that vanished without
# closing its connections (a decode stream would otherwise hang until the request deadline).
# Worker servers must accept them: grpc.http2.min_recv_ping_interval_without_data_ms <= 20000
# (or grpc.http2.max_ping_strikes = 0), else they answer with GOAWAY "too_many_pings".
WORKER_PING_INTERVAL_MS = 20_000
# A worker that died and came back on its address (restarted by `pdserve serve`, systemd, ...)
# must be reachable at the next probe: gRPC's reconnect backoff would otherwise grow to 2 minutes
# while it was away and refuse every call until then.
WORKER_RECONNECT_BACKOFF_MAX_MS = 1_000
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", WORKER_RECONNECT_BACKOFF_MAX_MS),
    ("grpc.keepalive_time_ms", WORKER_PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class PendingLoad:
    """Load this router put on (or took off) one worker that its last LoadReport may not show yet.

    A placement counts from the moment the router picks the worker, before any RPC returns, so a
    burst of requests spreads instead of all landing on the worker that looked emptiest. It stays
    counted until it is withdrawn (the worker refused it, or the work left the worker), or until
    it is confirmed (the worker holds it) and a LoadReport asked for after the confirmation came
    back: that report shows it. Negative amounts are work the worker has let go of since.
    """

    def __init__(self) -> None:
        self._amounts: dict[int, int] = {}
        self._confirmed_at: dict[int, float] = {}
        self._handles = itertools.count()
        self.total = 0

    def add(self, amount: int) -> int:
        """Count `amount` now; returns a handle for `confirm` / `withdraw`."""
        handle = next(self._handles)
        self._amounts[handle] = amount
        self.total += amount
        return handle

    def confirm(self, handle: int) -> None:
        """The worker now holds it: the next LoadReport asked for from now on includes it."""
        if handle in self._amounts:
            self._confirmed_at[handle] = time.monotonic()

    def withdraw(self, handle: int) -> None:
        amount = self._amounts.pop(handle, None)
        if amount is not None:
            self.total -= amount
            self._confirmed_at.pop(handle, None)

    def reported(self, asked_at: float) -> None:
        """A LoadReport asked for at `asked_at` (time.monotonic) arrived: it covers everything
        confirmed before that."""
        for handle, at in list(self._confirmed_at.items()):
            if at <= asked_at:
                self.withdraw(handle)


class Worker:
    """One worker as the router sees it: its channel and stubs, last LoadReport and breaker.

    `pending_kv` (decode: KV blocks) and `pending_prompt` (prefill: queued prompt tokens) hold
    what this router placed since the last LoadReport (see `PendingLoad`).
    """

    def __init__(self, endpoint: WorkerEndpoint, channel: grpc.aio.Channel, breaker: CircuitBreaker):
        self.endpoint = endpoint
        self.channel = channel
        stub_class = (pdserve_pb2_grpc.PrefillWorkerStub if endpoint.role == "prefill"
                      else pdserve_pb2_grpc.DecodeWorkerStub)
        self.stub = stub_class(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.breaker = breaker
        self.load: pdserve_pb2.LoadReport | None = None
        self.serving = False
        self.pending_kv = PendingLoad()
        self.pending_prompt = PendingLoad()
        self.active_requests = 0  # decode: this router's requests placed here and not yet ended
        self.requests = 0  # requests placed here whose stream has not ended (WorkerRegistry.hold)
        self.departed = False  # discovery no longer lists it: no new work, kept while requests > 0

    @property
    def role(self) -> str:
        return self.endpoint.role

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def routable(self) -> bool:
        """Probed at least once, healthy, serving, not draining or departed, breaker closed."""
        return (self.load is not None and self.serving and not self.load.draining
                and not self.departed and self.breaker.closed)

    @property
    def free_kv_blocks(self) -> int:
        return 0 if self.load is None else self.load.kv_blocks_free - self.pending_kv.total

    @property
    def queued_prompt_tokens(self) -> int:
        return 0 if self.load is None else self.load.queued_prompt_tokens + self.pending_prompt.total

    def __repr__(self) -> str:
        return f"Worker({self.role}, {self.name}, routable={self.routable})"


class WorkerRegistry:
    """Workers by role, kept in step with discovery and probed in the background."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 channel_factory: Callable[[str], grpc.aio.Channel] | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._channel_factory = channel_factory or (
            lambda address: grpc.aio.insecure_channel(address, options=_GRPC_OPTIONS))
        self._workers: dict[tuple[str, str], Worker] = {}
        self._listeners: list[Callable[[], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._discovery: Discovery | None = None
        self._probe_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._closing: set[asyncio.Task] = set()
        # workers discovery dropped (pod terminating) that still stream requests placed on them
        self._departing: set[Worker] = set()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, discovery: Discovery) -> None:
        self._loop = asyncio.get_running_loop()
        self._discovery = discovery
        self._probe_task = asyncio.create_task(self._probe_forever(), name="pdserve-probe")
        discovery.start(self._on_discovery_change)

    async def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.stop()
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        for worker in list(self._workers.values()) + list(self._departing):
            self._metrics.forget_worker(worker)
            await worker.channel.close()
        self._workers.clear()
        self._departing.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs on the loop whenever membership or routability may have changed."""
        self._listeners.append(callback)

    # ---- queries ---------------------------------------------------------------------------
    def workers(self, role: str) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role]

    def routable(self, role: str) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role and w.routable]

    def ready(self) -> bool:
        """At least one routable prefill and one routable decode worker."""
        return bool(self.routable("prefill")) and bool(self.routable("decode"))

    def decode_kv_usage(self) -> float:
        """Share of the routable decode workers' KV blocks in use, by their last LoadReports."""
        loads = [w.load for w in self.routable("decode")]
        total = sum(load.kv_blocks_total for load in loads)
        return sum(load.kv_blocks_used for load in loads) / total if total else 0.0

    def max_context(self) -> int:
        """Largest context any routable decode worker admits (0 if none reported one)."""
        return max((w.load.max_context for w in self.routable("decode")), default=0)

    # ---- request-path feedback -------------------------------------------------------------
    def report_failure(self, worker: Worker, reason: str, *, fatal: bool) -> None:
        """The request path saw `worker` fail; `fatal` (it died) takes it out of rotation now."""
        was_routable = worker.routable
        if fatal:
            worker.breaker.trip(reason)
        else:
            worker.breaker.record_failure(reason)
        self._metrics.worker_failure(worker, reason.split(":", 1)[0])
        if was_routable and not worker.routable:
            log.warning("%s worker %s taken out of rotation: %s", worker.role, worker.name, reason)
        self._changed()

    # ---- requests on a worker --------------------------------------------------------------
    def hold(self, worker: Worker) -> None:
        """A request was placed on `worker`: keep its connection until `unhold`, even if
        discovery drops the worker meanwhile (a terminating pod finishing its streams)."""
        worker.requests += 1

    def unhold(self, worker: Worker) -> None:
        """The request placed on `worker` ended; a departed worker's last one closes its channel."""
        worker.requests -= 1
        if worker.departed and worker.requests <= 0 and worker in self._departing:
            self._departing.discard(worker)
            log.info("%s worker %s: last request ended, disconnecting", worker.role, worker.name)
            self._close_later(worker, self._config.cancel_timeout)

    def departing(self) -> list[Worker]:
        """Workers discovery no longer lists that still have requests placed on them."""
        return list(self._departing)

    def _close_later(self, worker: Worker, grace: float) -> None:
        task = asyncio.create_task(worker.channel.close(grace=grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # ---- discovery -------------------------------------------------------------------------
    def _on_discovery_change(self, endpoints: list[WorkerEndpoint]) -> None:
        if self._loop is None:
            raise RuntimeError("discovery reported workers before WorkerRegistry.start()")
        self._loop.call_soon_threadsafe(self._apply_endpoints, list(endpoints))

    def _apply_endpoints(self, endpoints: list[WorkerEndpoint]) -> None:
        wanted = {(e.role, e.address): e for e in endpoints}
        for key in [k for k in self._workers if k not in wanted]:
            worker = self._workers.pop(key)
            worker.departed = True  # nothing new goes there from now on
            self._metrics.forget_worker(worker)
            if worker.requests > 0:
                # a terminating pod drains: its streams (and the Decode calls of requests whose
                # KV is on its way there) go on over this channel until the last one ends
                log.info("%s worker %s left; keeping it for its %d request(s)", worker.role,
                         worker.name, worker.requests)
                self._departing.add(worker)
            else:
                log.info("%s worker %s left", worker.role, worker.name)
                # an RPC still in flight (a prefill) cannot outlive its request's deadline
                self._close_later(worker, self._config.request_timeout)
        for key, endpoint in wanted.items():
            if key not in self._workers:
                log.info("%s worker %s joined at %s", endpoint.role, endpoint.name, endpoint.address)
                breaker = CircuitBreaker(self._config.breaker_failure_threshold,
                                         self._config.breaker_reset_timeout,
                                         self._config.breaker_max_reset_timeout)
                self._workers[key] = Worker(endpoint, self._channel_factory(endpoint.address), breaker)
        self._wake.set()  # probe newcomers now rather than one interval later
        self._changed()

    # ---- probing ---------------------------------------------------------------------------
    async def _probe_forever(self) -> None:
        while True:
            self._wake.clear()  # before probing: a worker joining meanwhile wakes the next round
            workers = [w for w in self._workers.values() if w.breaker.should_probe()]
            if workers:
                try:
                    await asyncio.gather(*(self._probe(w) for w in workers))
                except Exception:  # a bug in one probe must not end health checking for good
                    log.exception("worker probe failed unexpectedly")
                self._changed()
            try:
                await asyncio.wait_for(self._wake.wait(), self._config.probe_interval)
            except asyncio.TimeoutError:
                pass

    async def _probe(self, worker: Worker) -> None:
        timeout = self._config.probe_timeout
        epoch = worker.breaker.epoch
        asked_at = time.monotonic()
        health, load = await asyncio.gather(
            worker.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout),
            worker.stub.Load(pdserve_pb2.LoadRequest(), timeout=timeout),
            return_exceptions=True)
        if isinstance(health, grpc.aio.AioRpcError) and health.code() is grpc.StatusCode.UNIMPLEMENTED:
            health = None  # no health service: the Load answer alone says it is alive
        for answer in (health, load):
            if isinstance(answer, asyncio.CancelledError):
                raise answer
            if isinstance(answer, BaseException):
                reason = (f"{answer.code().name}: {answer.details()}"
                          if isinstance(answer, grpc.aio.AioRpcError) else repr(answer))
                if worker.routable:
                    log.warning("%s worker %s probe failed: %s", worker.role, worker.name, reason)
                worker.breaker.record_failure(f"probe {reason}")
                self._metrics.observe_worker(worker)
                return
        worker.breaker.record_success(epoch)
        worker.load = load
        worker.serving = health is None or health.status == health_pb2.HealthCheckResponse.SERVING
        worker.pending_kv.reported(asked_at)
        worker.pending_prompt.reported(asked_at)
        self._metrics.observe_worker(worker)

    def _changed(self) -> None:
        for callback in self._listeners:
            try:
                callback()
            except Exception:  # a listener's bug must not stop probing
                log.exception("registry listener failed")
