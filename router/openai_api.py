"""OpenAI-compatible HTTP API (FastAPI): chat completions, completions, models, health, metrics.

Requests are validated (pydantic) and rendered to token ids (Harmony for chat, plain text for
completions); the orchestrator runs them; sampled ids come back through Harmony's streaming parser
(chat: reasoning, content, tool calls) or an incremental detokenizer (completions). Errors leave as
OpenAI error bodies with the status the error type fixes. A client that disconnects, in a stream
or not, gets its request cancelled on both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.proto import pdserve_pb2
from pdserve.router.accounting import CLIENT_CLOSED, Outcome, RequestAccounting, outcome_of
from pdserve.router.config import RouterConfig
from pdserve.router.errors import InvalidRequestError, ModelNotFoundError, RouterError
from pdserve.router.harmony import Delta, HarmonyCodec, HarmonyError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_schema import (ChatCompletionRequest, CompletionRequest, NamedToolChoice,
                                  parse_body)
from pdserve.router import structured_output
from pdserve.router.orchestrator import (ChoiceSplitter, FINISH_LENGTH, FINISH_STOP, Generation, Orchestrator,
                                 TokenEvent)
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.router.logprobs import LogprobFormatter, merge_completion_logprobs
from pdserve.router.registry import WorkerRegistry
from pdserve.router.request_limits import check_strings, read_json_body
from pdserve.router.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)


def error_response(error: RouterError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
    return JSONResponse(error.to_openai(), status_code=error.http_status, headers=headers)


# Characters JSON leaves as they are (ensure_ascii=False) but generic line readers split on
# (str.splitlines: httpx's and requests' iter_lines): escaped, so that a token's text holding one
# cannot cut a data line in two for such a client. SSE itself breaks lines only at CR / LF, which
# json.dumps always escapes.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict, event: str | None = None) -> str:
    """One server-sent event: `payload` as compact JSON on one data line (its `event:` line first
    when given)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


async def _cancel_on_disconnect(request: Request, generations: list[Generation]) -> None:
    """Wait for the client to go away, then cancel its requests on the workers."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for generation in generations:
                generation.cancel("client disconnected")
            return


def _event_stream(body: AsyncIterator[str], on_unstarted: Callable[[], Any]) -> StreamingResponse:
    """An SSE response whose cleanup also runs when the client leaves before the server starts
    iterating the body: then the body's own `finally` never runs (an async generator that never
    started cannot be closed into its try block), so `on_unstarted` (awaited after the response,
    as Starlette's background task) does that cleanup instead."""
    started = False

    async def guarded() -> AsyncIterator[str]:
        nonlocal started
        started = True
        try:
            async for item in body:
                yield item
        finally:
            await body.aclose()

    async def after() -> None:
        if not started:
            await on_unstarted()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(after))


def _finish_name(finish_reason: int) -> str:
    return "length" if finish_reason == FINISH_LENGTH else "stop"


# ---- output assembly --------------------------------------------------------------------------
class ChatOutput:
    """Turns one choice's sampled ids into OpenAI chat deltas; stop strings cut the content."""

    def __init__(self, codec: HarmonyCodec, stops: list[str]) -> None:
        self._parser = codec.stream_parser()
        self._stops = StopStringMatcher(stops)
        self._tools_started: set[int] = set()
        self.content: list[str] = []
        self.completion_tokens = 0
        self.logprobs: list = []  # pdserve_pb2.TokenLogprob of each consumed token, when asked

    @property
    def stopped(self) -> bool:
        """A stop string was hit: the choice is over, whatever the model does next."""
        return self._stops.stopped

    def feed(self, token_ids: list[int], logprobs: list = ()) -> list[dict]:
        deltas: list[dict] = []
        for i, token_id in enumerate(token_ids):
            if self.stopped:
                break
            self.completion_tokens += 1
            if i < len(logprobs):
                self.logprobs.append(logprobs[i])
            deltas.extend(self._convert(self._parser.feed(token_id)))
        return _coalesce(deltas)

    def finish(self) -> tuple[list[dict], Any]:
        """Remaining deltas and the parsed completion (content cut at a stop string)."""
        deltas = [] if self.stopped else self._convert(self._parser.flush())
        tail = self._stops.flush()
        if tail:
            self.content.append(tail)
            deltas.append({"content": tail})
        return _coalesce(deltas), self._parser.finish()

    def _convert(self, harmony_deltas: list[Delta]) -> list[dict]:
        out = []
        for delta in harmony_deltas:
            if delta.kind == "content":
                text = self._stops.feed(delta.text)
                if text:
                    self.content.append(text)
                    out.append({"content": text})
                if self.stopped:
                    break
            elif delta.kind == "reasoning":
                if delta.text:
                    out.append({"reasoning_content": delta.text})
            elif delta.kind == "tool_call":
                if delta.tool_index not in self._tools_started:
                    self._tools_started.add(delta.tool_index)
                    call = {"index": delta.tool_index, "id": delta.tool_id, "type": "function",
                            "function": {"name": delta.tool_name, "arguments": delta.text}}
                elif delta.text:
                    call = {"index": delta.tool_index, "function": {"arguments": delta.text}}
                else:
                    continue
                out.append({"tool_calls": [call]})
        return out


