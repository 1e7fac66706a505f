"""OpenAI Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`).

gpt-oss was trained around this API (OpenAI's reference package serves it). A request's input
items become the chat messages the Harmony codec already renders: messages, reasoning items
(analysis), `function_call` items (assistant tool calls) and `function_call_output` items (tool
results); `instructions` open the developer message. The sampled ids go through Harmony's
streaming parser; each run of one kind (reasoning, answer text, one tool call) becomes one output
item, streamed with the Responses event types (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta` ... `response.completed`).

Stateless by default: only a request with `store: true` is kept, in memory, bounded in count and
age (`ResponseStore`); `previous_response_id` continues from a kept response (its input and
output items come before the new input; its instructions do not carry over, as in OpenAI's API).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Callable, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from pdserve.router.errors import InvalidRequestError, NotFoundError, RouterError
from pdserve.router.harmony import Delta, HarmonyError
from pdserve.router.accounting import CLIENT_CLOSED, Outcome, outcome_of
from pdserve.router.openai_api import _cancel_on_disconnect, _event_stream, error_response, sse
from pdserve.router.openai_schema import NOT_HONOURED as CHAT_NOT_HONOURED
from pdserve.router import structured_output
from pdserve.router.openai_schema import CHAT_ONLY
from pdserve.router.openai_schema import (FunctionDefinition, SamplingControls, absent_or,
                                          parse_body, refuse_not_honoured)
from pdserve.router.orchestrator import FINISH_LENGTH, Generation, TokenEvent

log = logging.getLogger(__name__)

ENDPOINT = "responses"
_STRICT = ConfigDict(extra="ignore", strict=True)

# Fields that would change the output and are not honoured: 400 naming them (see openai_schema).
NOT_HONOURED: dict[str, Callable[[Any], bool]] = {
    **CHAT_NOT_HONOURED, **CHAT_ONLY,
    "stop": absent_or([]),  # not part of this API; benchmark clients send null
    "max_tokens": absent_or(),  # this API's budget is max_output_tokens
    "n": absent_or(1),  # one output per response
    "background": absent_or(False),
    "conversation": absent_or(),
    "prompt": absent_or(),
    "top_logprobs": absent_or(0),
    "max_tool_calls": absent_or(),
    "include": absent_or([]),
    "truncation": absent_or("disabled"),
}


# ---- request ----------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text", "text"]
    text: str


class ReasoningPart(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning_text", "summary_text"]
    text: str


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class ReasoningItem(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None
    summary: list[ReasoningPart] = []
    encrypted_content: None = None  # this server never hands out encrypted reasoning

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)  # the codec checks it when rendering
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(
            p.text for p in self.output)


def _item_type(value: Any) -> str | None:
    """Messages may omit `type` (the "easy input message" form)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("message")], Annotated[ReasoningItem, Tag("reasoning")],
    Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")],
], Discriminator(_item_type, custom_error_type="invalid_item_type", custom_error_message=(
    "this item type is not supported here (message, reasoning, function_call and "
    "function_call_output are)"))]
_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(FunctionDefinition):
    """The Responses form of a function tool: the definition's fields beside `type`."""

    type: Literal["function"]


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class Reasoning(BaseModel):
    model_config = _STRICT
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # full reasoning is returned


