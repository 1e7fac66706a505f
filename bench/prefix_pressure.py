"""How much of a multi-turn chat workload a prefill worker's prefix cache serves when its KV room is
smaller than the workload's: the cache's own arithmetic (engine/prefix_cache.py on a pool of gpt-oss'
page and window), no model and no server, so it runs in seconds on any machine.

The conversations of bench/multiturn.py (one shared system prompt, user turns, replies of a fixed length
whose ids stand in for the model's) take turns round-robin, each turn's prompt the whole conversation so
far, as a router sending them to one prefill worker would. The pool holds `--cache-tokens` of cached
prefix beyond the longest prompt, sized as `pdserve prefill-worker --prefix-cache-tokens` sizes it.

    python -m pdserve.bench.prefix_pressure [--conversations 16 --turns 6 --system-len 2048
        --user-len 256 --output-len 256] [--cache-tokens 8192,16384,32768,65536]

Prints, per cache size: prompt tokens, tokens served from the cache (hit rate), and the ideal (every
token a cache of unlimited room would serve, at page granularity).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pdserve.bench.multiturn import ChatWorkload
from pdserve.engine.config import preset
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.prefix_cache import PrefixCache


def run(w: ChatWorkload, cache_tokens: int, page_size: int = 16) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of the workload through one prefix cache."""
    cfg = dataclasses.replace(preset("20b"), num_hidden_layers=2,
                              layer_types=("sliding_attention", "full_attention"))
    system = w.system_prompt()
    longest = w.prompt_len(w.turns - 1) + w.output_len  # the longest prompt and its reply: the max context
    blocks = PagedKVCache.prompt_blocks(cfg, longest + cache_tokens, page_size)
    kv = PagedKVCache(cfg, num_blocks=blocks, page_size=page_size, num_kv_heads=1)
    cache = PrefixCache(kv)
    history = {c: system + w.user_turn(c, 0) for c in range(w.conversations)}
    sent = cached = 0
    for t in range(w.turns):
        for c in range(w.conversations):
            prompt = history[c]
            lease = cache.acquire(prompt)
            kv.prepare(lease.blocks, lease.num_cached, len(prompt) - lease.num_cached)
            cache.release(lease, computed=True)
            sent, cached = sent + len(prompt), cached + lease.num_cached
            history[c] = prompt + w.stand_in_reply(c, t) + w.user_turn(c, t + 1)
    cache.clear()
    if kv.num_used_blocks:
        raise RuntimeError(f"{kv.num_used_blocks} blocks left after clearing the cache")
    return sent, cached


def ideal(w: ChatWorkload, page_size: int = 16) -> int:
    """Tokens a cache with unlimited room serves: each prompt's longest earlier prompt's prefix (the
    same conversation's previous turn, else the system prompt plus what the page boundary allows)."""
    total = 0
    for t in range(w.turns):
        for c in range(w.conversations):
            n = w.prompt_len(t)
            shared = w.prompt_len(t - 1) if t else (w.system_len if c else 0)  # the previous turn's prompt
            total += min(shared, n - 1) // page_size * page_size
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--cache-tokens", default="8192,16384,32768,65536")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    w = ChatWorkload(a.conversations, a.turns, a.system_len, a.user_len, a.output_len, float("inf"), a.seed)
    best = ideal(w)
    print(f"{w.describe()}; round-robin turns; page 16, window 128 (gpt-oss)")
    print("| --prefix-cache-tokens | prompt tokens | served from the cache | hit rate | of the ideal |")
    print("|---|---|---|---|---|")
    for room in [int(v) for v in a.cache_tokens.split(",")]:
        sent, cached = run(w, room)
        print(f"| {room} | {sent} | {cached} | {cached / sent:.1%} | {cached / best:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
