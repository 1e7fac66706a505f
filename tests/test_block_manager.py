"""Block bookkeeping without tensors: runs of consecutive blocks, exact accounting, fences."""

from __future__ import annotations


import pytest

from pdserve.engine.block_manager import BlockAllocator, KVBlockManager, KVCacheFull, runs


def test_fresh_allocator_hands_out_consecutive_runs_and_best_fit_holes():
    a = BlockAllocator(100)
    x, y, z = a.allocate(10), a.allocate(20), a.allocate(5)
    assert x == list(range(10)) and y == list(range(10, 30)) and z == list(range(30, 35))
    a.free(x)
    a.free(z)  # holes: [0, 10) and [30, 100)
    assert a.allocate(8) == list(range(8))  # the smallest hole that fits
    assert a.allocate(3) == list(range(30, 33))
    assert a.allocate(2) == [8, 9]


def test_random_churn_keeps_exact_accounting_and_prefers_runs(rng):
    n = rng.randint(50, 400)
    a = BlockAllocator(n)
    held: list[list[int]] = []
    fenced: dict[int, list[int]] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.45:
            k = rng.randint(1, 12)
            if k > a.num_free:
                with pytest.raises(KVCacheFull):
                    a.allocate(k)
                continue
            free_runs = [e - s for s, e in zip(a._starts, a._ends)]
            got = a.allocate(k)
            assert len(got) == k == len(set(got))
            if max(free_runs) >= k:  # one run was available: one run given
                assert len(runs(got)) == 1
            held.append(got)
        elif op < 0.8 and held:
            blocks = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.3:
                fenced[step] = blocks
                a.free(blocks, fence=step)
            else:
                a.free(blocks)
        elif fenced:
            key = rng.choice(list(fenced))
            assert a.lift_fence(key) == len(fenced.pop(key))
        in_use = sorted(b for h in held for b in h)
        in_fence = sorted(b for f in fenced.values() for b in f)
        assert a.num_used == len(in_use) and a.num_fenced == len(in_fence)
        assert a.num_free + a.num_used + a.num_fenced == n
        assert not any(a.is_free(b) for b in in_use + in_fence)
        assert all(s < e for s, e in zip(a._starts, a._ends))
        assert all(e < s for e, s in zip(a._ends, a._starts[1:]))  # sorted, maximal runs
    with pytest.raises(RuntimeError):
        a.free(in_fence[:1] or [n + 1])  # fenced blocks are not "in use": freeing again is an error


def test_fence_keeps_blocks_out_of_reach_until_lifted():
    m = KVBlockManager(page_size=4, num_blocks=11, window=8)
    seq = m.reserve(32)  # 8 full blocks + the sliding quota (3 pages of a 8-key window)
    assert m.num_free_blocks == 0
    m.release(seq, fence="req-1")
    assert (m.num_free_blocks, m.num_fenced_blocks, m.num_used_blocks) == (0, 11, 0)
    with pytest.raises(KVCacheFull, match="fenced"):
        m.reserve(4)
    assert m.lift_fence("unknown") == 0
    assert m.lift_fence("req-1") == 8 + 3
    assert m.num_free_blocks == 11 and m.num_fenced_blocks == 0
    m.reserve(32)
