"""Bounds on untrusted request input, checked before any costly work (parsing, tokenizing).

A request body is read up to `max_request_bytes` (more: 413), decoded as JSON (bad JSON or
nesting past `MAX_JSON_DEPTH`: 400), and its strings are checked in one pass: no lone UTF-16
surrogates (JSON allows `"\\ud800"`; the tokenizer cannot encode it), at most `max_text_chars`
characters in all, and no run longer than `MAX_RUN_CHARS` that the tokenizer would keep as one
piece. The o200k tokenizer splits text into pieces (letter runs, whitespace runs, punctuation
runs, up-to-3-digit numbers) and merges each piece with a BPE whose cost grows with the square of
the piece's length: 100 KB of "a" takes seconds and megabytes make it panic, while ordinary text
costs about 0.3 us a character. Pieces of up to 2048 characters stay within about twice that.
"""

from __future__ import annotations

import json
from typing import Any

import regex
from starlette.requests import ClientDisconnect, Request

from pdserve.router.errors import InvalidRequestError, PayloadTooLargeError

MAX_JSON_DEPTH = 64  # tool schemas nest a few levels; jsonschema recurses per level
MAX_RUN_CHARS = 2048  # longest text piece the BPE may see (see the module docstring)

# Over-approximates the tokenizer's pieces: letters (with marks), whitespace, punctuation.
_LONG_RUN = regex.compile(
    r"[\p{L}\p{M}]{%d}|\s{%d}|[^\s\p{L}\p{N}]{%d}" % ((MAX_RUN_CHARS + 1,) * 3))
_SURROGATE = regex.compile(r"[\ud800-\udfff]")


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The request body as JSON, refused (413/400) before it costs more than `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise InvalidRequestError("The client closed the connection while sending the body.",
                                  code="client_disconnected") from None
    return parse_json(b"".join(chunks))


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidRequestError(f"The request body is not valid JSON: {error}",
                                  code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None


def check_strings(body: Any, max_text_chars: int) -> None:
    """One walk over the decoded body: nesting depth, lone surrogates, text size, long runs."""
    total = 0
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            if isinstance(value, str):
                total += len(value)
                if total > max_text_chars:
                    raise InvalidRequestError(
                        f"The request holds more than {max_text_chars} characters of text.",
                        param=_root(where), code="context_length_exceeded")
                _check_text(value, where)
            continue
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, where)
            stack.append((item, depth + 1, f"{where}.{key}" if where else str(key)))


def _check_text(text: str, where: str) -> None:
    if _SURROGATE.search(text):
        raise InvalidRequestError(
            f"{where or 'the body'}: the text contains a lone UTF-16 surrogate, which is not a "
            "character (send the pair, or the character itself).", param=_root(where),
            code="invalid_unicode")
    if len(text) > MAX_RUN_CHARS and _LONG_RUN.search(text):
        raise InvalidRequestError(
            f"{where}: the text has a run of more than {MAX_RUN_CHARS} letters, spaces or "
            "punctuation marks without a break, which this server does not tokenize.",
            param=_root(where), code="invalid_value")


def _root(where: str) -> str | None:
    return where.split(".", 1)[0] or None


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"The request body is larger than {max_bytes} bytes.",
                                code="request_too_large")


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.",
                               code="invalid_json")
