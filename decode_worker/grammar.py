"""Structured outputs on a decode worker: each running sequence's grammar matcher, and the next
step's token bitmask computed on a thread while the model runs the step.

A sequence whose request carries a grammar gets its own `engine.grammar.Matcher` when it starts
(n > 1: one per choice), fed with the tokens it already has. Each step, `submit` hands the batch's
matchers to a thread that fills the bitmask (llguidance releases the GIL) while the model computes
the logits; the sampler applies it on the device; `accept` then moves each matcher on by its
sampled token. A batch without grammars starts no thread and passes no mask.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pdserve.engine.grammar import fill_masks, matcher_for  # noqa: F401 (the scheduler's)
from pdserve.engine.sequence import Sequence


class MaskPipeline:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def submit(self, seqs: list[Sequence]) -> Future | None:
        """Start filling this step's bitmask (int32 [B, words]); None when no row has a grammar."""
        matchers = [s.matcher for s in seqs]
        if all(m is None for m in matchers):
            return None
        return self._pool.submit(fill_masks, matchers)

    @staticmethod
    def result(future: Future | None) -> np.ndarray | None:
        return future.result() if future is not None else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
