"""Per-worker circuit breaker: stop routing to a worker that keeps failing, probe it back later."""

from __future__ import annotations

import enum
import time
from typing import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"        # routable
    OPEN = "open"            # not routable; no probes until `reopen_at`
    HALF_OPEN = "half_open"  # not routable; the next probe decides


class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures, or at once on `trip()`.

    An open breaker waits `reset_timeout` seconds, then lets one probe through (half-open): success
    closes it, failure reopens it with the wait doubled (capped at `max_reset_timeout`), so a dead
    worker costs one probe per minute, not one per poll.
    """

    def __init__(self, failure_threshold: int, reset_timeout: float, max_reset_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.reset_timeout = reset_timeout
        self.max_reset_timeout = max_reset_timeout
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._wait = reset_timeout
        self._reopen_at = 0.0
        self.last_reason = ""
        self.epoch = 0  # bumped by every failure: a probe that began earlier cannot close it

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self._reopen_at:
            self._state = BreakerState.HALF_OPEN
        return self._state

    @property
    def closed(self) -> bool:
        return self.state is BreakerState.CLOSED

    def should_probe(self) -> bool:
        return self.state is not BreakerState.OPEN

    def record_success(self, epoch: int | None = None) -> None:
        """A probe (or call) succeeded; `epoch` is `self.epoch` from when it began, if known.

        A success that began before a later failure says nothing about the worker now (a probe
        still in flight when a stream broke), so it is ignored.
        """
        if epoch is not None and epoch != self.epoch:
            return
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._wait = self.reset_timeout

    def record_failure(self, reason: str) -> None:
        self.last_reason = reason
        self.epoch += 1
        if self.state is BreakerState.HALF_OPEN:
            self._open(min(self._wait * 2, self.max_reset_timeout))
            return
        self._failures += 1
        if self._state is BreakerState.CLOSED and self._failures >= self.failure_threshold:
            self._open(self.reset_timeout)

    def trip(self, reason: str) -> None:
        """Open now: the request path saw the worker die (stream broke, connection refused)."""
        self.last_reason = reason
        self.epoch += 1
        if self.state is BreakerState.CLOSED:
            self._open(self.reset_timeout)
        elif self.state is BreakerState.HALF_OPEN:
            self._open(min(self._wait * 2, self.max_reset_timeout))

    def _open(self, wait: float) -> None:
        self._state = BreakerState.OPEN
        self._wait = wait
        self._reopen_at = self._clock() + wait
