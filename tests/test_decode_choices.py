"""n > 1 on a decode worker: the choices share the prompt's complete KV pages (refcounted blocks),
each gets its own copy of the partial last page and of its sliding pages, and all blocks come back."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_manager import BlockAllocator
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason, Sequence
from test_decode_scheduler import NEXT_TOKEN, Harness, drain


def test_shared_blocks_return_to_the_pool_with_their_last_holder():
    a = BlockAllocator(8)
    x = a.allocate(3)
    a.share(x[:2])
    a.share(x[:1])
    a.free(x)  # the first holder: only x[2] was its alone
    assert (a.num_free, a.num_used, a.num_shared) == (6, 2, 1)
    a.free(x[:2])
    assert (a.num_free, a.num_used, a.num_shared) == (7, 1, 0)
    a.free(x[:1], fence="r")
    assert a.num_free == 7 and a.lift_fence("r") == 1 and a.num_free == 8
    with pytest.raises(RuntimeError):
        a.free(x[:1])
    with pytest.raises(RuntimeError):
        a.share([5])


def test_choices_run_as_rows_and_give_every_block_back(tiny_cfg, rng):
    h = Harness(tiny_cfg, max_batch_size=8)
    n, prompt, max_new = 3, rng.randint(5, 30), 6
    free_before = h.blocks()[0]
    r = h.s.reserve("multi", prompt, max_new, ttl_s=60, n=n)
    assert len(r.choice_blocks) == n - 1
    h.kv("multi")
    params = SamplingParams(max_new_tokens=max_new, temperature=0, n=n, seed=rng.getrandbits(63))
    h.s.start("multi", [NEXT_TOKEN] * n, prompt, params)
    assert [c.params.seed for c in r.choices] == [(params.seed + i) % 2**64 for i in range(n)]
    shared = prompt // h.runner.cache.page_size
    h.s.run_once()
    assert h.runner.steps[-1] == ["multi"] * n  # one row per choice
    copies = h.runner.copies[-1]
    assert len(copies["full"]) == (n - 1) * (prompt % h.runner.cache.page_size > 0)
    assert h.runner.cache.allocator.num_shared == shared
    for c in r.choices[1:]:
        assert c.blocks.full[:shared] == r.blocks.full[:shared]
        assert not set(c.blocks.full[shared:]) & set(r.blocks.full)
    while h.s.run_once():
        pass
    events = drain(r)
    for i in range(n):
        mine = [e for e in events if e.choice == i]
        assert sum(len(e.tokens) for e in mine) == max_new - 1  # the first came from the prefill
        assert [e.finish_reason for e in mine][-1] == FinishReason.LENGTH
    assert h.blocks()[0] == free_before and h.runner.cache.allocator.num_shared == 0
    assert h.runner.cache.num_used_blocks == 0


def test_a_refused_reservation_takes_nothing_and_a_wrong_start_is_refused(tiny_cfg):
    h = Harness(tiny_cfg, max_batch_size=8, num_blocks=12)
    from pdserve.engine.block_manager import KVCacheFull

    with pytest.raises(KVCacheFull):
        h.s.reserve("big", 20, 20, ttl_s=60, n=4)
    assert h.runner.cache.num_used_blocks == 0
    h.s.reserve("two", 5, 3, ttl_s=60, n=2)
    with pytest.raises(ValueError, match="choice"):
        h.s.start("two", [NEXT_TOKEN], 5, SamplingParams(max_new_tokens=3, n=2))
    with pytest.raises(ValueError):
        h.s.reserve("many", 5, 3, ttl_s=60, n=9)  # more choices than batch rows


def test_a_forked_choice_decodes_as_a_fresh_prefill_of_its_sequence(tiny_runner, rng):
    """Real KV: prefill once, fork a choice (shared pages, copied partial and sliding pages), feed
    the two different tokens; the logits equal, bit for bit, those of the same decode batch over two
    sequences that each prefilled the prompt themselves, at that step and the next.

    The reference is that decode, not a prefill of each whole sequence: the two compute the router's
    logits in different matmul shapes, so where a token's 4th and 5th expert logits lie within bf16
    rounding of each other (a gap of a few 1e-3; about one prompt in 300 for this model) they pick
    different experts and the logits differ by several percent, however exact the fork."""
    cache = tiny_runner.cache
    prompt = [rng.randrange(1000, 100000) for _ in range(rng.randint(33, 60))]
    first = [rng.randrange(1000, 100000) for _ in range(2)]
    nxt = rng.randrange(1000, 100000)
    max_tokens = len(prompt) + 8
    params = SamplingParams(temperature=0, max_new_tokens=8)
    parent = Sequence("p", list(prompt), params)
    parent.blocks = cache.reserve(max_tokens, local_prompt_tokens=len(prompt))
    child_blocks = cache.reserve_choice(len(prompt), max_tokens)
    fresh = [Sequence(f"fresh{i}", list(prompt), params) for i in range(2)]  # the same tokens, no fork
    try:
        tiny_runner.prefill(parent)
        child = Sequence("c", list(prompt), params, blocks=child_blocks, num_cached=len(prompt))
        copies = cache.fork(parent.blocks, child.blocks, len(prompt))
        for seq in fresh:
            seq.blocks = cache.reserve(max_tokens, local_prompt_tokens=len(prompt))
            tiny_runner.prefill(seq)
        for seqs in ((parent, child), fresh):
            for seq, token in zip(seqs, first):
                seq.output_ids = [token]
        assert torch.equal(tiny_runner.decode([parent, child], block_copies=copies), tiny_runner.decode(fresh))
        for seq in (parent, child, *fresh):
            seq.output_ids.append(nxt)
        assert torch.equal(tiny_runner.decode([parent, child]), tiny_runner.decode(fresh))
    finally:
        cache.release(child_blocks)
        for seq in (parent, *fresh):
            if seq.blocks is not None:
                cache.release(seq.blocks)
    assert cache.num_used_blocks == 0 and cache.allocator.num_shared == 0
