"""ChoiceSplitter: one generation's interleaved events as one stream per choice (n > 1)."""

from __future__ import annotations

import asyncio
import random

from pdserve.router.errors import UpstreamError
from pdserve.router.orchestrator import ChoiceSplitter, TokenEvent


def _script(n: int, rng: random.Random) -> list[TokenEvent]:
    """Interleaved events of n choices, each ending with a finish, in a random order."""
    pending = {c: [TokenEvent([rng.randrange(1000)], choice=c) for _ in range(rng.randrange(1, 6))]
               for c in range(n)}
    for c in pending:
        pending[c][-1].finish_reason = 1
    out = []
    while pending:
        c = rng.choice(sorted(pending))
        out.append(pending[c].pop(0))
        if not pending[c]:
            del pending[c]
    return out


async def _events(script, error: Exception | None = None):
    for event in script:
        await asyncio.sleep(0)
        yield event
    if error is not None:
        raise error


async def _read(stream) -> list[TokenEvent]:
    return [e async for e in stream]


def test_each_choice_gets_its_events_in_order():
    rng = random.Random(random.getrandbits(32))
    n = rng.randint(2, 6)
    script = _script(n, rng)

    async def main():
        events = _events(script[1:])
        splitter = ChoiceSplitter(script[0], events, n)
        got = await asyncio.gather(*(_read(splitter.stream(c)) for c in range(n)))
        return got, events

    got, events = asyncio.run(main())
    for c in range(n):
        assert got[c] == [e for e in script if e.choice == c]
    assert events.ag_frame is None  # the generation's stream was closed


def test_an_error_reaches_every_unfinished_choice():
    n = 3
    script = [TokenEvent([1], choice=0), TokenEvent([2], 1, choice=1), TokenEvent([3], choice=2)]

    async def main():
        splitter = ChoiceSplitter(script[0], _events(script[1:], UpstreamError("decode worker died")), n)
        return await asyncio.gather(*(_read(splitter.stream(c)) for c in range(n)), return_exceptions=True)

    first, second, third = asyncio.run(main())
    assert isinstance(first, UpstreamError) and isinstance(third, UpstreamError)
    assert second == script[1:2]  # choice 1 had finished before the error


def test_a_client_gone_before_the_first_token_ends_every_choice():
    async def main():
        splitter = ChoiceSplitter(None, _events([]), 2)
        return await asyncio.gather(_read(splitter.stream(0)), _read(splitter.stream(1)))

    assert asyncio.run(main()) == [[], []]
