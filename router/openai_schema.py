"""Pydantic models of the OpenAI request bodies the router accepts, and their error mapping.

Structure and ranges are checked here (400 with the offending `param`); the Harmony codec checks
what only it knows (roles in context, tool-call history, tool names) when it renders.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import jsonschema
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from pdserve.router.errors import InvalidRequestError

_MAX_STOP_STRINGS = 4  # OpenAI's limit


# Strict: `max_tokens: true` or `stream: "yes"` are type errors (400), not coerced to 1 / True.
_STRICT = ConfigDict(extra="ignore", strict=True)


def absent_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == n for n in neutral)


# Fields of the OpenAI API (and the vLLM extensions clients send) that would change the output
# and that this server does not honour (yet): a request that sets one to anything but its neutral
# value gets a 400 naming it, never a silently different answer. Implementing one = removing it
# here and declaring it on the model.
NOT_HONOURED: dict[str, Callable[[Any], bool]] = {
    "prediction": absent_or(),
    "audio": absent_or(),
    "modalities": absent_or(["text"]),
    "functions": absent_or([]),
    "function_call": absent_or("none", "auto"),
    "min_p": absent_or(0),
    "repetition_penalty": absent_or(1),
    "guided_json": absent_or(),
    "guided_regex": absent_or(),
    "guided_choice": absent_or(),
    "guided_grammar": absent_or(),
    "structured_outputs": absent_or(),
    "verbosity": absent_or(),
    "web_search_options": absent_or(),
}


# chat's structured output field; completions have none, the Responses API says `text.format`
CHAT_ONLY: dict[str, Callable[[Any], bool]] = {"response_format": absent_or({"type": "text"})}


def refuse_not_honoured(data: Any, fields: dict[str, Callable[[Any], bool]], *,
                        prefix: str = "") -> Any:
    """Raise (400, naming the field) if `data` sets one of `fields` to a non-neutral value;
    `prefix` is the path of `data` in the request (`text.`)."""
    if isinstance(data, dict):
        for name, neutral in fields.items():
            if name in data and not neutral(data[name]):
                raise InvalidRequestError(
                    f"{prefix}{name} is not supported by this server; remove it or send its "
                    "default", param=prefix + name, code="unsupported_parameter")
    return data


class _Body(BaseModel):
    # Unknown fields (user, metadata, service_tier, ...) are accepted and ignored, as most
    # OpenAI-compatible servers do; anything we cannot honour but would change the output is refused.
    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """A top-level null is the field's default, as OpenAI's API declares its fields nullable
        (`"temperature": null`); a required field stays missing."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(BaseModel):
    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        if self.role == "assistant":
            if self.content is None and not self.tool_calls and not self.reasoning_content:
                raise ValueError("an assistant message needs content, reasoning_content or tool_calls")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        if schema.get("type", "object") != "object":
            raise ValueError(f'parameters must be a JSON schema of "type": "object", not '
                             f'{schema.get("type")!r}')
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as error:
            where = "/".join(str(p) for p in error.path) or "(top level)"
            raise ValueError(f"parameters is not a valid JSON schema at {where}: "
                             f"{error.message}") from None
        return schema


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): usage in every chunk


_MAX_LOGIT_BIAS_ENTRIES = 1024
_INT32_MAX = 2 ** 31 - 1  # the workers' SamplingParams hold top_k as an int32
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 64


class SamplingControls(_Body):
    """How tokens are drawn: shared by chat, completions and responses."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=_INT32_MAX)  # extension (vLLM-style); 0 = off
    seed: int | None = Field(default=None, ge=0, lt=2 ** 64)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # extensions benchmark clients send (vLLM-style)
    ignore_eos: bool = False  # do not stop at the model's end-of-turn tokens
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_honoured(cls, data: Any) -> Any:
        return refuse_not_honoured(data, NOT_HONOURED)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if not bias:
            return bias
        if len(bias) > _MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {_MAX_LOGIT_BIAS_ENTRIES} logit_bias entries are allowed")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for {key}")
        return bias

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class _Sampling(SamplingControls):
    """Fields shared by chat and completions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices decoded from one prefill

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > _MAX_STOP_STRINGS:
            raise ValueError(f"at most {_MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Sampling":
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("The 'stream_options' parameter is only allowed when 'stream' "
                                      "is enabled.", param="stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None  # structured output (router/structured_output.py)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice, info: ValidationInfo):
        tools = info.data.get("tools") or []  # validated before: declared earlier
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in tools}:
                raise ValueError(f"tool_choice names function {choice.function.name!r}, "
                                 "which is not in tools")
        if choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return choice

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    echo: bool = False  # the prompt precedes the completion (with its logprobs when logprobs is set)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_only(cls, data: Any) -> Any:
        return refuse_not_honoured(data, CHAT_ONLY)

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens 0 is only meaningful with echo (scoring the prompt)",
                                      param="max_tokens")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, 1):
            raise ValueError("best_of > 1 is not supported by this server")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; a `ValidationError` becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _to_invalid_request(error) from None


def _to_invalid_request(error: ValidationError) -> InvalidRequestError:
    details = error.errors(include_url=False)
    first = details[0]
    # a union reports one error per alternative; the field is what they share
    param = ".".join(str(p) for p in first["loc"] if not _is_union_branch(p)) or None
    messages = []
    # the alternative that got furthest says most (`input.0: tag 'x' ...`, not `input: not a string`)
    for d in sorted(details, key=lambda d: -len(d["loc"]))[:3]:
        loc = ".".join(str(p) for p in d["loc"] if not _is_union_branch(p))
        msg = d["msg"].removeprefix("Value error, ")
        messages.append(f"{loc}: {msg}" if loc else msg)
    more = f" (and {len(details) - 3} more)" if len(details) > 3 else ""
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    return InvalidRequestError("Invalid request: " + "; ".join(messages) + more, param=param,
                               code=code)


def _is_union_branch(part: Any) -> bool:
    """pydantic names union alternatives in `loc` (`str`, `list[int]`, `function-after[...]`)."""
    return isinstance(part, str) and ("[" in part or part[:1].isupper()
                                      or part in {"str", "int", "float", "bool"})
