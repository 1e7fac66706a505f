"""OpenAI logprobs shapes from the workers' `TokenLogprob` messages.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}`, one
entry per generated token (with gpt-oss that includes Harmony's channel markup and the reasoning,
so the tokens spell the raw completion). Completions (legacy): parallel lists `tokens`,
`token_logprobs`, `top_logprobs` (token text -> logprob, the sampled token included) and
`text_offset`; with `echo` the prompt's tokens come first, the very first without a logprob.
"""

from __future__ import annotations

from functools import lru_cache

from pdserve.router.harmony import HarmonyCodec

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the sampler masked reports this, as in vLLM


def _finite(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


class LogprobFormatter:
    """Token text and bytes (cached per id) and the two response shapes."""

    def __init__(self, codec: HarmonyCodec) -> None:
        self._token = lru_cache(maxsize=1 << 16)(self._token_uncached)
        self._codec = codec

    def _token_uncached(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._codec.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def text(self, token_id: int) -> str:
        return self._token(token_id)[0]

    # ---- chat --------------------------------------------------------------------------------
    def chat_entry(self, lp, top: int) -> dict:
        text, raw = self._token(lp.token_id)
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": raw,
                "top_logprobs": [self._alternative(t, x)
                                 for t, x in zip(lp.top_token_ids[:top], lp.top_logprobs[:top])]}

    def _alternative(self, token_id: int, logprob: float) -> dict:
        text, raw = self._token(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    def chat(self, logprobs: list, top: int) -> dict:
        return {"content": [self.chat_entry(lp, top) for lp in logprobs], "refusal": None}

    # ---- completions -------------------------------------------------------------------------
    def completion(self, logprobs: list, top: int, *, offset: int = 0,
                   prompt_first_token: int | None = None) -> dict:
        """Legacy shape; `prompt_first_token` (echo) leads without a logprob; text offsets start
        at `offset` (the length of text already sent in earlier chunks)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt_first_token is not None:
            offset = self._append(out, prompt_first_token, None, None, offset)
        for lp in logprobs:
            alternatives = {self.text(t): _finite(x)
                            for t, x in zip(lp.top_token_ids[:top], lp.top_logprobs[:top])}
            alternatives.setdefault(self.text(lp.token_id), _finite(lp.logprob))
            offset = self._append(out, lp.token_id, _finite(lp.logprob), alternatives, offset)
        return out

    def _append(self, out: dict, token_id: int, logprob, alternatives, offset: int) -> int:
        text = self.text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        return offset + len(text)


def merge_completion_logprobs(parts: list[dict]) -> dict:
    """One legacy logprobs object from several (prompt and streamed pieces, in order)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out
