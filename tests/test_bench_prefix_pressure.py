"""bench/prefix_pressure.py: with room for the whole workload the cache serves exactly the ideal (every
earlier prompt's prefix, page by page); with less it serves less, never more."""

from __future__ import annotations

from pdserve.bench.multiturn import ChatWorkload
from pdserve.bench.prefix_pressure import ideal, run


def test_room_for_everything_serves_the_ideal_and_less_room_serves_less():
    w = ChatWorkload(conversations=4, turns=3, system_len=300, user_len=40, output_len=50, rate=float("inf"), seed=1)
    sent, cached = run(w, cache_tokens=w.conversations * (w.prompt_len(w.turns - 1) + w.output_len))
    assert sent == sum(w.system_len + w.user_len + t * (w.output_len + w.user_len) for t in range(3)) * 4
    assert cached == ideal(w) > 0
    _, tight = run(w, cache_tokens=256)
    assert 0 < tight < cached
