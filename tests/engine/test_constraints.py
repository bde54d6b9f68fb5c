"""Grammar-constrained decoding inside the engine's batched step (real embedded model)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvcellar.engine import SamplingParams
from kvcellar.errors import InvalidRequestError
from tests._models import assert_no_leaks, chat_ids, embedded, make_engine

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["drama", "comedy", "action"]}, "maxItems": 2}},
    "required": ["title", "year", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine() -> Any:
    return make_engine(embedded())


def prompts(loaded: Any) -> list[list[int]]:
    return [chat_ids(loaded, q) for q in (
        "Name three primary colors.", "Describe a film you like as JSON.", "What is the capital of Italy?")]


def test_mixed_batch_leaves_unconstrained_outputs_unchanged(engine: Any) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0)
    constrained = SamplingParams(max_tokens=60, temperature=0,
                                 grammar=engine.grammars.json_schema(SCHEMA, param="response_format"))
    a, b, c = prompts(engine.loaded)
    alone = engine.generate([a, c], plain)
    mixed = engine.generate([a, b, c], [plain, constrained, plain])  # one step batches all three
    assert [r.token_ids for r in (mixed[0], mixed[2])] == [r.token_ids for r in alone]
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)
    assert mixed[1].finish_reason == "stop"
    assert_no_leaks(engine)


def test_constrained_output_ends_within_a_short_budget(engine: Any) -> None:
    grammar = engine.grammars.json_schema({"type": "object"}, param="response_format")
    for max_tokens in (12, 20, 40):
        [r] = engine.generate([prompts(engine.loaded)[1]], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          grammar=grammar))
        assert r.finish_reason == "stop", (max_tokens, r.text)
        assert isinstance(json.loads(r.text), dict)
        assert len(r.token_ids) <= max_tokens


def test_logprobs_stay_those_of_the_model(engine: Any) -> None:
    """The mask changes what is picked, not the reported distribution."""
    grammar = engine.grammars.json_schema({"type": "object"}, param="response_format")
    prompt = prompts(engine.loaded)[0]  # the model would answer in prose: "{" is unlikely
    [free] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=True))
    [forced] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=True, grammar=grammar))
    assert engine.tokenizer.decode(forced.token_ids).startswith("{")
    assert forced.token_ids != free.token_ids
    assert forced.logprobs[0] < free.logprobs[0]


def test_schema_errors_name_the_field(engine: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engine.grammars.json_schema({"type": "string", "pattern": "(?<=a)b"},
                                    param="response_format.json_schema.schema")
    assert err.value.param == "response_format.json_schema.schema"


def test_grammars_are_compiled_once(engine: Any) -> None:
    before = engine.grammars.stats["grammar_compiled"]
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}}
    first = engine.grammars.json_schema(schema, param="p")
    again = engine.grammars.json_schema(dict(schema), param="p")
    assert first is again
    assert engine.grammars.stats["grammar_compiled"] == before + 1
