"""Pipelined decode: launch step N+1 on step N's device-side tokens, then read step N's.

Shared by `LLMEngine` and the decode worker's scheduler so both run the one way. A row is
pipelined when its next token is the argmax of the logits (`sampled_on_device`): the GPU picks
it, it feeds the next step without a host round trip, and the host reads it one step late through
one event wait, issued after the next step is launched (on CUDA the argmax writes the ids into pinned
memory that the next step's input staging reads: kernels/step_io.py; the argmax is split over many
programs, kernels/triton_argmax.py). Stop tokens are
therefore seen one step late (a row that stops computes one discarded token); length ends are
known ahead and never overrun.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from pdserve.kernels.step_io import mapped, zero_copy
from pdserve.kernels.triton_argmax import argmax_rows

from .sampling import SamplingParams
from .sequence import Sequence

# The next ids through the split argmax (kernels/triton_argmax.py) rather than torch.argmax's one
# block a row; `PDSERVE_SPLIT_ARGMAX=0` keeps torch's (the benchmark's A/B).
SPLIT_ARGMAX = os.environ.get("PDSERVE_SPLIT_ARGMAX", "1") != "0"


def _argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return argmax_rows(logits, out=out) if SPLIT_ARGMAX else torch.argmax(logits, dim=-1, out=out)


def sampled_on_device(params: SamplingParams) -> bool:
    """Rows whose token is the plain argmax of the logits (no penalties, bias, min_tokens,
    logprobs or grammar): the pipelined decode picks these on the GPU without the host."""
    return (params.greedy and not params.penalised and not params.logit_bias and params.min_tokens == 0
            and params.logprobs is None and not params.grammar)


@dataclass
class InFlight:
    """A launched decode step whose tokens the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # int64 [B] the GPU reads: the next step's input ids
    host: torch.Tensor  # where the host reads them: pinned (CUDA), else `tokens`
    copied: object | None  # torch.cuda.Event recorded once they are in `host`
    fed_from: torch.Tensor | None = None  # the previous step's ids, alive until this step has read them

    def wait(self) -> None:
        """Until the step (and its KV writes) and the copy are done."""
        if self.copied is not None:
            self.copied.synchronize()

    def read(self) -> list[int]:
        self.wait()
        return [int(t) for t in self.host.tolist()]


def pipelinable(runner, seqs: Seq[Sequence]) -> bool:
    """One rank, CUDA-graph decode of this size, every row sampled on the device."""
    g = getattr(runner, "decode_graphs", None)
    return (g is not None and getattr(runner, "group", None) is None and len(seqs) <= g.max_batch
            and all(sampled_on_device(s.params) for s in seqs))


def next_rows(running: Seq[Sequence], prev: InFlight | None, max_context: int) -> list[Sequence]:
    """The rows of the next step: those with a pending token first (in the in-flight order), then
    rows new to the batch; a row whose pending token is its last (length) is left out."""
    pending = {id(s) for s in prev.seqs} if prev is not None else set()

    def last_pending(s: Sequence) -> bool:
        return id(s) in pending and (len(s.output_ids) + 1 >= s.params.max_new_tokens
                                     or s.num_tokens + 1 >= max_context)

    rows = [s for s in running if not last_pending(s)]
    order = {id(s): i for i, s in enumerate(prev.seqs)} if prev is not None else {}
    return sorted(rows, key=lambda s: (id(s) not in pending, order.get(id(s), 0)))


def launch(runner, seqs: list[Sequence], prev: InFlight | None,
           block_copies: dict[str, list[tuple[int, int]]] | None = None) -> InFlight:
    """Launch one decode step of `seqs` (ordered by `next_rows`): the rows pending in `prev` take
    their input ids from its device tensor, the others from the host."""
    rows = {id(s): i for i, s in enumerate(prev.seqs)} if prev is not None else {}
    m = sum(id(s) in rows for s in seqs)
    ids = None
    if m:
        idx = [rows[id(s)] for s in seqs[:m]]
        ids = prev.tokens[:m] if idx == list(range(m)) else prev.tokens[torch.tensor(idx, device=prev.tokens.device)]
    logits = runner.decode(seqs, block_copies=block_copies, device_ids=ids, keep_logits=False)
    # the argmax runs on the stream before the next step can overwrite the logits
    fed_from = prev.host if prev is not None and m else None
    if not logits.is_cuda:
        tokens = torch.argmax(logits, dim=-1)
        return InFlight(seqs, tokens, tokens, None)
    host = torch.empty(logits.shape[0], dtype=torch.long, pin_memory=True)
    # the argmax writes the ids into pinned memory, where the next step reads them (kernels/step_io.py);
    # a pinned buffer takes the device that was current at its allocation: on another one, copies
    tokens = mapped(host) if zero_copy(logits.device) else None
    if tokens is not None and tokens.device == logits.device:
        _argmax(logits, out=tokens)
    else:
        tokens = _argmax(logits)
        host.copy_(tokens, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return InFlight(seqs, tokens, host, copied, fed_from)
