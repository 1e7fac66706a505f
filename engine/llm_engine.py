"""A whole engine in one process: prefill at batch size 1, then continuous batched decode.

This is what `pdserve generate`, `pdserve logits` and the tests run; the disaggregated workers use
the same `ModelRunner` and `PagedKVCache` pieces split across processes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .decode_pipeline import InFlight, launch, next_rows, pipelinable
from .kv_cache import KVCacheFull
from .model_runner import InvalidRequest, ModelRunner
from .sampling import SamplingParams, TokenLogprob, sample
from .sequence import FinishReason, Sequence


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    output_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


class LLMEngine:
    """pipeline: with CUDA graphs on one rank and greedy requests, each decode step is launched
    before the host reads the previous step's tokens (they feed the next step on the device), so
    the host's planning overlaps the GPU's step; stop conditions are seen one step late (a request
    that ends on a stop token computes one discarded extra token; length ends are known ahead)."""

    def __init__(self, runner: ModelRunner, max_batch_size: int = 128, pipeline: bool = True):
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.pipeline = pipeline
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted and unfinished (in flight or not)
        self._inflight: InFlight | None = None
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        self.runner.validate_prompt(prompt_ids)
        params.check_vocab(self.runner.cfg.vocab_size)
        rid = request_id or f"req-{next(self._ids)}"
        seq = Sequence(rid, list(prompt_ids), params)
        if seq.max_tokens > self.runner.max_context:
            params.max_new_tokens = self.runner.max_context - len(prompt_ids)
        cache = self.runner.cache
        full, sliding = cache.blocks_needed(seq.max_tokens, len(prompt_ids))
        if full + sliding > cache.num_total_blocks:
            raise InvalidRequest(f"request needs {full} full + {sliding} sliding KV blocks; the cache has "
                                 f"{cache.num_total_blocks}")
        self.waiting.append(seq)
        return seq

    def _accept(self, seq: Sequence, token: int, logprob: TokenLogprob | None, on_token) -> bool:
        """Record a sampled token; a finished request gives its blocks back. True if it runs on."""
        done = seq.append(token, self.runner.cfg.eos_token_ids, self.runner.max_context, logprob)
        if on_token:
            on_token(seq, [token])
        if done:
            self.runner.cache.release(seq.blocks)
            if on_token:
                on_token(seq, [])
        return not done

    def step(self, on_token: Callable[[Sequence, list[int]], None] | None = None) -> list[Sequence]:
        """Admit and prefill waiting requests that fit, then one decode step for the rest.
        Returns the requests that finished in this step."""
        finished = []
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            try:
                seq.blocks = self.runner.cache.reserve(seq.max_tokens, len(seq.prompt_ids))
            except KVCacheFull:
                break  # wait for running requests to free blocks
            self.waiting.popleft()
            logits = self.runner.prefill(seq)
            out = sample(logits[None], [seq.params], [[]], stop_ids=self.runner.cfg.eos_token_ids)
            (self.running if self._accept(seq, out.tokens[0], out.logprobs[0], on_token) else finished).append(seq)
        if self._inflight is not None or (self.running and self._pipelinable(self.running)):
            return finished + self._pipelined_step(on_token)
        if self.running:
            batch, self.running = self.running, []
            logits = self.runner.decode(batch)
            out = sample(logits, [s.params for s in batch], [s.output_ids for s in batch],
                         stop_ids=self.runner.cfg.eos_token_ids)
            for seq, tok, lp in zip(batch, out.tokens, out.logprobs):
                (self.running if self._accept(seq, tok, lp, on_token) else finished).append(seq)
        return finished

    @property
    def busy(self) -> bool:
        """Requests waiting or running, or a step whose tokens are not read yet."""
        return bool(self.waiting or self.running or self._inflight is not None)

    def _pipelinable(self, batch: list[Sequence]) -> bool:
        return self.pipeline and pipelinable(self.runner, batch)

    def _pipelined_step(self, on_token) -> list[Sequence]:
        """Launch the next decode step (engine.decode_pipeline), then read the in-flight step's
        tokens: the one host synchronisation of the step, after the launch."""
        prev, self._inflight = self._inflight, None
        nxt = next_rows(self.running, prev, self.runner.max_context)
        if nxt and self._pipelinable(nxt):
            self._inflight = launch(self.runner, nxt, prev)
        finished = []
        if prev is not None:
            for seq, tok in zip(prev.seqs, prev.read()):
                if seq.finish_reason is not None:
                    continue  # ended on an earlier token: this step ran one past its end
                if not self._accept(seq, tok, None, on_token):
                    self.running.remove(seq)
                    finished.append(seq)
        return finished

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
        on_token: Callable[[Sequence, list[int]], None] | None = None,
    ) -> list[GenerationResult]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, dataclasses.replace(sp)) for p, sp in zip(prompts, params)]
        while self.busy:
            before = (len(self.waiting), len(self.running))
            self.step(on_token)
            if self.waiting and not self.running and before == (len(self.waiting), 0):
                raise KVCacheFull("a waiting request can never fit the KV cache")
        return [GenerationResult(s.request_id, s.prompt_ids, s.output_ids, s.finish_reason, s.output_logprobs)
                for s in seqs]