class TextFormat(BaseModel):
    """text, json_object, or json_schema with name/schema/strict beside the type (structured output)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: None = None  # gpt-oss has no such control

    @model_validator(mode="before")
    @classmethod
    def _no_verbosity(cls, data: Any) -> Any:
        return refuse_not_honoured(data, {"verbosity": absent_or()}, prefix="text.")


class ResponsesRequest(SamplingControls):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    reasoning: Reasoning | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    store: bool = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_honoured(cls, data: Any) -> Any:
        tools = data.get("tools") if isinstance(data, dict) else None
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise InvalidRequestError(f"tools[{i}]: tools of type {kind!r} are not supported "
                                          "by this server (function tools only)",
                                          param=f"tools.{i}.type", code="unsupported_parameter")
        return refuse_not_honoured(data, NOT_HONOURED)

    @property
    def n(self) -> int:
        """One output per response (this API has no `n`)."""
        return 1

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ResponsesRequest":
        names = {t.name for t in self.tools or []}
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in names:
            raise InvalidRequestError(f"tool_choice names function {self.tool_choice.name!r}, "
                                      "which is not in tools", param="tool_choice")
        if self.tool_choice == "required" and not names:
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return self


def to_chat_messages(instructions: str | None, items: list[Any]) -> list[dict]:
    """Input items as the chat messages `HarmonyCodec.render_chat` takes.

    Reasoning, assistant text and function calls that follow each other form one assistant turn
    (analysis, then text, then tool calls), as Harmony renders them.
    """
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict | None = None  # the assistant turn being gathered

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant"}
            messages.append(turn)
        return turn

    for item in items:
        if isinstance(item, MessageItem) and item.role == "assistant":
            if assistant().get("content") or assistant().get("tool_calls"):
                turn = None  # a second answer starts a new turn
            assistant()["content"] = item.text()
        elif isinstance(item, ReasoningItem):
            if turn is not None and (turn.get("content") or turn.get("tool_calls")):
                turn = None
            current = assistant()
            current["reasoning_content"] = current.get("reasoning_content", "") + item.text()
        elif isinstance(item, FunctionCallItem):
            assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            turn = None
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
        else:
            turn = None
            messages.append({"role": item.role, "content": item.text()})
    return messages


# ---- the store --------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: dict  # the response object as returned
    items: list[Any]  # the conversation's input items so far, then this response's output items
    chars: int = 0  # the size the store counts: characters of the items and the response
    created: float = field(default=0.0)


class ResponseStore:
    """Responses kept for `previous_response_id` and GET, in memory, per router process: at most
    `max_entries` holding at most `max_chars` characters in all, each for at most `ttl` seconds;
    the oldest go first. (A conversation's turns share their items; each entry counts them all.)"""

    def __init__(self, max_entries: int, ttl: float, max_chars: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl, self.max_chars, self._clock = max_entries, ttl, max_chars, clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep `stored`; False if it alone is over `max_chars` (then it is not kept)."""
        self._expire()
        if stored.chars > self.max_chars:
            return False
        self.delete(response_id)
        stored.created = self._clock()
        self._entries[response_id] = stored
        self._chars += stored.chars
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            self._drop_oldest()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self._chars -= stored.chars
        return True

    def _drop_oldest(self) -> None:
        _, stored = self._entries.popitem(last=False)
        self._chars -= stored.chars

    def _expire(self) -> None:
        oldest = self._clock() - self.ttl
        while self._entries and next(iter(self._entries.values())).created <= oldest:
            self._drop_oldest()


# ---- output assembly --------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseOutput:
    """Harmony deltas -> output items and the Responses stream events that build them.

    A run of one kind of delta is one item: reasoning (`reasoning_text` content), an assistant
    message (`output_text` content) or one function call. `feed`/`finish` return the events
    (dicts without sequence numbers); `items` holds the finished items.
    """

    def __init__(self, parser) -> None:
        self._parser = parser
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being streamed
        self._text: list[str] = []
        self._tool_index = -1
        self.output_tokens = 0
        self.reasoning_tokens = 0

    def feed(self, token_ids: list[int]) -> list[dict]:
        events: list[dict] = []
        for token_id in token_ids:
            self.output_tokens += 1
            deltas = self._parser.feed(token_id)
            self.reasoning_tokens += any(d.kind == "reasoning" for d in deltas)
            for delta in deltas:
                events.extend(self._on_delta(delta))
        return events

    def finish(self, incomplete: bool) -> list[dict]:
        events = [e for d in self._parser.flush() for e in self._on_delta(d)]
        return events + self._close("incomplete" if incomplete else "completed")

    def _on_delta(self, delta: Delta) -> list[dict]:
        kind = "function_call" if delta.kind == "tool_call" else (
            "reasoning" if delta.kind == "reasoning" else "message")
        events: list[dict] = []
        new_call = kind == "function_call" and delta.tool_index != self._tool_index
        if self._open is None or self._open["type"] != kind or new_call:
            if kind != "function_call" and not delta.text:
                return events
            events += self._close("completed")
            events += self._start(kind, delta)
        item, index = self._open, len(self.items)
        if not delta.text:
            return events
        self._text.append(delta.text)
        if kind == "message":
            events.append({"type": "response.output_text.delta", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "delta": delta.text,
                           "logprobs": []})
        elif kind == "reasoning":
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "delta": delta.text})
        else:
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": index, "delta": delta.text})
        return events

    def _start(self, kind: str, delta: Delta) -> list[dict]:
        index = len(self.items)
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            self._tool_index = delta.tool_index
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": delta.tool_id,
                    "name": delta.tool_name, "arguments": "", "status": "in_progress"}
            part = None
        self._open, self._text = item, []
        events = [{"type": "response.output_item.added", "output_index": index,
                   "item": dict(item)}]
        if part is not None:
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "part": part})
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        text, index = "".join(self._text), len(self.items)
        item["status"] = status
        events: list[dict] = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": text})
        else:
            if item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                events.append({"type": "response.output_text.done", "item_id": item["id"],
                               "output_index": index, "content_index": 0, "text": text,
                               "logprobs": []})
            else:
                part = {"type": "reasoning_text", "text": text}
                events.append({"type": "response.reasoning_text.done", "item_id": item["id"],
                               "output_index": index, "content_index": 0, "text": text})
            item["content"] = [part]
            events.append({"type": "response.content_part.done", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "part": part})
        self.items.append(item)
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": item})
        return events

    def usage(self, input_tokens: int, cached_tokens: int) -> dict:
        return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": input_tokens + self.output_tokens}


# ---- the endpoint -----------------------------------------------------------------------------
class ResponsesAPI:
    """`/v1/responses` on top of the chat front end's orchestrator, codec and request frame."""

    def __init__(self, frontend, store: ResponseStore) -> None:
        self.frontend = frontend
        self.codec = frontend.codec
        self.orchestrator = frontend.orchestrator
        self.store = store

    def register(self, app: FastAPI) -> None:
        @app.post("/v1/responses")
        async def create(request: Request) -> Response:
            return await self.frontend._run(ENDPOINT, self.create, request)

        @app.get("/v1/responses/{response_id}")
        async def retrieve(response_id: str) -> Response:
            stored = self.store.get(response_id)
            if stored is None:
                return _not_found(response_id)
            return JSONResponse(stored.response)

        @app.delete("/v1/responses/{response_id}")
        async def delete(response_id: str) -> Response:
            if not self.store.delete(response_id):
                return _not_found(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: Request, arrival: float) -> Response:
        body: ResponsesRequest = parse_body(ResponsesRequest, await self.frontend.read_body(request))
        self.frontend._check_model(body.model)
        items = self._conversation(body)
        prompt = await asyncio.to_thread(self._render, body, items)
        try:
            max_new = self.orchestrator.admit(len(prompt), body.max_output_tokens, param="input")
        except InvalidRequestError as error:
            if error.param == "max_tokens":
                error.param = "max_output_tokens"
            raise
        response_id = _new_id("resp")
        sampling = self.frontend._sampling(body, max_new, grammar=self._grammar(body))
        generation = self.orchestrator.generate(response_id, prompt, sampling, arrival=arrival)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, [generation]))
        [(events, first)] = await self.frontend._start([generation], watcher)
        run = _Run(self, body, response_id, items, len(prompt), generation, events, first)
        if body.stream:
            async def unstarted() -> None:
                await self.frontend._end_stream(watcher, [generation], events)

            return _event_stream(run.stream(watcher, outcome_of(request.scope)), unstarted)
        try:
            status = await run.collect()
        finally:
            watcher.cancel()
            await events.aclose()
        if status is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(run.finished(status))

    def _conversation(self, body: ResponsesRequest) -> list[Any]:
        """Every input item the prompt holds: the previous response's, then this request's."""
        items: list[Any] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise InvalidRequestError(
                    f"Previous response with id {body.previous_response_id!r} not found (this "
                    "server keeps responses only when stored with store: true, for a limited "
                    "time).", param="previous_response_id", code="previous_response_not_found")
            items = list(previous.items)
        if isinstance(body.input, str):
            items.append(MessageItem(role="user", content=body.input))
        else:
            items.extend(body.input)
        return items

    @staticmethod
    def _chat_tools(body: ResponsesRequest) -> tuple[list[dict], Any]:
        """Tools and tool_choice in the chat shape (what Harmony rendering takes)."""
        tools = [{"type": "function", "function": t.model_dump(exclude_none=True,
                                                               exclude={"type", "strict"})}
                 for t in body.tools or []]
        choice = body.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        return tools, choice

    def _grammar(self, body: ResponsesRequest) -> str:
        tools, choice = self._chat_tools(body)
        fmt = body.text.format.model_dump() if body.text and body.text.format else None
        return structured_output.grammar(fmt, tools=tools, tool_choice=choice, param="text.format")

    def _render(self, body: ResponsesRequest, items: list[Any]) -> list[int]:
        tools, choice = self._chat_tools(body)
        try:
            return self.codec.render_chat(
                to_chat_messages(body.instructions, items), tools=tools or None,
                tool_choice=choice, reasoning_effort=body.reasoning.effort if body.reasoning else None)
        except HarmonyError as error:
            param = "input" if error.param == "messages" else error.param
            raise InvalidRequestError(str(error).replace("messages[", "input["),
                                      param=param) from None


