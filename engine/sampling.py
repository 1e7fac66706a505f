"""Per-request sampling inside one batch, on the device, vectorised over the batch.

What a step does to each row's logits, in OpenAI's order: frequency and presence penalties (over
the tokens the request has generated), `logit_bias`, then `min_tokens` (stop ids masked until
enough tokens were generated), an optional token bitmask (structured outputs: a packed allowed-set
per row), temperature. The log-softmax of those processed logits is what `logprobs` reports; top-k
and top-p then cut the distribution and one token is drawn.

No step loops over the vocabulary in Python or synchronises with the device more than once: the
per-row parameters travel as small tensors, built on the host from what it already knows, and
every result (tokens, logprobs, alternatives) comes back in one device-to-host copy.

Randomness: a row draws with one uniform number u from a counter-based hash of (seed, index of
the token it samples), by inverting the cumulative distribution (the first token whose cumulative
probability exceeds u). It depends on nothing else (not the batch, not the worker), so a prefill
worker's first token and a decode worker's later tokens form the stream a single process would
produce. Choice i of an n > 1 request samples with seed + i (mod 2**64).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import numpy as np
import torch

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_LOGIT_BIAS = 100.0
_SEED_MOD = 2**64


class SamplingError(ValueError):
    """Sampling parameters out of range."""


@dataclass
class SamplingParams:
    """One request's (or one choice's) sampling rules.

    logprobs : None = off; k >= 0 = the sampled token's logprob and the k most likely alternatives.
    prompt_logprobs : None = off; k >= 0 = each prompt token's logprob (from the prefill) and k
        alternatives at each position.
    n : choices sampled from one prompt; choice i uses seed + i.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: str = ""  # structured output (engine.grammar): llguidance grammar text

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature <= 100):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
            if token < 0:
                raise SamplingError(f"logit_bias names token id {token}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise SamplingError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                                f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise SamplingError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.n < 1:
            raise SamplingError(f"n must be >= 1, got {self.n}")
        if self.seed is None:
            self.seed = random.getrandbits(63)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the parameters must exist (an out-of-range index on the device
        would kill the worker)."""
        for what, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingError(f"{what} names token id {bad[0]}, outside the vocabulary [0, {vocab_size})")

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice `index` of an n > 1 request: its own seed, one choice."""
        return replace(self, seed=(self.seed + index) % _SEED_MOD, n=1,
                       stop_token_ids=list(self.stop_token_ids), logit_bias=dict(self.logit_bias))


@dataclass
class TokenLogprob:
    """A token's log-probability and the `top` most likely tokens at its position, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the row did not ask for logprobs


# -- randomness ---------------------------------------------------------------------------------
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % _SEED_MOD
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % _SEED_MOD
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % _SEED_MOD
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) with which a request of `seed` samples token `index`."""
    return (_splitmix64(_splitmix64(seed % _SEED_MOD) ^ index) >> 11) / float(1 << 53)


# -- the sampler --------------------------------------------------------------------------------
def _tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> device without waiting for the device (pinned staging on CUDA)."""
    t = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallow tokens whose bit is clear. bitmask int32 [B, ceil(V / 32)]: bit j of word w is
    token 32 * w + j (the layout xgrammar and llguidance fill); an all-ones row leaves a row free."""
    b, v = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.to(logits.device, torch.int32).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(b, -1)[:, :v].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def _process(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
             stop_ids: tuple[int, ...], token_bitmask: torch.Tensor | None) -> torch.Tensor:
    """Penalties, logit_bias, min_tokens, bitmask, temperature: float32 [B, V] (`logits` itself
    when no rule changes it; never modified in place)."""
    dev = logits.device
    b, v = logits.shape
    x = logits.float()
    pen = [i for i, p in enumerate(params) if p.penalised and outputs[i]]
    bias = [(i, token, value) for i, p in enumerate(params) for token, value in p.logit_bias.items()]
    banned = [(i, t) for i, p in enumerate(params) if len(outputs[i]) < p.min_tokens
              for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids))]
    if (pen or bias or banned) and x is logits:
        x = x.clone()  # the rules below write in place
    if pen:
        # generated ids padded with v (a column dropped after counting); numpy fills rows in C
        padded = np.full((len(pen), max(len(outputs[i]) for i in pen)), v, dtype=np.int64)
        for row, i in enumerate(pen):
            padded[row, :len(outputs[i])] = outputs[i]
        ids = _tensor(padded, torch.long, dev)
        counts = torch.zeros(len(pen), v + 1, device=dev).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float))
        counts = counts[:, :v]
        freq = _tensor([params[i].frequency_penalty for i in pen], torch.float, dev)
        pres = _tensor([params[i].presence_penalty for i in pen], torch.float, dev)
        rows = _tensor(pen, torch.long, dev)
        x[rows] -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
    if bias:
        rows, cols, vals = zip(*bias)
        x.index_put_((_tensor(rows, torch.long, dev), _tensor(cols, torch.long, dev)),
                     _tensor(vals, torch.float, dev), accumulate=True)
    if banned:
        rows, cols = zip(*banned)
        x.index_put_((_tensor(rows, torch.long, dev), _tensor(cols, torch.long, dev)),
                     x.new_full((len(rows),), float("-inf")))  # made on the device: no host copy
    if token_bitmask is not None:
        x = apply_token_bitmask(x, token_bitmask)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):
        x = x / _tensor(temps, torch.float, dev)[:, None]
    return x


