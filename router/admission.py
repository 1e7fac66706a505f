"""Admission control: a bounded, first-come-first-served wait for decode room.

A request that no decode worker can take now (no free batch slot or KV blocks by the router's
estimate, or every Reserve answered RESOURCE_EXHAUSTED) waits here instead of failing; when the
queue is full, or the wait exceeds its bound, it is refused with 429 + Retry-After (gRPC
RESOURCE_EXHAUSTED), before its response starts.
Whoever waits longest retries first: when room may have come back (a request finished or was
cancelled, a load report arrived) the head of the queue is woken; once it is placed it wakes the
next, so room for several lets several in, one after the other.
"""

from __future__ import annotations

import asyncio
import collections

from pdserve.router.errors import OverloadedError
from pdserve.router.metrics import RouterMetrics


class AdmissionQueue:
    """Waiters for decode room, in arrival order. Runs on the router's event loop."""

    def __init__(self, max_waiting: int, retry_after: int, metrics: RouterMetrics) -> None:
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self._metrics = metrics
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def enter(self, *, front: bool) -> asyncio.Future:
        """A place in the queue: resolved when it is this waiter's turn to try again.

        `front` is for a waiter that was woken and still found no room: it keeps its turn.
        Anyone else is refused when `max_waiting` already wait.
        """
        if not front and len(self._waiters) >= self.max_waiting:
            waiting = f" and {len(self._waiters)} requests already wait for it" if self._waiters else ""
            raise OverloadedError(f"No decode worker has room for this request{waiting}; "
                                  "retry later.", code="kv_cache_full", retry_after=self.retry_after)
        place = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(place)
        else:
            self._waiters.append(place)
        self._metrics.admission_waiting.set(len(self._waiters))
        return place

    def leave(self, place: asyncio.Future) -> None:
        """Give up a place (placed, timed out or cancelled); a no-op once woken."""
        try:
            self._waiters.remove(place)
        except ValueError:
            return
        self._metrics.admission_waiting.set(len(self._waiters))

    def wake(self) -> None:
        """Room may have come back: the longest waiter tries again."""
        while self._waiters:
            place = self._waiters.popleft()
            if not place.done():
                place.set_result(None)
                break
        self._metrics.admission_waiting.set(len(self._waiters))
