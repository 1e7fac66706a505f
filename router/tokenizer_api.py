"""Tokenizer endpoints as vLLM serves them: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Clients count tokens, build prompts from ids, and evaluation harnesses (lm-eval's remote
tokenizer) tokenize contexts with the server's own tokenizer. `/tokenize` takes a plain-text
`prompt` (as `/v1/completions` encodes it, except that text spelling a special token is that
token, as in vLLM) or chat `messages` (as `/v1/chat/completions` renders
them with Harmony, ending with `<|start|>assistant` unless `add_generation_prompt` is false).
The same input bounds as generation apply.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from pdserve.router.errors import InvalidRequestError
from pdserve.router.harmony import GPT_OSS_VOCAB_SIZE, HarmonyError
from pdserve.router.openai_schema import _STRICT, ChatMessage, Tool, parse_body

TOKENIZER_NAME = "o200k_harmony"  # gpt-oss's encoding: o200k_base plus the Harmony special tokens


class _Model(BaseModel):
    model_config = _STRICT
    model: str | None = None
    return_token_strs: bool = False


class TokenizeText(_Model):
    prompt: str
    add_special_tokens: bool = True  # gpt-oss adds none to plain text: accepted, no effect


class TokenizeChat(_Model):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    add_generation_prompt: bool = True
    continue_final_message: Literal[False] = False
    add_special_tokens: bool = False


class Detokenize(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class TokenizerAPI:
    """The endpoints over the chat front end's codec, body bounds and model check."""

    def __init__(self, frontend) -> None:
        self.frontend = frontend
        self.codec = frontend.codec

    def register(self, app: FastAPI) -> None:
        app.post("/tokenize")(self._framed("tokenize", self.tokenize))
        app.post("/detokenize")(self._framed("detokenize", self.detokenize))
        app.get("/tokenizer_info")(self.tokenizer_info)

    def _framed(self, endpoint: str, handler):
        async def route(request: Request) -> Response:
            return await self.frontend._run(endpoint, handler, request)
        return route

    async def tokenize(self, request: Request, _arrival: float) -> Response:
        raw = await self.frontend.read_body(request)
        chat = isinstance(raw, dict) and "messages" in raw
        body = parse_body(TokenizeChat if chat else TokenizeText, raw)
        self._check_model(body.model)
        try:
            ids = await asyncio.to_thread(self._chat_ids if chat else self._text_ids, body)
        except HarmonyError as error:
            raise InvalidRequestError(str(error), param=error.param) from None
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self._max_model_len(),
                                  "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            answer["token_strs"] = [self.codec.decode([t]) for t in ids]
        return JSONResponse(answer)

    def _text_ids(self, body: TokenizeText) -> list[int]:
        # as vLLM's tokenizer does, text spelling a special token is that token (lm-eval finds
        # the id of the eos token this way); /v1/completions refuses such text instead
        return self.codec.encode(body.prompt, special_tokens=True)

    def _chat_ids(self, body: TokenizeChat) -> list[int]:
        ids = self.codec.render_chat(
            [m.model_dump(exclude_none=True) for m in body.messages],
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            reasoning_effort=body.reasoning_effort)
        if not body.add_generation_prompt:
            ids = ids[:-len(self.codec.assistant_prompt_ids)]
        return ids

    async def detokenize(self, request: Request, _arrival: float) -> Response:
        body = parse_body(Detokenize, await self.frontend.read_body(request))
        self._check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < GPT_OSS_VOCAB_SIZE]
        if bad:
            raise InvalidRequestError(f"tokens outside [0, {GPT_OSS_VOCAB_SIZE}): {bad[:5]}",
                                      param="tokens")
        return JSONResponse({"prompt": self.codec.decode(body.tokens)})

    async def tokenizer_info(self) -> Response:
        codec = self.codec
        return JSONResponse({
            "tokenizer_class": TOKENIZER_NAME, "vocab_size": GPT_OSS_VOCAB_SIZE,
            "model_max_length": self._max_model_len(),
            "eos_token": codec.decode([codec.return_id]),
            "eos_token_ids": codec.stop_token_ids(),
            "bos_token": None, "pad_token": None,
            "add_bos_token": False, "add_eos_token": False,
            "special_tokens_start": codec.first_special_id,
            "chat_format": "harmony",
        })

    def _check_model(self, model: str | None) -> None:
        if model is not None:
            self.frontend._check_model(model)

    def _max_model_len(self) -> int | None:
        return self.frontend.registry.max_context() or None