def _coalesce(deltas: list[dict]) -> list[dict]:
    """Merge neighbouring deltas of one kind (one SSE event per kind per decode chunk, not per id)."""
    out: list[dict] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and last.keys() == delta.keys() and len(delta) == 1:
            key = next(iter(delta))
            if key in ("content", "reasoning_content"):
                out[-1] = {key: last[key] + delta[key]}
                continue
            previous, call = last["tool_calls"][0], delta["tool_calls"][0]
            if previous["index"] == call["index"] and call.keys() == {"index", "function"}:
                merged = {**previous, "function": {
                    **previous["function"],
                    "arguments": previous["function"]["arguments"] + call["function"]["arguments"]}}
                out[-1] = {"tool_calls": [merged]}
                continue
        out.append(delta)
    return out


class TextOutput:
    """Turns one choice's sampled ids into completion text; stop strings cut it."""

    def __init__(self, codec: HarmonyCodec, stops: list[str]) -> None:
        self._detok = IncrementalDetokenizer(codec.decode_bytes)
        self._stops = StopStringMatcher(stops)
        self._first_special_id = codec.first_special_id
        self._held: list[int] = []
        self._held_logprobs: list = []
        self.text: list[str] = []
        self.completion_tokens = 0
        self.logprobs: list = []  # pdserve_pb2.TokenLogprob of each token of the text, when asked

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def feed(self, event: TokenEvent) -> str:
        if self.stopped:
            return ""
        self.completion_tokens += len(event.token_ids)
        ids = self._held + event.token_ids
        logprobs = self._held_logprobs + list(event.logprobs)
        self._held, self._held_logprobs = [], []
        if event.finish_reason == FINISH_STOP and ids:
            ids = ids[:-1]  # the stop token ends the text; it is not part of it
            logprobs = logprobs[:len(ids)]
        elif not event.finish_reason and ids and ids[-1] >= self._first_special_id:
            # a special token may be the stop token, which the worker confirms only in the next
            # chunk (e.g. the first token, from prefill): hold it until then
            self._held = [ids.pop()]
            self._held_logprobs = logprobs[len(ids):]
            logprobs = logprobs[:len(ids)]
        self.logprobs.extend(logprobs)
        piece = self._stops.feed(self._detok.push(ids))
        if event.finish_reason and not self.stopped:
            piece += self._stops.feed(self._detok.flush())
            piece += self._stops.flush()
        if piece:
            self.text.append(piece)
        return piece


def _choice_streams(generation: Generation, events: AsyncIterator[TokenEvent], first: TokenEvent | None
                    ) -> list[tuple[AsyncIterator[TokenEvent], TokenEvent | None]]:
    """(events, first event) per choice of a started generation: its own stream when it has one
    choice, else per-choice streams split from it (each then starts with its own first event)."""
    if generation.num_choices == 1:
        return [(events, first)]
    splitter = ChoiceSplitter(first, events, generation.num_choices)
    return [(splitter.stream(i), None) for i in range(generation.num_choices)]


