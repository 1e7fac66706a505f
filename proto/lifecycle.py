"""One worker process's life, for both roles and any number of ranks: serve, health, signals,
drain, fatal exit.

    starting -> serving -> draining -> stopped          (SIGTERM / SIGINT)
                        -> failed   -> exit 1 at once   (`fatal`: a rank died, a collective broke)

Draining: health says NOT_SERVING, the service refuses new work (`service.draining`), work already
accepted finishes (`service.in_flight()` reaches 0) for up to `--drain-timeout` seconds, then the
server stops. Set the orchestrator's grace period (Kubernetes' terminationGracePeriodSeconds)
above it. A second signal ends the drain at once. `add_worker_process_args` gives both workers
the flags of this life (`--drain-timeout`, `--ready-file`, ...); it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)
_SIGNAL_POLL_S = 0.1  # longest a caught SIGTERM / SIGINT waits for the main thread to act on it


def add_worker_process_args(p) -> None:
    """The flags every worker process takes, whatever its role."""
    p.add_argument("--worker-id", default=None, help="name in logs and load reports (none: random)")
    p.add_argument("--kv-selftest-mib", type=int, default=0,
                   help="before serving, time a KV transfer of this many MiB through this worker's "
                        "UCX transports (kvtransfer/selftest.py; 0 = skip); reported in load reports")
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="after SIGTERM: seconds accepted requests get to finish before the worker exits "
                        "(keep the orchestrator's grace period above it)")
    p.add_argument("--ready-file", default=None,
                   help="write {address, ...} here once serving (for launchers)")


class DrainableService(Protocol):
    draining: bool  # set: refuse new work with UNAVAILABLE

    def in_flight(self) -> int:
        """Work accepted and not finished (reservations, queued or running prompts)."""


class WorkerLifecycle:
    """Runs a built worker's gRPC server until it is told to stop, then drains and tears down."""

    def __init__(self, role: str, services: list[str], *, drain_timeout_s: float = 120.0):
        if drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {drain_timeout_s}")
        self.role = role
        self.services = list(services)
        self.drain_timeout_s = drain_timeout_s
        self.failed: str | None = None
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self._service: DrainableService | None = None
        self._health = None

    def request_stop(self, *_) -> None:
        """Begin draining; called again, end the drain now."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    def fatal(self, reason: str) -> None:
        """The worker cannot go on: refuse everything, skip the drain, exit 1."""
        if self.failed is None:
            self.failed = reason
        self._refuse()
        self._hurry.set()
        self._stop.set()

    def _refuse(self) -> None:
        from pdserve.proto.rpc import set_serving

        if self._service is not None:
            self._service.draining = True
        if self._health is not None:
            set_serving(self._health, self.services, False)

    def serve(self, server: grpc.Server, service: DrainableService, *, host: str, port: int,
              ready_file: str | None, worker_id: str, start: Callable[[], None],
              teardown: Callable[[], None], on_fatal_exit: Callable[[], None], describe: str = "",
              **ready_info) -> int:
        """Bind, `start()` the engine loop, serve until stopped, drain, `teardown()`; returns the exit
        code. After `fatal`, `on_fatal_exit()` (stop the other ranks) runs and the process exits 1
        at once: the engine may sit in a broken collective that teardown would wait on forever."""
        from pdserve.proto.rpc import add_health, bind, write_ready_file

        self._service = service
        self._health = add_health(server, self.services)
        if self.failed is not None:
            self._refuse()
        bound = bind(server, host, port)
        with _signals_call(self.request_stop):
            start()
            server.start()
            log.info("%s worker %s serving on %s:%d%s", self.role, worker_id, host, bound, describe)
            write_ready_file(ready_file, role=self.role, address=f"{host}:{bound}", worker_id=worker_id,
                             **ready_info)
            # in short waits: a signal another thread caught runs its handler only once this (main)
            # thread runs Python code again; an unbounded wait would hold it until the next signal
            while not self._stop.wait(_SIGNAL_POLL_S):
                pass
            self._refuse()
            if self.failed is not None:
                server.stop(grace=1.0).wait()
                on_fatal_exit()
                log.error("%s worker %s stopped after a fatal error: %s", self.role, worker_id, self.failed)
                logging.shutdown()
                os._exit(1)
            log.info("%s worker %s draining (up to %.0f s)", self.role, worker_id, self.drain_timeout_s)
            end = time.monotonic() + self.drain_timeout_s
            while (left := service.in_flight()) and time.monotonic() < end and not self._hurry.is_set():
                self._hurry.wait(0.05)
            if left:
                log.warning("%s worker %s stops with %d requests unfinished", self.role, worker_id, left)
            server.stop(grace=2.0).wait()
            teardown()
        log.info("%s worker %s stopped", self.role, worker_id)
        return 0


@contextlib.contextmanager
def _signals_call(handler):
    """SIGTERM and SIGINT call `handler` inside the block; the previous handlers come back after."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