def _cut(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x with every token outside each row's top-k and top-p set to -inf. Only rows with top-p
    are sorted (a full sort of the vocabulary is the costly part); top-k alone takes the k-th value."""
    dev = x.device
    v = x.shape[1]
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    only_k = [i for i, p in enumerate(params) if p.top_k and p.top_k < v and p.top_p >= 1.0]
    if not nucleus and not only_k:
        return x
    x = x.clone()
    if only_k:
        rows = _tensor(only_k, torch.long, dev)
        k = _tensor([params[i].top_k for i in only_k], torch.long, dev)
        top = torch.topk(x[rows], max(params[i].top_k for i in only_k), dim=-1).values
        kth = top.gather(1, (k - 1)[:, None])
        x[rows] = x[rows].masked_fill(x[rows] < kth, float("-inf"))
    if nucleus:
        rows = _tensor(nucleus, torch.long, dev)
        sorted_x, order = torch.sort(x[rows], dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        k = _tensor([params[i].top_k or v for i in nucleus], torch.long, dev)
        top_p = _tensor([params[i].top_p for i in nucleus], torch.float, dev)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (torch.arange(v, device=dev)[None] >= k[:, None]) | ((torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None])
        cut = sorted_x.masked_fill(drop, float("-inf"))
        x[rows] = torch.empty_like(cut).scatter_(1, order, cut)  # back to vocabulary order
    return x


def _draw(x: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """One token per row by inverse-CDF sampling of the top-k/top-p cut distribution: [B] long."""
    u = _tensor([uniform(p.seed, len(o)) for p, o in zip(params, outputs)], torch.float32, x.device)
    cdf = torch.cumsum(torch.softmax(_cut(x, params), dim=-1), dim=-1)  # monotone: terms are >= 0
    target = (u * cdf[:, -1]).unsqueeze(-1)
    # a target rounded up to the total would fall past the last token with any mass: the first
    # position where the cdf reaches its maximum is that token
    last = torch.argmax(cdf, dim=-1, keepdim=True)
    return torch.minimum(torch.searchsorted(cdf, target, right=True), last).squeeze(-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]], *,
           stop_ids: tuple[int, ...] = (), token_bitmask: torch.Tensor | None = None) -> SampleOutput:
    """Sample one token per row.

    logits : float [B, V] on any device.
    params : per row.
    outputs : per row, the tokens it generated so far (penalties, min_tokens, and the index of
        the token being sampled, which with the seed fixes the random draw).
    stop_ids : the model's end-of-turn ids, masked with the row's stop_token_ids while a row has
        fewer than min_tokens (unless it ignores EOS).
    token_bitmask : optional int32 [B, ceil(V / 32)] allowed-token bits (see apply_token_bitmask).
    """
    b, v = logits.shape
    x = _process(logits, params, outputs, stop_ids, token_bitmask)
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = torch.argmax(x, dim=-1)
    else:
        tokens = _draw(x, params, outputs)
        if any(greedy):
            tokens = torch.where(_tensor(greedy, torch.bool, x.device), torch.argmax(x, dim=-1), tokens)
    want = [p.logprobs for p in params]
    if all(k is None for k in want):
        return SampleOutput(tokens.tolist(), [None] * b)
    logprobs = torch.log_softmax(x, dim=-1)
    k = max(w or 0 for w in want)
    parts = [tokens.double()[:, None], logprobs.gather(1, tokens[:, None]).double()]
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    host = torch.cat(parts, dim=1).cpu()  # the step's one device-to-host copy
    out = []
    for i, w in enumerate(want):
        row = host[i].tolist()
        if w is None:
            out.append(None)
            continue
        top = list(zip((int(t) for t in row[2:2 + w]), row[2 + k:2 + k + w])) if w else []
        out.append(TokenLogprob(int(row[0]), row[1], top))
    return SampleOutput([int(t) for t in host[:, 0].tolist()], out)


def prompt_logprob_rows(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Raw-logit logprobs of the next prompt tokens and the k most likely at each position, packed
    on the device: float64 [n, 1 + 2k] = (logprob of next_ids[i], top ids, top logprobs).

    logits : float [n, V]; row i is the distribution that next_ids[i] was drawn from."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    cols = [logprobs.gather(1, next_ids.to(logits.device)[:, None]).double()]
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, dim=1)


def unpack_prompt_logprobs(packed: torch.Tensor, prompt_ids: list[int], k: int) -> list[TokenLogprob]:
    """`prompt_logprob_rows` of prompt tokens 2..L -> one TokenLogprob each (one host copy)."""
    host = packed.cpu().tolist()
    return [TokenLogprob(prompt_ids[i + 1], row[0], list(zip((int(t) for t in row[1:1 + k]), row[1 + k:])))
            for i, row in enumerate(host)]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int, chunk: int = 1024) -> list[TokenLogprob]:
    """Logprob of each prompt token after the first given the ones before it (raw logits, as
    prompts are not sampled), with the k most likely tokens at its position.

    logits : float [L, V], row i = the distribution after prompt_ids[: i + 1]; taken `chunk` rows
    at a time so a long prompt needs no second [L, V] buffer."""
    n = len(prompt_ids) - 1
    if n <= 0:
        return []
    ids = torch.tensor(prompt_ids[1:], dtype=torch.long)
    packed = torch.cat([prompt_logprob_rows(logits[s:s + chunk], ids[s:s + chunk], k) for s in range(0, n, chunk)])
    return unpack_prompt_logprobs(packed, prompt_ids, k)
