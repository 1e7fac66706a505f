"""Per-request sampling inside one batch: greedy, temperature, top-k, top-p, seeded streams.

A request's randomness depends only on (seed, index of the token it samples), never on the batch
it shares or the worker it runs on, so a prefill worker's first token and a decode worker's later
tokens form the same stream a single process would produce.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """Sampling parameters out of range."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature <= 100):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is None:
            self.seed = random.getrandbits(63)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _token_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (2**63))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """logits [B, V] float32; indices[i] = how many tokens request i has sampled before.

    Greedy rows take the argmax of their logits; the others the argmax of their filtered,
    Gumbel-perturbed logits. One argmax over the whole batch and one device-to-host copy per
    step (a per-row `int()` would synchronise with the GPU once per request)."""
    scores = logits
    for i, (p, idx) in enumerate(zip(params, indices)):
        if p.greedy:
            continue
        if scores is logits:
            scores = logits.float().clone()
        x = logits[i].float() / p.temperature
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # drop a token when the mass before it already reaches top_p (the first always stays)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
        g = _token_generator(p.seed, idx, x.device)
        u = torch.rand(x.shape, generator=g, device=x.device).clamp_(1e-20, 1.0)
        scores[i] = x - torch.log(-torch.log(u))  # Gumbel-max
    return torch.argmax(scores, dim=-1).tolist()
