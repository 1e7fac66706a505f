"""Which worker statuses are worth retrying elsewhere, and how long to wait before doing so."""

from __future__ import annotations

import random

import grpc

# The worker is gone or going away: try another worker of the same role.
WORKER_GONE = frozenset({grpc.StatusCode.UNAVAILABLE})
# The worker is alive but full (KV blocks or bounded queue): try another, then push back.
WORKER_FULL = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
# An error on a call we did not cancel that means the worker process died or lost its connection:
# take the worker out of rotation at once (its breaker opens) instead of waiting for probes.
WORKER_DIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                         grpc.StatusCode.UNKNOWN})


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)].

    Jitter spreads the retries of many requests that failed together (one worker died) so they do
    not hit the survivors in lockstep.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    return (rng or random).uniform(0.0, min(cap, base * (2 ** attempt)))