class _ReadAhead:
    """A generation's events, read on into a buffer from the first `__anext__` whether or not the
    caller reads them yet. The prompts of one request all start before its response does; those
    placed first must meanwhile run to their end and free their batch slot and KV blocks, which
    the others may be waiting for (a request of more prompts than the decode workers take at once
    would otherwise wait on itself until the admission queue refused it)."""

    _END = object()

    def __init__(self, events: AsyncIterator[TokenEvent]) -> None:
        self._events = events
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pump: asyncio.Task | None = None

    def __aiter__(self) -> "_ReadAhead":
        return self

    async def __anext__(self) -> TokenEvent:
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._read())
        item = await self._queue.get()
        if item is self._END or isinstance(item, BaseException):
            self._queue.put_nowait(item)  # the end stays the end
            if item is self._END:
                raise StopAsyncIteration
            raise item
        return item

    async def _read(self) -> None:
        try:
            async for event in self._events:
                self._queue.put_nowait(event)
            end: object = self._END
        except BaseException as error:  # noqa: BLE001 - handed to the reader
            end = error
        self._queue.put_nowait(end)

    async def aclose(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        await self._events.aclose()


@dataclasses.dataclass(frozen=True)
class _TextChoice:
    """What one completion choice shows besides its generated text."""

    echo_text: str | None  # the prompt, shown first (echo)
    prompt_ids: list[int]
    logprobs_top: int | None  # legacy `logprobs`: alternatives per token; None = no logprobs
    prompt_only: bool  # max_tokens 0: the one sampled token is dropped


# ---- the app ----------------------------------------------------------------------------------
class OpenAIFrontend:
    """Route handlers; one instance per router."""

    def __init__(self, config: RouterConfig, orchestrator: Orchestrator, registry: WorkerRegistry,
                 codec: HarmonyCodec, metrics: RouterMetrics) -> None:
        self.config = config
        self.orchestrator = orchestrator
        self.registry = registry
        self.codec = codec
        self.metrics = metrics
        self.logprob_format = LogprobFormatter(codec)

    # ---- shared ----------------------------------------------------------------------------
    async def read_body(self, request: Request) -> Any:
        """The JSON body, bounded before any tokenizing (413/400 past the limits)."""
        body = await read_json_body(request, self.config.max_request_bytes)
        check_strings(body, self.config.max_text_chars)
        return body

    def _check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise ModelNotFoundError(model, self.config.served_model_name)

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, max_new_tokens: int, *,
                  logprobs: int | None = None, prompt_logprobs: int | None = None,
                  grammar: str = "") -> pdserve_pb2.SamplingParams:
        """The workers' sampling parameters. `ignore_eos` drops Harmony's end-of-turn ids too (so
        exactly max_tokens come back); explicit `stop_token_ids` always stop."""
        vocab = self.codec.vocab_size
        for param, ids in (("logit_bias", body.token_bias), ("stop_token_ids", body.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{param} names token id {bad[0]}, outside the vocabulary "
                                          f"[0, {vocab})", param=param)
        if grammar and (body.ignore_eos or body.min_tokens):
            param = "ignore_eos" if body.ignore_eos else "min_tokens"
            raise InvalidRequestError(f"{param} cannot be combined with a structured output (response_format, "
                                      "text.format or a forced tool call), which ends the turn itself", param=param)
        if body.min_tokens > max_new_tokens:
            raise InvalidRequestError(f"min_tokens ({body.min_tokens}) exceeds the {max_new_tokens} "
                                      "tokens this request may generate", param="min_tokens")
        stops = [] if body.ignore_eos else self.codec.stop_token_ids()
        sampling = pdserve_pb2.SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            max_new_tokens=max_new_tokens, stop_token_ids=sorted(set(stops) | set(body.stop_token_ids or [])),
            ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, logit_bias=body.token_bias,
            min_tokens=body.min_tokens, n=body.n, grammar=grammar)
        if body.seed is not None:
            sampling.seed = body.seed
        if logprobs is not None:
            sampling.logprobs = logprobs
        if prompt_logprobs is not None:
            sampling.prompt_logprobs = prompt_logprobs
        return sampling

    async def _run(self, endpoint: str, handler: Callable[[Request, float], Any],
                   request: Request) -> Response:
        """Common frame: errors -> OpenAI bodies (`RequestAccounting` counts every response)."""
        arrival = asyncio.get_running_loop().time()
        try:
            return await handler(request, arrival)
        except RouterError as error:
            if error.http_status >= 500:
                log.warning("%s failed: %s", endpoint, error.message)
            return error_response(error)

    async def _start(self, generations: list[Generation], watcher: asyncio.Task
                     ) -> list[tuple[AsyncIterator[TokenEvent], TokenEvent | None]]:
        """Run every generation up to its first token; on an error cancel all and re-raise.

        A None first event means the client left before it came. Several generations (the
        prompts of one completions request) read on from their first token (`_ReadAhead`).
        """
        streams = [gen.events() for gen in generations]
        if len(streams) > 1:
            streams = [_ReadAhead(s) for s in streams]

        async def first(stream: AsyncIterator[TokenEvent]) -> TokenEvent | None:
            return await anext(stream, None)

        results = await asyncio.gather(*(first(s) for s in streams), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            watcher.cancel()
            for gen, stream in zip(generations, streams):
                gen.cancel("another part of the request failed")
                await stream.aclose()
            raise failure
        return list(zip(streams, results))

    # ---- chat ------------------------------------------------------------------------------
    async def chat_completions(self, request: Request, arrival: float) -> Response:
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await self.read_body(request))
        self._check_model(body.model)
        tool_choice = body.tool_choice
        if isinstance(tool_choice, NamedToolChoice):
            tool_choice = tool_choice.model_dump()
        try:  # tokenizing a long conversation takes a while: keep the event loop free
            prompt = await asyncio.to_thread(
                self.codec.render_chat, [m.model_dump(exclude_none=True) for m in body.messages],
                tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                tool_choice=tool_choice, reasoning_effort=body.reasoning_effort)
        except HarmonyError as error:
            raise InvalidRequestError(str(error), param=error.param) from None
        grammar = structured_output.grammar(
            body.response_format, tools=[t.model_dump() for t in body.tools or []], tool_choice=tool_choice)
        max_new = self.orchestrator.admit(len(prompt), body.requested_max_tokens, param="messages",
                                          n=body.n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        top = (body.top_logprobs or 0) if body.logprobs else None
        generation = self.orchestrator.generate(
            request_id, prompt, self._sampling(body, max_new, logprobs=top, grammar=grammar), arrival=arrival)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, [generation]))
        [(events, first)] = await self._start([generation], watcher)
        choices = _choice_streams(generation, events, first)
        outputs = [ChatOutput(self.codec, body.stop) for _ in choices]
        meta = {"id": request_id, "created": int(time.time()), "model": body.model}
        if body.stream:
            async def unstarted() -> None:
                await self._end_stream(watcher, [generation], events)

            return _event_stream(self._chat_stream(choices, events, generation, outputs, meta, len(prompt),
                                                   body.include_usage, watcher, outcome_of(request.scope),
                                                   logprobs_top=top, continuous_usage=body.continuous_usage),
                                 unstarted)
        try:
            finishes = await asyncio.gather(*(self._chat_collect(stream, first_event, generation, output)
                                               for (stream, first_event), output in zip(choices, outputs)))
        except RouterError:
            generation.cancel("another choice failed")
            raise
        finally:
            watcher.cancel()
            await events.aclose()
        if any(finish is None for finish in finishes):
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse({
            **meta, "object": "chat.completion",
            "choices": [self._chat_choice(i, output, finish, top)
                        for i, (output, finish) in enumerate(zip(outputs, finishes))],
            "usage": _usage(len(prompt), sum(o.completion_tokens for o in outputs),
                            generation.cached_tokens)})

    def _chat_choice(self, index: int, output: ChatOutput, finish: int, top: int | None) -> dict:
        """One finished choice of a non-streamed chat completion."""
        _, parsed = output.finish()
        content = "".join(output.content) if output.stopped else parsed.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls and not output.stopped:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls]
            message["content"] = content or None
        finish_reason = self._chat_finish_reason(finish, output, bool(message.get("tool_calls")))
        return {"index": index, "message": message,
                "logprobs": self.logprob_format.chat(output.logprobs, top) if top is not None else None,
                "finish_reason": finish_reason}

    @staticmethod
    def _chat_finish_reason(finish: int, output: ChatOutput, has_tool_calls: bool) -> str:
        if output.stopped:
            return "stop"
        if finish == FINISH_STOP and has_tool_calls:
            return "tool_calls"
        return _finish_name(finish)

    async def _chat_collect(self, events, first, generation, output) -> int | None:
        """Consume one choice's stream; the decode finish reason, or None if the client left."""
        event = first if first is not None else await anext(events, None)
        while event is not None:
            output.feed(event.token_ids, event.logprobs)
            if output.stopped:
                if generation.num_choices == 1:  # other choices of the request run on
                    generation.cancel("stop string")
                return FINISH_STOP
            if event.finish_reason:
                return event.finish_reason
            event = await anext(events, None)
        return None

    async def _chat_stream(self, choices, events, generation, outputs: list[ChatOutput], meta: dict,
                           prompt_tokens: int, include_usage: bool, watcher: asyncio.Task,
                           outcome: Outcome, *, logprobs_top: int | None = None,
                           continuous_usage: bool = False) -> AsyncIterator[str]:
        """The chunks of every choice as they come. `logprobs_top`: logprobs were asked (with that
        many alternatives); each event's ride on its last delta (or an empty one).
        `continuous_usage`: every chunk carries the usage so far."""
        endpoint = "chat_completions"
        outcome.status = CLIENT_CLOSED  # until the end is sent

        def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> str:
            usage = {}
            if continuous_usage:
                usage = {"usage": _usage(prompt_tokens, sum(o.completion_tokens for o in outputs),
                                         generation.cached_tokens)}
            elif include_usage:
                usage = {"usage": None}
            formatted = self.logprob_format.chat(logprobs, logprobs_top) if logprobs else None
            return sse({**meta, "object": "chat.completion.chunk",
                         "choices": [{"index": index, "delta": delta, "logprobs": formatted,
                                      "finish_reason": finish_reason}], **usage})
        try:
            done = 0
            async for item in _merge([self._chat_choice_chunks(i, stream, first, generation, output, chunk)
                                      for i, ((stream, first), output) in enumerate(zip(choices, outputs))]):
                if item is None:
                    done += 1
                else:
                    yield item
            if done < len(choices):
                return  # the client is gone
            if include_usage:
                yield sse({**meta, "object": "chat.completion.chunk", "choices": [],
                            "usage": _usage(prompt_tokens, sum(o.completion_tokens for o in outputs),
                                            generation.cached_tokens)})
            yield _SSE_DONE
            outcome.status = 200
        except RouterError as error:
            log.warning("%s stream %s failed: %s", endpoint, meta["id"], error.message)
            outcome.status = error.http_status
            yield sse(error.to_openai())
            yield _SSE_DONE
        finally:
            await self._end_stream(watcher, [generation], events)

    async def _chat_choice_chunks(self, index: int, events, first, generation, output: ChatOutput,
                                  chunk: Callable[..., str]) -> AsyncIterator[str | None]:
        """One choice's SSE chunks; a last None says it finished (rather than the client leaving)."""
        yield chunk(index, {"role": "assistant", "content": ""})
        event = first if first is not None else await anext(events, None)
        finish = None
        tool_calls = False
        while event is not None:
            consumed = len(output.logprobs)
            deltas = output.feed(event.token_ids, event.logprobs)
            new_logprobs = output.logprobs[consumed:]
            if new_logprobs and not deltas:
                deltas = [{}]
            for i, delta in enumerate(deltas):
                tool_calls = tool_calls or "tool_calls" in delta
                yield chunk(index, delta, logprobs=new_logprobs if i == len(deltas) - 1 else None)
            if output.stopped:
                if generation.num_choices == 1:  # other choices of the request run on
                    generation.cancel("stop string")
                finish = FINISH_STOP
                break
            if event.finish_reason:
                finish = event.finish_reason
                break
            event = await anext(events, None)
        if finish is None:
            return  # the client is gone
        deltas, parsed = output.finish()
        for delta in deltas:
            yield chunk(index, delta)
        tool_calls = tool_calls or bool(parsed.tool_calls)
        yield chunk(index, {}, self._chat_finish_reason(finish, output, tool_calls))
        yield None

    @staticmethod
    async def _end_stream(watcher: asyncio.Task, generations: list[Generation],
                          events: AsyncIterator | None = None) -> None:
        """Once per streamed request: stop watching and cancel what still runs on the workers
        (a no-op after a normal finish)."""
        watcher.cancel()
        for generation in generations:
            generation.cancel("stream closed")
        if events is not None:
            with contextlib.suppress(BaseException):
                await events.aclose()

    # ---- completions -----------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int], index: int) -> list[int]:
        param = "prompt"
        if isinstance(prompt, str):
            try:
                return self.codec.encode(prompt)
            except HarmonyError as error:
                raise InvalidRequestError(str(error), param=param) from None
        bad = [t for t in prompt if not 0 <= t < self.codec.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt[{index}] has token ids outside [0, {self.codec.vocab_size}): {bad[:5]}",
                param=param)
        return prompt

    async def completions(self, request: Request, arrival: float) -> Response:
        body: CompletionRequest = parse_body(CompletionRequest, await self.read_body(request))
        self._check_model(body.model)
        items = body.prompts()
        prompts = await asyncio.to_thread(lambda: [self._prompt_ids(p, i) for i, p in enumerate(items)])
        # max_tokens 0 (with echo: scoring a prompt) still samples one token, which is dropped
        prompt_only = body.requested_max_tokens == 0
        max_news = [self.orchestrator.admit(len(p), 1 if prompt_only else body.requested_max_tokens,
                                            param="prompt", n=body.n) for p in prompts]
        k = body.logprobs
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generations = [
            self.orchestrator.generate(
                request_id if len(prompts) == 1 else f"{request_id}-{i}", p,
                self._sampling(body, max_new, logprobs=k, prompt_logprobs=k if body.echo else None),
                arrival=arrival)
            for i, (p, max_new) in enumerate(zip(prompts, max_news))]
        watcher = asyncio.create_task(_cancel_on_disconnect(request, generations))
        started = await self._start(generations, watcher)
        meta = {"id": request_id, "created": int(time.time()), "model": body.model}
        prompt_tokens = sum(len(p) for p in prompts)
        # choice index = prompt index * n + choice of that prompt, as OpenAI numbers them
        choices, outputs = [], []
        for item, ids, (events, first), gen in zip(items, prompts, started, generations):
            echo_text = (item if isinstance(item, str) else self.codec.decode(ids)) if body.echo else None
            show = _TextChoice(echo_text, ids, k, prompt_only)
            for stream, first_event in _choice_streams(gen, events, first):
                outputs.append(TextOutput(self.codec, body.stop))
                choices.append(self._completion_choice(len(choices), stream, first_event, gen, outputs[-1], show))
        if body.stream:
            async def unstarted() -> None:
                await self._end_stream(watcher, generations)

            return _event_stream(self._completion_stream(choices, generations, outputs, meta, prompt_tokens,
                                                         body.include_usage, watcher, outcome_of(request.scope),
                                                         continuous_usage=body.continuous_usage), unstarted)
        finishes: list[str | None] = [None] * len(choices)
        texts: list[list[str]] = [[] for _ in choices]
        logprobs: list[list[dict]] = [[] for _ in choices]

        async def drain(index: int, choice: AsyncIterator[tuple[int, str, str | None, dict | None]]) -> None:
            async for _, text, finish, piece in choice:
                texts[index].append(text)
                if piece:
                    logprobs[index].append(piece)
                if finish:
                    finishes[index] = finish
        try:
            await asyncio.gather(*(drain(i, c) for i, c in enumerate(choices)))
        except RouterError:
            for gen in generations:
                gen.cancel("another part of the request failed")
            raise
        finally:
            watcher.cancel()
        if any(f is None for f in finishes):
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse({
            **meta, "object": "text_completion",
            "choices": [{"index": i, "text": "".join(texts[i]),
                         "logprobs": merge_completion_logprobs(logprobs[i]) if k is not None else None,
                         "finish_reason": finishes[i]} for i in range(len(choices))],
            "usage": _usage(prompt_tokens, sum(0 if prompt_only else o.completion_tokens for o in outputs),
                            sum(g.cached_tokens for g in generations))})

    async def _completion_choice(self, index: int, events: AsyncIterator[TokenEvent],
                                 first: TokenEvent | None, generation: Generation,
                                 output: TextOutput, show: "_TextChoice"
                                 ) -> AsyncIterator[tuple[int, str, str | None, dict | None]]:
        """(index, new text, finish reason or None, legacy logprobs of that text or None) per
        decode event of one prompt; with echo the prompt (and its logprobs) comes first."""
        fmt = self.logprob_format
        offset = 0
        try:
            if first is None:
                first = await anext(events, None)
            if show.echo_text is not None and first is not None:
                piece = None
                if show.logprobs_top is not None:
                    piece = fmt.completion(generation.prompt_logprobs, show.logprobs_top,
                                           prompt_first_token=show.prompt_ids[0])
                    offset = sum(len(t) for t in piece["tokens"])
                yield index, show.echo_text, None, piece
            event = first
            while event is not None:
                consumed = len(output.logprobs)
                text = output.feed(event)
                piece = None
                if show.prompt_only:
                    text = ""
                elif show.logprobs_top is not None:
                    piece = fmt.completion(output.logprobs[consumed:], show.logprobs_top, offset=offset)
                    offset += sum(len(t) for t in piece["tokens"])
                if output.stopped:
                    if generation.num_choices == 1:  # other choices of the request run on
                        generation.cancel("stop string")
                    yield index, text, "stop", piece
                    return
                finish = _finish_name(event.finish_reason) if event.finish_reason else None
                if show.prompt_only and finish:
                    finish = "length"
                yield index, text, finish, piece
                if finish:
                    return
                event = await anext(events, None)
        finally:
            with contextlib.suppress(BaseException):
                await events.aclose()

    async def _completion_stream(self, choices, generations, outputs, meta, prompt_tokens,
                                 include_usage, watcher, outcome: Outcome, *,
                                 continuous_usage: bool = False) -> AsyncIterator[str]:
        endpoint = "completions"
        outcome.status = CLIENT_CLOSED  # until the end is sent
        done = 0

        def usage() -> dict:
            return _usage(prompt_tokens, sum(o.completion_tokens for o in outputs),
                          sum(g.cached_tokens for g in generations))
        try:
            async for index, text, finish, piece in _merge(choices):
                if not text and not finish and not (piece and piece["tokens"]):
                    continue
                usage_field = {"usage": usage()} if continuous_usage else {"usage": None} if include_usage else {}
                yield sse({**meta, "object": "text_completion", **usage_field,
                            "choices": [{"index": index, "text": text, "logprobs": piece,
                                         "finish_reason": finish}]})
                done += finish is not None
            if done < len(choices):
                return  # the client is gone
            if include_usage:
                yield sse({**meta, "object": "text_completion", "choices": [], "usage": usage()})
            yield _SSE_DONE
            outcome.status = 200
        except RouterError as error:
            log.warning("%s stream %s failed: %s", endpoint, meta["id"], error.message)
            outcome.status = error.http_status
            yield sse(error.to_openai())
            yield _SSE_DONE
        finally:
            await self._end_stream(watcher, generations)

    # ---- misc ------------------------------------------------------------------------------
    def models(self) -> dict:
        model = {"id": self.config.served_model_name, "object": "model", "created": 0,
                 "owned_by": "pdserve"}
        max_context = self.registry.max_context()
        if max_context:
            model["max_model_len"] = max_context
        return {"object": "list", "data": [model]}

    def health(self) -> JSONResponse:
        counts = {role: {"routable": len(self.registry.routable(role)),
                         "known": len(self.registry.workers(role))}
                  for role in ("prefill", "decode")}
        if self.registry.ready():
            return JSONResponse({"status": "ok", "workers": counts})
        return JSONResponse({"status": "unavailable", "workers": counts}, status_code=503,
                            headers={"Retry-After": str(self.config.unavailable_retry_after)})


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come; the first error cancels the rest."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(end)
        except BaseException as error:  # handed to the consumer, which re-raises it
            await queue.put(error)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI usage; cached_tokens: prompt tokens whose KV a prefill worker had cached."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def create_app(frontend: OpenAIFrontend) -> FastAPI:
    """The FastAPI app around `frontend`; OpenAI error bodies for every failure."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await frontend._run("chat_completions", frontend.chat_completions, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await frontend._run("completions", frontend.completions, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return frontend.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != frontend.config.served_model_name:
            return error_response(ModelNotFoundError(model, frontend.config.served_model_name))
        return JSONResponse(frontend.models()["data"][0])

    @app.get("/health")
    async def health() -> Response:
        return frontend.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=frontend.metrics.content_type)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None,
                                       "code": None}}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(InvalidRequestError(f"Invalid request: {exc.errors()[:3]}"))

    app.add_middleware(RequestAccounting, metrics=frontend.metrics)
    return app
