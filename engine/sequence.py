"""One request inside an engine: its tokens, sampling parameters, KV blocks and stop rules."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .kv_cache import SeqBlocks
from .sampling import SamplingParams, TokenLogprob


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs is set
    blocks: SeqBlocks | None = None
    num_cached: int = 0  # positions whose K/V are in the cache
    finish_reason: FinishReason | None = None
    matcher: "object | None" = None  # engine.grammar.Matcher when the request has a grammar
    # the prompt's length; -1: len(prompt_ids). A decode worker knows only the length (the KV of
    # the prompt is in its blocks), so its sequences have no prompt_ids.
    num_prompt_tokens: int = -1

    def __post_init__(self):
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return (self.prompt_ids + self.output_ids)[-1] if not self.output_ids else self.output_ids[-1]

    @property
    def max_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_new_tokens

    def append(self, token: int, eos_ids: tuple[int, ...], max_context: int,
               logprob: TokenLogprob | None = None) -> bool:
        """Record a sampled token; returns True when the request is finished."""
        self.output_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        stops = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stops.update(eos_ids)
        if token in stops:
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= self.params.max_new_tokens or self.num_tokens >= max_context:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
