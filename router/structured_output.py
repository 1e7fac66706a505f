"""Structured outputs: `response_format` / `text.format` and forced tool calls as a grammar over
the tokens of a Harmony assistant turn, which the workers enforce while sampling.

The grammar (llguidance's Lark dialect, Harmony's special tokens as terminals) lets the model think
freely in one analysis message, then requires the final-channel header, JSON that validates
against the schema, and the end of the turn::

    [<|channel|>analysis<|message|> any text <|end|><|start|>assistant] <|channel|>final<|message|> JSON <|return|>

A forced tool call (`tool_choice` "required" or a named function) replaces the final message by a
commentary-channel call to `functions.<name>` whose arguments follow the tool's parameter schema,
ended by `<|call|>`. JSON is compact (no free whitespace). The workers (engine/grammar.py) also
keep the token budget in view, so the JSON is closed before `max_tokens` runs out.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance as llg

from pdserve.router.errors import InvalidRequestError

_ANALYSIS = 'analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"\nTEXT: /(.|\\n)*/\n'


def _json(schema: dict) -> str:
    return "%json" + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def _schema_of(fmt: dict, param: str) -> dict | None:
    """The JSON schema a response format asks for; None for plain text. Chat nests it in
    `json_schema`, the Responses API puts `name`/`schema` beside `type`."""
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise InvalidRequestError(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                                  param=f"{param}.type")
    spec = fmt.get("json_schema") if param == "response_format" else fmt
    where = f"{param}.json_schema" if param == "response_format" else param
    if spec is None:
        raise _missing(where)
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    schema = spec.get("schema")
    if schema is None:
        raise _missing(f"{where}.schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where}.schema must be a JSON-schema object", param=f"{where}.schema")
    return schema


def _missing(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"Missing required parameter: '{param}' (a json_schema format needs "
                               "its JSON schema).", param=param, code="missing_required_parameter")


def check(grammar: str, param: str) -> str:
    """`grammar` if it compiles, else InvalidRequestError naming llguidance's reason."""
    error = llg.LLMatcher.validate_grammar(grammar, None)
    if error:
        reason = re.split(r"\n\s*\d+ \|", error.split("failed to compile JSON schema: ", 1)[-1])[0].strip()
        raise InvalidRequestError(f"{param}: invalid JSON schema: {reason}", param=param)
    return grammar


def _forced_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict]:
    """The functions one of which must be called (OpenAI's chat tool shape), else []."""
    functions = [t["function"] for t in tools or []]
    if tool_choice == "required":
        return functions
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
        return [f for f in functions if f.get("name") == name]
    return []


def grammar(response_format: dict | None = None, *, tools: list[dict] | None = None,
            tool_choice: Any = None, param: str = "response_format") -> str:
    """The grammar for a request ("" = unconstrained). Raises InvalidRequestError (400) naming
    what is wrong with a schema."""
    forced = _forced_tools(tools, tool_choice)
    if forced:
        calls = []
        for i, f in enumerate(forced):
            name = f["name"]
            schema = f.get("parameters") or {"type": "object"}
            calls.append(f'call{i}: <|channel|> "commentary to=functions.{name} " <|constrain|> "json" '
                         f'<|message|> args{i} <|call|>\nargs{i}: {_json(schema)}\n')
            check(f"start: args0\nargs0: {_json(schema)}\n", f"tools.{name}.parameters")
        alternatives = " | ".join(f"call{i}" for i in range(len(forced)))
        return f"start: analysis? ({alternatives})\n{_ANALYSIS}" + "".join(calls)
    schema = _schema_of(response_format or {}, param)
    if schema is None:
        return ""
    return check(f"start: analysis? final\n{_ANALYSIS}"
                  f"final: <|channel|> \"final\" <|message|> body <|return|>\nbody: {_json(schema)}\n", param)
