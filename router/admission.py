"""Admission control: a bounded, first-come-first-served wait for decode room.

A request that no decode worker can take now (no free batch slot or KV blocks by the router's
estimate, or every Reserve answered RESOURCE_EXHAUSTED) waits here instead of failing; when the
queue is full, or the wait exceeds its bound, it is refused with 429 + Retry-After (gRPC
RESOURCE_EXHAUSTED), before its response starts.
Whoever waits longest retries first: when room may have come back (a request finished or was
cancelled, a load report arrived) the head of the queue is woken; once it is placed it wakes the
next, so room for several lets several in, one after the other. A woken request keeps its place
while it tries (and if it still finds no room, waits again at the front): the bound counts it, so
arrivals meanwhile cannot take its slot in the queue.
"""

from __future__ import annotations

import asyncio
import collections

from pdserve.router.errors import OverloadedError
from pdserve.router.metrics import RouterMetrics


class Place:
    """One request's place in the queue, from its first wait until it is placed or gives up."""

    __slots__ = ("turn", "woken")

    def __init__(self) -> None:
        self.turn: asyncio.Future = asyncio.get_running_loop().create_future()  # resolved: try again
        self.woken = False  # its turn came and it has not waited again since


class AdmissionQueue:
    """Places of the requests waiting for decode room, in arrival order. Runs on the router's
    event loop."""

    def __init__(self, max_waiting: int, retry_after: int, metrics: RouterMetrics) -> None:
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self._metrics = metrics
        self._places: collections.deque[Place] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._places)

    def enter(self) -> Place:
        """A place at the back of the queue; refused when `max_waiting` requests already wait."""
        if len(self._places) >= self.max_waiting:
            waiting = f" and {len(self._places)} requests already wait for it" if self._places else ""
            raise OverloadedError(f"No decode worker has room for this request{waiting}; "
                                  "retry later.", code="kv_cache_full", retry_after=self.retry_after)
        place = Place()
        self._places.append(place)
        self._metrics.admission_waiting.set(len(self._places))
        return place

    def wait_again(self, place: Place) -> None:
        """Woken, and still no room: wait for the next turn, keeping the place (the front)."""
        place.turn = asyncio.get_running_loop().create_future()
        place.woken = False

    def leave(self, place: Place) -> None:
        """Placed, timed out, failed or cancelled: give the place up; a turn it had and did not
        use up by waiting again goes to the next waiter (there may be room for it)."""
        try:
            self._places.remove(place)
        except ValueError:
            return
        self._metrics.admission_waiting.set(len(self._places))
        if place.woken:
            self.wake()

    def wake(self) -> None:
        """Room may have come back: the longest waiter not already trying tries again."""
        for place in self._places:
            if not place.woken and not place.turn.done():  # done: cancelled, about to leave
                place.woken = True
                place.turn.set_result(None)
                return
