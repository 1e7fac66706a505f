"""The multi-turn chat workload's bookkeeping (no cluster: tests/test_prefix_serving.py runs one)."""

from __future__ import annotations

import math

from pdserve.bench.multiturn import ChatRun, ChatWorkload, Turn, render, shares


def _prompts(w: ChatWorkload) -> list[list[list[int]]]:
    """Each conversation's prompts, with replies of output_len made-up ids."""
    out = []
    for c in range(w.conversations):
        history, convo = w.system_prompt() + w.user_turn(c, 0), []
        for t in range(w.turns):
            convo.append(history)
            history = history + [7] * w.output_len + w.user_turn(c, t + 1)
        out.append(convo)
    return out


def test_shares_count_what_repeats(rng):
    w = ChatWorkload(rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 50), rng.randint(1, 20),
                     rng.randint(1, 20), math.inf, rng.randrange(100))
    prompts = _prompts(w)
    total = sum(len(p) for convo in prompts for p in convo)
    repeated = sum(len(convo[t - 1]) for convo in prompts for t in range(1, len(convo)))
    for convo in prompts:  # every later prompt extends the previous one; all share the system
        assert all(b[:len(a)] == a for a, b in zip(convo, convo[1:]))
        assert convo[0][:w.system_len] == prompts[0][0][:w.system_len]
    got_total, conv, ideal = shares(w)
    assert got_total == total
    assert math.isclose(conv, repeated / total)
    assert math.isclose(ideal, (repeated + (w.conversations - 1) * w.system_len) / total)


def test_render_reports_the_drop_in_computed_tokens():
    w = ChatWorkload(2, 2, 32, 8, 4, math.inf, 0)
    turns = [Turn(0, t, 40, 0.0, first=0.1, end=0.5) for t in range(2)]
    off = ChatRun("off", turns, prompt_tokens=1000, cached_tokens=0, wall_s=2.0)
    on = ChatRun("on", turns, prompt_tokens=1000, cached_tokens=600, wall_s=1.0)
    text = render(w, [off, on])
    assert "| on | 2/2 | 1000 | 400 | 60.0% |" in text
    assert "drop by 60.0%" in text
