"""Prefix cache: a prompt served from a cached prefix computes only its suffix and gets the same
logits as from scratch; exact block accounting under random reuse and eviction."""

from __future__ import annotations

import random

import pytest

from numerics import rel_l2
from pdserve.engine.kv_cache import KVCacheFull, PagedKVCache
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence

PAGE = 4  # the tiny model's 16-token window spans 4-5 pages: windows start mid-prompt


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(201088) for _ in range(n)]


@pytest.fixture(scope="module")
def runner(tiny_mxfp4):
    from pdserve.engine.model_runner import ModelRunner

    return ModelRunner(str(tiny_mxfp4), precision="bf16", page_size=PAGE, num_kv_blocks=96)


def _prefill(runner, cache: PrefixCache, tokens: list[int]):
    """What a prefill worker does: lease, compute the suffix, cache the pages, give back."""
    lease = cache.acquire(tokens)
    seq = Sequence("r", list(tokens), SamplingParams(temperature=0), blocks=lease.blocks,
                   num_cached=lease.num_cached)
    try:
        logits = runner.prefill(seq, all_logits=True, finish=False)
    except BaseException:
        cache.release(lease, computed=False)
        raise
    cache.release(lease, computed=True)
    return lease.num_cached, logits


@pytest.mark.parametrize("prefix_len", [10, 16, 45])  # ends inside / at / past the 16-token window
def test_cached_prefix_logits_equal_from_scratch(runner, prefix_len):
    rng = random.Random(prefix_len)
    cache = PrefixCache(runner.cache)
    system = _ids(prefix_len, rng)
    first = system + _ids(rng.randrange(1, 9), rng)
    cached, _ = _prefill(runner, cache, first)
    assert cached == 0
    for turn in range(2):  # a conversation growing on top of the cached prompt, then a sibling
        prompt = (first if turn == 0 else system) + _ids(rng.randrange(3, 30), rng)
        cached, logits = _prefill(runner, cache, prompt)
        shared = len(first) if turn == 0 else prefix_len
        assert cached == (min(shared, len(prompt) - 1) // PAGE) * PAGE > 0
        assert logits.shape[0] == len(prompt) - cached  # only the suffix was computed
        scratch = runner.prompt_logits(prompt)[cached:]
        assert rel_l2(logits, scratch) <= 1e-2
        # the argmax may only differ where the rounding noise exceeds the top-2 gap
        top2 = scratch.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (logits - scratch).abs().amax(-1)
        assert (logits.argmax(-1) == scratch.argmax(-1))[clear].all()
    cache.clear()
    assert runner.cache.num_used_blocks == 0


def test_missing_sliding_window_backs_off_to_a_whole_window(runner):
    """A page whose sliding block was evicted may not end a usable window; the match backs off
    to one that does, and the recomputed page gets its window back."""
    rng = random.Random(7)
    cache = PrefixCache(runner.cache)
    prompt = _ids(41, rng)
    _prefill(runner, cache, prompt)  # 10 complete pages cached
    probe = cache.acquire(prompt)
    victim = cache._entries[probe.keys[7]]
    cache.release(probe, computed=False)
    cache.drop_sliding(victim)
    longer = prompt + _ids(6, rng)
    cached, logits = _prefill(runner, cache, longer)
    assert cached == 7 * PAGE  # windows ending after page 8 or 9 need page 7's sliding block
    assert rel_l2(logits, runner.prompt_logits(longer)[cached:]) <= 1e-2
    assert victim.sliding_block is not None  # the recomputed page filled the gap
    cache.clear()
    assert runner.cache.num_used_blocks == 0


def test_random_reuse_and_eviction_keep_exact_accounting(tiny_cfg, rng):
    """Random prompts sharing prefixes, leases held across others, a pool too small for all:
    a pinned block is never handed out again, every block is owned exactly once, nothing leaks."""
    kv = PagedKVCache(tiny_cfg, num_blocks=40, page_size=PAGE)
    cache = PrefixCache(kv)
    roots = [_ids(rng.randrange(4, 30), rng) for _ in range(4)]
    held = []
    for _ in range(300):
        if held and (len(held) > 3 or rng.random() < 0.4):
            lease = held.pop(rng.randrange(len(held)))
            cache.release(lease, computed=rng.random() < 0.9)
        else:
            tokens = rng.choice(roots)[: rng.randrange(1, 30)] + _ids(rng.randrange(0, 20), rng)
            try:
                lease = cache.acquire(tokens)
            except KVCacheFull:
                assert held  # only pinned pages and other prompts' blocks can make it fail
                continue
            n = len(tokens)
            kv.prepare(lease.blocks, lease.num_cached, n - lease.num_cached)  # the prefill's tables
            held.append(lease)
        _check_ownership(kv, cache, held)
        _check_protection(cache)
        assert cache.num_pinned_pages() == sum(1 for e in cache._entries.values() if e.refs)
        assert cache.num_evictable_blocks == sum(1 + (e.sliding_block is not None)
                                                 for e in cache._entries.values() if not e.refs)
    for lease in held:
        cache.release(lease, computed=True)
    _check_ownership(kv, cache, [])
    assert cache.num_pinned_pages() == 0
    cache.clear()
    assert kv.num_used_blocks == 0 and cache.num_cached_pages == 0


def _check_ownership(kv: PagedKVCache, cache: PrefixCache, held) -> None:
    owned = cache.cached_blocks()
    mine = [b for pool in kv.pools for b in owned[pool]]
    for lease in held:
        mine += lease.own_full + lease.own_sliding
    assert len(mine) == len(set(mine)), "block owned twice (by two pages, or by both layer groups)"
    assert set(mine) == kv.allocator._used, "pool accounting"
    for lease in held:  # every page a held prompt reads is still there
        for e in lease.pinned:
            assert e.alive and e.refs > 0
            assert cache._entries[e.key] is e
        n_cached = lease.num_cached // PAGE
        assert [e.full_block for e in lease.pinned] == lease.blocks.full[:n_cached]


def _check_protection(cache: PrefixCache) -> None:
    """The counts kept as chains change equal the ones read off the chains now: each page is
    protected once per leaf or branch whose window covers it; an idle unprotected page holding a
    sliding block can give it back (it is in the eviction heap)."""
    entries = list(cache._entries.values())
    children = {id(e): 0 for e in entries}
    for e in entries:
        if e.parent is not None:
            children[id(e.parent)] += 1
    want = {id(e): 0 for e in entries}
    window = cache.kv.window
    for end in entries:
        n = children[id(end)]
        assert end.children == n
        if n == 1:
            continue
        depth = end.page + (n > 0)  # a leaf's window reaches one page further back
        first = max(0, depth * PAGE - window + 1) // PAGE
        e = end
        while e is not None and e.page >= first:
            want[id(e)] += 1
            e = e.parent
    assert {id(e): e.protected for e in entries} == want
    evictable = {id(it[3]) for it in cache._evict_sliding if cache._can_evict_sliding(it)}
    for e in entries:
        if not e.refs and not e.protected and e.sliding_block is not None:
            assert id(e) in evictable, e.page


def _cache_prompt(cache: PrefixCache, tokens: list[int]) -> int:
    """Lease, take the prefill's tables and cache the pages (the KV bytes do not matter here)."""
    lease = cache.acquire(tokens)
    cache.kv.prepare(lease.blocks, lease.num_cached, len(tokens) - lease.num_cached)
    cache.release(lease, computed=True)
    return lease.num_cached


def test_pressure_takes_middle_windows_before_a_conversations_end(tiny_cfg, rng):
    """A cached conversation and an unrelated prompt that does not fit beside it: the pool gives
    back sliding blocks from the conversation's middle, so its next turn resumes at its end."""
    kv = PagedKVCache(tiny_cfg, num_blocks=24, page_size=PAGE)
    assert kv.window == 16
    cache = PrefixCache(kv)
    turn = _ids(40, rng)  # 10 pages, 20 blocks
    assert _cache_prompt(cache, turn) == 0
    assert _cache_prompt(cache, _ids(12, rng)) == 0  # 6 blocks where 4 are free
    assert cache.num_cached_pages == 13  # no page was given up, two middle windows were
    assert _cache_prompt(cache, turn + _ids(5, rng)) == 40
    cache.clear()
    assert kv.num_used_blocks == 0


def test_pressure_keeps_the_window_where_prompts_diverge(tiny_cfg, rng):
    """Two conversations sharing a long system prompt mark the window at its end; pressure from an
    unrelated prompt takes other windows first, and a third conversation still reuses all of it."""
    kv = PagedKVCache(tiny_cfg, num_blocks=54, page_size=PAGE)
    cache = PrefixCache(kv)
    system = _ids(60, rng)  # 15 pages
    assert _cache_prompt(cache, system + _ids(10, rng)) == 0
    assert _cache_prompt(cache, system + _ids(9, rng)) == 60
    assert _cache_prompt(cache, _ids(40, rng)) == 0  # 20 blocks where 16 are free
    assert _cache_prompt(cache, system + _ids(7, rng)) == 60
    cache.clear()
    assert kv.num_used_blocks == 0


def test_pressure_takes_a_long_conversations_earlier_ends_before_pages(tiny_cfg, rng):
    """A conversation of three cached turns and an unrelated cached prompt; a third prompt does
    not fit beside them. The windows at the conversation's earlier turn ends (which only a
    repeat of an earlier turn would read) give their sliding blocks, so no page goes: its fourth
    turn resumes at its third's end and the other prompt stays whole."""
    kv = PagedKVCache(tiny_cfg, num_blocks=48, page_size=PAGE)
    cache = PrefixCache(kv)
    conversation = _ids(24, rng)  # 6 pages a turn: 36 blocks after three
    for turn in range(3):
        assert _cache_prompt(cache, conversation) == 6 * PAGE * turn
        conversation += _ids(24, rng)
    other = _ids(16, rng)  # 8 blocks
    assert _cache_prompt(cache, other) == 0
    assert _cache_prompt(cache, _ids(20, rng)) == 0  # 10 blocks where 4 are free
    assert cache.num_cached_pages == 18 + 4 + 5
    assert _cache_prompt(cache, other + _ids(3, rng)) == 16
    assert _cache_prompt(cache, conversation[:72] + _ids(8, rng)) == 72
    cache.clear()
    assert kv.num_used_blocks == 0
