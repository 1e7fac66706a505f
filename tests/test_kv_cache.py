"""The KV pool the two layer groups share (engine/kv_cache.py): one tensor, one allocator, a block
held for one group at a time; what a request holds and what a worker sizes."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdserve.engine.kv_cache import KVCacheFull, PagedKVCache, cdiv
from pdserve.kvtransfer.agent import _distinct_regions
from pdserve.prefill_worker.executor import prefill_kv_blocks

PAGE = 4


def test_the_groups_are_views_of_one_tensor(tiny_cfg):
    cache = PagedKVCache(tiny_cfg, num_blocks=10, page_size=PAGE)
    counts = PagedKVCache.group_layers(tiny_cfg)
    assert counts == {"full": 2, "sliding": 2}
    for g, pool in cache.pools.items():
        assert pool.data_ptr() == cache.storage.data_ptr() and pool.is_contiguous()
        assert pool.shape == (counts[g], 10, 2, PAGE, tiny_cfg.num_key_value_heads, tiny_cfg.head_dim)
    assert cache.storage.nbytes == 10 * PagedKVCache.bytes_per_block(tiny_cfg, PAGE, tiny_cfg.num_key_value_heads)


def test_unequal_groups_get_the_larger_ones_layers(tiny_cfg):
    """A model whose groups differ (here 3 sliding + 1 full) still shares one pool; a block is as
    large as a page of the larger group."""
    cfg = dataclasses.replace(tiny_cfg, layer_types=("sliding_attention",) * 3 + ("full_attention",))
    cache = PagedKVCache(cfg, num_blocks=6, page_size=PAGE)
    assert {g: p.shape[0] for g, p in cache.pools.items()} == {"full": 1, "sliding": 3}
    assert cache.storage.shape[0] == 3
    assert [cache.layer_group[i] for i in range(4)] == [("sliding", 0), ("sliding", 1), ("sliding", 2), ("full", 0)]
    no_window = PagedKVCache(dataclasses.replace(tiny_cfg, sliding_window=0), num_blocks=6, page_size=PAGE)
    assert list(no_window.pools) == ["full"] and not no_window.has_sliding and no_window.sliding_window_pages == 0


def test_a_request_holds_its_full_pages_and_only_its_window(tiny_cfg):
    """From one pool of blocks: a block a page of the full layers, and a window's worth for the
    sliding ones; so a long request holds about half the KV bytes that a page of every layer would."""
    cache = PagedKVCache(tiny_cfg, num_blocks=1024, page_size=PAGE)
    window_pages = cdiv(tiny_cfg.sliding_window, PAGE) + 1
    assert cache.sliding_window_pages == window_pages
    tokens = random.randint(200, 1000)
    seq = cache.reserve(tokens)
    assert len(seq.full) == cdiv(tokens, PAGE) and len(seq.owned_sliding()) == window_pages
    assert cache.num_used_blocks == cdiv(tokens, PAGE) + window_pages
    held = cache.num_used_blocks * PagedKVCache.bytes_per_block(tiny_cfg, PAGE, tiny_cfg.num_key_value_heads)
    every_layer = cdiv(tokens, PAGE) * 2 * PagedKVCache.bytes_per_block(tiny_cfg, PAGE, tiny_cfg.num_key_value_heads)
    assert held < 0.5 * every_layer + window_pages * every_layer / cdiv(tokens, PAGE)
    cache.release(seq)
    assert cache.num_free_blocks == 1024


def test_a_short_pool_refuses_what_both_groups_need_together(tiny_cfg):
    cache = PagedKVCache(tiny_cfg, num_blocks=20, page_size=PAGE)
    full, sliding = cache.blocks_needed(64)  # 16 full + 5 sliding: one block too many
    assert (full, sliding) == (16, 5) and not cache.can_admit(64)
    with pytest.raises(KVCacheFull, match="16 full \\+ 5 sliding"):
        cache.reserve(64)
    assert cache.num_free_blocks == 20  # nothing taken
    seq = cache.reserve(60)  # 15 + 5
    assert cache.num_free_blocks == 0
    cache.release(seq)


def test_layers_of_the_two_groups_never_write_into_each_others_pages(tiny_cfg, rng):
    """Random requests come and go through a pool that is always nearly full; every position of
    every live request, written in every layer with values of its own, reads back intact however
    the blocks were dealt between the groups."""
    cache = PagedKVCache(tiny_cfg, num_blocks=48, page_size=PAGE)
    kvh, hd = tiny_cfg.num_key_value_heads, tiny_cfg.head_dim
    live: dict[int, tuple] = {}  # id -> (blocks, written positions)

    def value(rid: int, layer: int, pos: int) -> torch.Tensor:
        return torch.full((1, kvh, hd), float((rid * 7 + layer * 3 + pos) % 251), dtype=torch.bfloat16)

    for rid in range(200):
        if live and (rng.random() < 0.45 or not cache.can_admit(8)):
            cache.release(live.pop(rng.choice(list(live)))[0])
            continue
        tokens = rng.randint(1, 60)
        if not cache.can_admit(tokens):
            continue
        seq = cache.reserve(tokens)
        for pos in range(tokens):  # decode-like: one position at a time, the window sliding
            slots = cache.prepare(seq, pos, 1)
            for layer in range(tiny_cfg.num_hidden_layers):
                cache.write(layer, slots, value(rid, layer, pos), -value(rid, layer, pos))
        live[rid] = (seq, tokens)
        held = [b for s, _ in live.values() for b in s.full + s.owned_sliding()]
        assert len(held) == len(set(held)) == cache.num_used_blocks
        for other, (s, n) in live.items():
            for layer in range(tiny_cfg.num_hidden_layers):
                g, _ = cache.layer_group[layer]
                first, table = (0, s.full) if g == "full" else (s.sliding_first_page, s.sliding)
                for pos in range(first * PAGE, n):  # a sliding layer: the pages still in its table
                    page = cache.layer_cache(layer)[table[pos // PAGE - first]]
                    assert torch.equal(page[0, pos % PAGE], value(other, layer, pos)[0]), (other, layer, pos)
                    assert torch.equal(page[1, pos % PAGE], -value(other, layer, pos)[0])
    for s, _ in live.values():
        cache.release(s)
    assert cache.num_used_blocks == 0


def test_a_prefill_worker_holds_its_longest_prompt_in_both_groups(tiny_cfg):
    blocks = prefill_kv_blocks(tiny_cfg, PAGE, prefix_cache_tokens=0)
    assert blocks == 2 * cdiv(tiny_cfg.max_context, PAGE)
    cache = PagedKVCache(tiny_cfg, num_blocks=blocks, page_size=PAGE, device="meta")
    seq = cache.reserve(tiny_cfg.max_context, local_prompt_tokens=tiny_cfg.max_context)
    assert cache.num_free_blocks == 0
    cache.release(seq)


def test_views_of_one_tensor_are_registered_once():
    storage = torch.zeros(3, 5, 8)
    other = torch.zeros(4)
    regions = _distinct_regions([storage[:2], storage[:3], storage[:1], other, torch.zeros(0)])
    assert len(regions) == 2
    assert regions[0].data_ptr() == storage.data_ptr() and regions[0].nbytes == storage.nbytes
    assert regions[1] is other
