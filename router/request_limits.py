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

import functools
import json
import re
import unicodedata
from typing import Any

import numpy as np
from starlette.requests import ClientDisconnect, Request

from pdserve.router.errors import InvalidRequestError, PayloadTooLargeError

MAX_JSON_DEPTH = 64  # tool schemas nest a few levels; jsonschema recurses per level
# A request id a caller may choose (HTTP `X-Request-Id`, the gRPC request_id): short and printable,
# without the '#' and '|' that separate fields of the KV-transfer notifications it ends up in.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
MAX_RUN_CHARS = 2048  # longest text piece the BPE may see (see the module docstring)

# The tokenizer's pieces, over-approximated: runs of letters (with marks), of whitespace, or of
# anything else but digits (digits split into pieces of three). Classes per code point, then the run
# lengths with numpy: linear, a few ms per MB, where a Unicode-class regex costs ~0.3 us a character.
_LETTER, _SPACE, _DIGIT, _OTHER = range(4)


def _class_of(char: str) -> int:
    if char.isspace():
        return _SPACE
    kind = unicodedata.category(char)[0]
    return _LETTER if kind in "LM" else _DIGIT if kind == "N" else _OTHER


@functools.lru_cache(maxsize=1)
def _bmp_classes() -> np.ndarray:
    return np.array([_class_of(chr(cp)) for cp in range(0x10000)], dtype=np.uint8)


def longest_run(text: str) -> int:
    """Length of the longest run of one class (digits excepted) in `text`."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    classes = _bmp_classes()[np.minimum(points, 0xFFFF)]
    astral = points > 0xFFFF
    if astral.any():
        unique, where = np.unique(points[astral], return_inverse=True)
        classes[astral] = np.array([_class_of(chr(p)) for p in unique], dtype=np.uint8)[where]
    starts = np.flatnonzero(np.diff(classes)) + 1
    bounds = np.concatenate(([0], starts, [len(classes)]))
    lengths = np.diff(bounds)
    lengths[classes[bounds[:-1]] == _DIGIT] = 0
    return int(lengths.max(initial=0))


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
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an int past 4300 digits
        raise InvalidRequestError(f"The request body is not valid JSON: {error}",
                                  code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None


def check_strings(body: Any, max_text_chars: int) -> None:
    """One walk over the decoded body: nesting depth, lone surrogates, text size, long runs."""
    if not isinstance(body, (dict, list)):
        if isinstance(body, str):
            _check_text(body, "")
        return  # parse_body refuses a body that is not an object
    total = 0
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str):
                _check_text(key, where)
            if type(item) in (int, float, bool) or item is None:
                continue  # the bulk of a token-id prompt: nothing to check
            path = f"{where}.{key}" if where else str(key)
            if isinstance(item, str):
                total += len(item)
                if total > max_text_chars:
                    raise InvalidRequestError(
                        f"The request holds more than {max_text_chars} characters of text.",
                        param=_root(path), code="context_length_exceeded")
                _check_text(item, path)
            else:
                stack.append((item, depth + 1, path))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # the only str that cannot be encoded holds a lone surrogate
        raise InvalidRequestError(
            f"{where or 'the body'}: the text contains a lone UTF-16 surrogate, which is not a "
            "character (send the pair, or the character itself).", param=_root(where),
            code="invalid_unicode") from None
    if len(text) > MAX_RUN_CHARS and longest_run(text) > MAX_RUN_CHARS:
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
