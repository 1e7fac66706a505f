"""engine/grammar.py: a model that samples anything the mask allows (random weights do) still
ends every output inside the grammar, within its token budget; the router's grammars for
response formats and forced tool calls (router/structured_output.py)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from pdserve.engine import grammar as G
from pdserve.router import structured_output
from pdserve.router.harmony import HarmonyCodec

SCHEMAS = [
    {"type": "object"},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 3}, "name": {"type": "string"}},
     "required": ["age", "name"], "additionalProperties": False},  # a number followed by a key: the way
    # out must leave the digits (a comma before another zero)
    {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green"]},
                                      "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array", "items": {
        "type": "object", "properties": {"c": {"type": "number"}}, "required": ["c"]}}}, "required": ["b"]}},
     "required": ["a"]},
]
RETURN = 200002  # <|return|>
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMAS[1]}},
         {"type": "function", "function": {"name": "g", "parameters": SCHEMAS[2]}}]


@pytest.fixture(scope="module")
def codec():
    return HarmonyCodec()


def _walk(grammar: str, budget: int, rng: random.Random) -> list[int]:
    """What a random model samples under the masks: any allowed token, now and then an end token
    as early as the grammar allows (the shortest outputs)."""
    m, row, out = G.Matcher(grammar, budget), np.empty(G.MASK_WORDS, dtype=np.int32), []
    while len(out) < budget and not m.done():
        m.fill(row)
        ids = G.allowed(row)
        assert len(ids), "the mask allows nothing"
        token = int(ids[rng.randrange(len(ids))])
        m.accept(token)
        out.append(token)
    assert m.done(), "the budget ran out inside the grammar"
    return out


@pytest.mark.parametrize("schema", SCHEMAS)
def test_random_walks_end_in_valid_json_within_the_budget(schema, codec, rng):
    grammar = structured_output.grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    for _ in range(2):
        budget = rng.randrange(40, 120)
        out = _walk(grammar, budget, rng)
        parsed = codec.parse_completion(out)
        jsonschema.validate(json.loads(parsed.content), schema)
        assert len(out) <= budget and out[-1] == RETURN


def test_a_forced_tool_call_validates_against_the_tool(codec, rng):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        out = _walk(structured_output.grammar(None, tools=TOOLS, tool_choice=choice), rng.randrange(80, 200), rng)
        [call] = codec.parse_completion(out).tool_calls
        assert choice == "required" or call.name == "g"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_the_way_out_is_forced_when_the_budget_is_short(rng):
    grammar = structured_output.grammar({"type": "json_object"})
    m = G.Matcher(grammar, 12)
    path = m.way_out(100)
    assert len(path) <= 12 and m.num_generated == 0  # computing it moves nothing
    out = _walk(grammar, len(path), rng)
    assert out == path  # no room for anything else


def test_generated_tokens_are_replayed_and_a_foreign_token_is_refused():
    grammar = structured_output.grammar({"type": "json_object"})
    path = G.Matcher(grammar, 64).way_out(64)
    m = G.Matcher(grammar, 64, generated=path[:3])
    assert m.num_generated == 3
    with pytest.raises(G.GrammarError):
        m.accept(12345)  # plain text where the header must continue
    with pytest.raises(G.GrammarError):
        G.Matcher("start: %json{\"type\": \"nope\"}", 8)


def test_fill_masks_leaves_free_rows_free():
    grammar = structured_output.grammar({"type": "json_object"})
    mask = G.fill_masks([None, G.Matcher(grammar, 64), None])
    assert (mask[0] == -1).all() and (mask[2] == -1).all()
    assert len(G.allowed(mask[1])) == 1  # the header's first token
    assert G.fill_masks([None, None]) is None
