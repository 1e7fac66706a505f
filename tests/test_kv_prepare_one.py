"""PagedKVCache.prepare_one (a decode step's slot per request, in ints) walks a request's pages
exactly as prepare(seq, pos, 1) does: same slots, same sliding-window page recycling."""

from __future__ import annotations

import copy

import torch

from pdserve.engine.kv_cache import PagedKVCache


def test_prepare_one_matches_prepare(tiny_cfg):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    cache = PagedKVCache(tiny_cfg, num_blocks=64, page_size=4)
    cache.reserve(int(torch.randint(1, 40, (), generator=g)))  # others' blocks: ids are not 0..n
    prompt = int(torch.randint(1, 30, (), generator=g))
    a = cache.reserve(prompt + 50, local_prompt_tokens=prompt)
    cache.prepare(a, 0, prompt)
    cache.finish_prefill(a, prompt)
    b = copy.deepcopy(a)
    for pos in range(prompt, prompt + 50):
        want = {k: int(v) for k, v in cache.prepare(a, pos, 1).items()}
        assert cache.prepare_one(b, pos) == want
        assert b == a
