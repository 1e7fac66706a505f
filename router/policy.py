"""Routing policy: which (prefill, decode) pair serves a request, and the fallbacks in order.

The registry says who is routable; the policy says who fits and who is best. Rankings, not single
picks, so the orchestrator can fall back when a worker refuses (its report was stale) or dies.
"""

from __future__ import annotations

import abc
import math
from typing import Sequence

from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Worker


def kv_blocks_needed(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens that `num_tokens` positions occupy in a full-attention layer."""
    if page_size <= 0:
        return 0  # worker did not report a page size: let its Reserve decide
    return -(-num_tokens // page_size)


def kv_blocks_for_choices(num_prompt_tokens: int, max_new_tokens: int, n: int, page_size: int,
                          sliding_window_pages: int) -> int:
    """Blocks a decode worker takes for `n` choices of prompt + max_new_tokens
    (engine/block_manager.py). Full-attention pages: the first choice holds every page, each other
    one shares the prompt's complete pages and holds the rest (its copy of the partial last page
    included). Sliding-window pages: each choice its own, as many as the window spans (at most
    `sliding_window_pages`, the worker's LoadReport; 0 without sliding-window layers)."""
    if page_size <= 0:
        return 0
    pages = kv_blocks_needed(num_prompt_tokens + max_new_tokens, page_size)
    full = pages + (n - 1) * (pages - num_prompt_tokens // page_size)
    return full + n * min(sliding_window_pages, pages)


def max_new_tokens_within(num_prompt_tokens: int, n: int, kv_blocks: int, page_size: int,
                          sliding_window_pages: int) -> int:
    """The largest max_new_tokens whose `n` choices fit `kv_blocks` (< 1: not even one token):
    the most pages P a choice may reach with n * (P + min(w, P)) - (n - 1) * shared <= kv_blocks."""
    shared = num_prompt_tokens // page_size
    room = (kv_blocks + (n - 1) * shared) // n  # P + min(w, P) per choice
    w = sliding_window_pages
    pages = room - w if room - w >= w else room // 2
    return pages * page_size - num_prompt_tokens


class RoutingPolicy(abc.ABC):
    """Ranks routable workers for one request; subclasses decide what "best" means."""

    @abc.abstractmethod
    def rank_decode(self, workers: Sequence[Worker], num_prompt_tokens: int,
                    max_new_tokens: int) -> list[Worker]:
        """Decode workers that can admit prompt + max_new_tokens, best first (may be empty)."""

    @abc.abstractmethod
    def rank_prefill(self, workers: Sequence[Worker], num_prompt_tokens: int,
                     prompt_token_ids: Sequence[int] = ()) -> list[Worker]:
        """Prefill workers, best first."""

    def prefilled(self, worker: Worker, prompt_token_ids: Sequence[int]) -> None:
        """`worker` ran this prompt (a cache-aware policy remembers it)."""

    def forget(self, worker: Worker) -> None:
        """`worker` died: whatever it cached is gone."""

    def select_pair(self, prefill: Sequence[Worker], decode: Sequence[Worker],
                    num_prompt_tokens: int, max_new_tokens: int) -> tuple[Worker, Worker] | None:
        """The best (prefill, decode) pair, or None when no pair can take the request."""
        ranked_prefill = self.rank_prefill(prefill, num_prompt_tokens)
        ranked_decode = self.rank_decode(decode, num_prompt_tokens, max_new_tokens)
        if not ranked_prefill or not ranked_decode:
            return None
        return ranked_prefill[0], ranked_decode[0]


class LoadAwarePolicy(RoutingPolicy):
    """Decode: most free KV blocks among workers that fit. Prefill: fewest queued prompt tokens.

    Free blocks are what the last LoadReport said minus what this router reserved since; a worker
    fits when its context limit and free blocks cover prompt + max_new_tokens (full-attention
    and sliding-window pages; the worker's own Reserve stays the authority), and while this router has fewer requests
    on it than its batch slots plus `slot_headroom` of them (the few in prefill or about to start
    keep the batch full). Beyond that a request would only wait on the worker, already answered
    200, until a slot frees; it waits in the router's admission queue instead, where the wait is
    bounded and ends in a 429 before the response starts.
    """

    slot_headroom = 0.25

    def slots(self, worker: Worker) -> int | None:
        """Requests this router may have on a decode worker at once (None: no limit known)."""
        batch = worker.load.max_batch_size if worker.load else 0
        return math.ceil(batch * (1 + self.slot_headroom)) if batch > 0 else None

    def rank_decode(self, workers: Sequence[Worker], num_prompt_tokens: int,
                    max_new_tokens: int) -> list[Worker]:
        total = num_prompt_tokens + max_new_tokens
        fits = []
        for worker in workers:
            load = worker.load
            if load is None or load.draining:
                continue
            if load.max_context and total > load.max_context:
                continue
            if worker.free_kv_blocks < kv_blocks_for_choices(num_prompt_tokens, max_new_tokens, 1, load.page_size,
                                                             load.sliding_window_pages):
                continue
            slots = self.slots(worker)
            if slots is not None and worker.active_requests >= slots:
                continue
            fits.append(worker)
        return sorted(fits, key=lambda w: (-w.free_kv_blocks, w.load.running_requests, w.name))

    def rank_prefill(self, workers: Sequence[Worker], num_prompt_tokens: int,
                     prompt_token_ids: Sequence[int] = ()) -> list[Worker]:
        alive = [w for w in workers if w.load is not None and not w.load.draining]
        return sorted(alive, key=lambda w: (w.queued_prompt_tokens, w.load.queued_requests, w.name))


class CacheAwarePolicy(LoadAwarePolicy):
    """Prefill: the worker that probably caches the longest prefix of the prompt (router-side
    `PrefixIndex` of what was sent where), unless its queue holds more than `imbalance_tokens`
    prompt tokens beyond the least-loaded worker's: then the least-loaded, as without a cache.
    The others follow by load (fallbacks). Decode: as LoadAwarePolicy.
    """

    def __init__(self, index: PrefixIndex | None = None, *, imbalance_tokens: int = 8192) -> None:
        if imbalance_tokens < 0:
            raise ValueError("imbalance_tokens must be >= 0")
        self.index = index or PrefixIndex()
        self.imbalance_tokens = imbalance_tokens

    def rank_prefill(self, workers: Sequence[Worker], num_prompt_tokens: int,
                     prompt_token_ids: Sequence[int] = ()) -> list[Worker]:
        by_load = super().rank_prefill(workers, num_prompt_tokens)
        if len(by_load) < 2 or not prompt_token_ids:
            return by_load
        matched = self.index.match(prompt_token_ids, [w.name for w in by_load])
        best = max(by_load, key=lambda w: matched[w.name])  # ties: the less loaded (stable order)
        if matched[best.name] == 0:
            return by_load
        if best.queued_prompt_tokens - by_load[0].queued_prompt_tokens > self.imbalance_tokens:
            return by_load
        return [best] + [w for w in by_load if w is not best]

    def prefilled(self, worker: Worker, prompt_token_ids: Sequence[int]) -> None:
        self.index.record(worker.name, prompt_token_ids)

    def forget(self, worker: Worker) -> None:
        self.index.forget(worker.name)