def _not_found(response_id: str) -> JSONResponse:
    return error_response(NotFoundError(f"No response with id {response_id!r} is stored.",
                                        param="response_id", code="response_not_found"))


class _Run:
    """One response being generated: the events of its stream and its final object."""

    def __init__(self, api: ResponsesAPI, body: ResponsesRequest, response_id: str,
                 items: list[Any], input_tokens: int, generation: Generation,
                 events: AsyncIterator[TokenEvent], first: TokenEvent | None) -> None:
        self.api, self.body, self.id, self.items = api, body, response_id, items
        self.input_tokens = input_tokens
        self.generation, self.events, self.first = generation, events, first
        self.output = ResponseOutput(api.codec.stream_parser())
        self.created_at = int(time.time())
        self._sequence = 0

    async def _tokens(self) -> AsyncIterator[tuple[list[dict], int]]:
        """(events, finish reason or 0) per decode event; ends early if the client left."""
        event = self.first
        while event is not None:
            yield self.output.feed(event.token_ids), event.finish_reason
            if event.finish_reason:
                return
            event = await anext(self.events, None)

    async def collect(self) -> str | None:
        """Run to the end; the final status, or None if the client left."""
        async for _, finish in self._tokens():
            if finish:
                incomplete = finish == FINISH_LENGTH
                self.output.finish(incomplete)
                return "incomplete" if incomplete else "completed"
        return None

    async def stream(self, watcher: asyncio.Task, outcome: Outcome) -> AsyncIterator[str]:
        outcome.status = CLIENT_CLOSED  # until the end is sent
        try:
            started = self.response("in_progress")
            yield self._event({"type": "response.created", "response": started})
            yield self._event({"type": "response.in_progress", "response": started})
            async for events, finish in self._tokens():
                for event in events:
                    yield self._event(event)
                if finish:
                    incomplete = finish == FINISH_LENGTH
                    for event in self.output.finish(incomplete):
                        yield self._event(event)
                    status = "incomplete" if incomplete else "completed"
                    yield self._event({"type": f"response.{status}",
                                       "response": self.finished(status)})
                    outcome.status = 200
        except RouterError as error:
            log.warning("responses stream %s failed: %s", self.id, error.message)
            outcome.status = error.http_status
            failed = self.response("failed", error={"code": error.code or error.error_type,
                                                    "message": error.message})
            yield self._event({"type": "response.failed", "response": failed})
        finally:
            await self.api.frontend._end_stream(watcher, [self.generation], self.events)

    def _event(self, event: dict) -> str:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return sse(event, event["type"])

    def finished(self, status: str) -> dict:
        """The final response object, stored when the request asked for it."""
        obj = self.response(status)
        if self.body.store:
            items = self.items + _ITEMS.validate_python(obj["output"])
            chars = sum(len(item.model_dump_json()) for item in items) + len(json.dumps(obj))
            if not self.api.store.put(self.id, StoredResponse(obj, items, chars)):
                log.warning("response %s not stored: %d characters, over the store's %d",
                            self.id, chars, self.api.store.max_chars)
        return obj

    def response(self, status: str, *, error: dict | None = None) -> dict:
        body = self.body
        done = status in ("completed", "incomplete")
        obj = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "model": body.model,
            "output": list(self.output.items) if done else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None},
            "store": body.store, "temperature": body.temperature,
            "text": {"format": body.text.format.model_dump() if body.text and body.text.format
                     else {"type": "text"}},
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
                            else body.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": body.top_p, "truncation": "disabled",
            "usage": self.output.usage(self.input_tokens, self.generation.cached_tokens) if done else None,
            "user": body.user,
        }
        return obj
