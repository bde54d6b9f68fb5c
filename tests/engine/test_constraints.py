"""Grammar-constrained decoding inside the engine's batched step (real embedded model)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from kvcellar.engine import SamplingParams
from kvcellar.engine.sampling import sample_row
from kvcellar.errors import InvalidRequestError
from kvcellar.server.tools.grammar import auto_call_grammar, forced_call_grammar
from kvcellar.server.tools.parsers import HermesParser, Llama3Parser
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
    before = engine.grammars.stats.compiled
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}}
    first = engine.grammars.json_schema(schema, param="p")
    again = engine.grammars.json_schema(dict(schema), param="p")
    assert first is again
    assert engine.grammars.stats.compiled == before + 1


# ---- ending within max_tokens: the plan, min_tokens, adversarial choices ---------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "minLength": 3}}, "required": ["zone"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
FIELDS = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 20},
    "score": {"type": "number"},
    "count": {"type": "integer", "minimum": 10, "maximum": 99},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "where": {"type": "object", "properties": {
        "city": {"type": "string"},
        "geo": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}},
        "required": ["city", "geo"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
    "required": ["name", "score", "count", "unit", "where", "tags"], "additionalProperties": False}
# Array items far bigger than the empty array that ends it: one token (``[{``) adds a whole item.
ROWS = {"type": "object", "properties": {"rows": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string"},
                                     "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
    "required": ["id", "label", "ok", "kind"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}
SCHEMAS = {"fields": FIELDS, "rows": ROWS, "film": SCHEMA, "object": {"type": "object"}}
TOOL_SETS = {"weather": [WEATHER], "three": [WEATHER, TIME, PING]}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
                for t in (WEATHER, TIME, PING)}
CASES = ([f"json_schema:{name}" for name in SCHEMAS]
         + [f"{family}:{tools}:{'parallel' if parallel else 'single'}"
            for family in ("hermes", "llama3") for tools in TOOL_SETS for parallel in (False, True)]
         + ["mistral:weather:parallel", "mistral:three:parallel"])
MISTRAL_TOKEN = 1  # a special token of the embedded tokenizer standing in for [TOOL_CALLS]
BIG = 10_000


class Adversary:
    """Logits of a model that never wants to end: ``random`` (argmax of random logits: long
    strings), ``opener`` (the token that opens the most strings, arrays and objects, the
    longer the better), ``looper`` (closes strings at once but then always goes on: one
    more key, item or call), ``sample`` (temperature 1 over random logits: tail tokens too).
    Seeded."""

    KINDS = ("random", "opener", "looper", "sample")

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.vocab = vocab
        self.bias = {"opener": torch.zeros(vocab), "looper": torch.zeros(vocab)}
        for i in range(min(vocab, len(tokenizer))):
            raw = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(i)])
            closes = raw.count("}") + raw.count("]")
            self.bias["opener"][i] = 10 * sum(raw.count(c) for c in '{[",') + len(raw) - 5 * closes
            self.bias["looper"][i] = 30 * ('"' in raw) + 10 * ("," in raw) \
                + 10 * (raw.count("{") + raw.count("[")) - 10 * closes

    def logits(self, kind: str, gen: torch.Generator) -> torch.Tensor:
        noise = torch.rand(self.vocab, generator=gen)
        return self.bias[kind] + 0.1 * noise if kind in self.bias else 8 * noise


@pytest.fixture(scope="module")
def adversary(engine: Any) -> Adversary:
    return Adversary(engine.tokenizer, engine.vocab_size)


def case_grammar(engine: Any, case: str) -> Any:
    if case.startswith("json_schema:"):
        return engine.grammars.json_schema(SCHEMAS[case.split(":")[1]], param="response_format")
    family, tools, mode = case.split(":")
    return forced_call_grammar(engine.grammars, family, TOOL_SETS[tools], parallel=mode == "parallel",
                               mistral_token_id=MISTRAL_TOKEN)


def check_output(engine: Any, case: str, ids: list[int]) -> None:
    """The output is what the server reads back: JSON valid against the schema, or calls
    of the allowed tools with valid arguments and nothing else."""
    if case.startswith("json_schema:"):
        jsonschema.validate(json.loads(engine.tokenizer.decode(ids)), SCHEMAS[case.split(":")[1]])
        return
    family, tools, mode = case.split(":")
    names = {t["function"]["name"] for t in TOOL_SETS[tools]}
    if family == "mistral":
        assert ids[0] == MISTRAL_TOKEN
        calls = [(c["name"], json.dumps(c["arguments"])) for c in json.loads(engine.tokenizer.decode(ids[1:]))]
    else:
        parser = {"hermes": HermesParser, "llama3": Llama3Parser}[family](names)
        parsed = parser.parse(engine.tokenizer.decode(ids))
        assert parsed.content is None, parsed
        calls = [(c.name, c.arguments) for c in parsed.tool_calls]
    assert calls and (mode == "parallel" or len(calls) == 1)
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


def decode(engine: Any, grammar: Any, max_tokens: int, adversary: Adversary, kind: str,
           seed: int) -> tuple[list[int], Any]:
    """The engine's sampling path (``sample_row``, then ``accept`` / ``finished``) with the
    adversary's logits for the model's."""
    constraint = engine.grammars.constraint(grammar, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if kind == "sample" else 0, seed=seed)
    sampler = params.make_generator(torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < max_tokens:
        token = sample_row(adversary.logits(kind, gen), params, out, sampler, constraint).token_id
        assert constraint.accept(token), (engine.tokenizer.decode(out), token)
        out.append(token)
        if token in engine.loaded.eos_token_ids:
            out.pop()
            break
        if constraint.finished:
            break
    return out, constraint


@pytest.mark.parametrize("case", CASES)
def test_every_budget_from_min_tokens_ends_valid(engine: Any, adversary: Adversary, case: str) -> None:
    """From ``min_tokens`` up, whatever the model picks (within the mask and ``choose``),
    the output ends accepted within ``max_tokens`` and validates; ``min_tokens`` - 1 is
    reported infeasible."""
    grammar = case_grammar(engine, case)
    least = engine.grammars.min_tokens(grammar, BIG)
    assert least is not None and least >= 1
    assert engine.grammars.min_tokens(grammar, least) == least
    assert engine.grammars.min_tokens(grammar, least - 1) is None
    # Every budget near the least, where the planner has no slack; every third one on to 41.
    budgets = sorted({*range(least, least + 12), *range(least + 12, 41, 3), least + 30, least + 50, 100})
    for max_tokens in budgets:
        for kind in Adversary.KINDS:
            out, constraint = decode(engine, grammar, max_tokens, adversary, kind, seed=max_tokens)
            text = engine.tokenizer.decode(out)
            assert constraint.accepting and len(out) <= max_tokens, (max_tokens, kind, text)
            check_output(engine, case, out)
    # The start plan itself is the shortest output the engine ends with.
    out, constraint = decode(engine, grammar, least, adversary, "opener", seed=0)
    assert constraint.accepting and len(out) == least


def test_min_tokens_of_grammars_that_do_not_steer(engine: Any) -> None:
    grammar = auto_call_grammar(engine.grammars, "hermes", [WEATHER])
    assert grammar is not None and engine.grammars.min_tokens(grammar, 0) == 0


def test_far_from_the_end_nothing_is_searched(engine: Any, adversary: Adversary, monkeypatch: Any) -> None:
    """With a budget far beyond the plan the cost per token is the mask's: the planner runs
    only now and then (never within these 60 tokens of a 4000-token budget)."""
    grammar = case_grammar(engine, "json_schema:object")
    engine.grammars.min_tokens(grammar, BIG)  # the start plan is cached with the grammar
    calls = []
    planner = engine.grammars._planner
    search = planner.search
    monkeypatch.setattr(planner, "search", lambda *a, **k: calls.append(1) or search(*a, **k))
    constraint = engine.grammars.constraint(grammar, 4000)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4000, temperature=0)
    out: list[int] = []
    for _ in range(60):
        token = sample_row(adversary.logits("opener", gen), params, out, None, constraint).token_id
        assert constraint.accept(token)
        out.append(token)
    assert not calls


@pytest.mark.parametrize("tools", ["weather", "three"])
def test_forced_call_at_short_budgets_with_the_model(engine: Any, tools: str) -> None:
    """The reported failure (a named or required call cut at 20-30 tokens) with the real
    model: from min_tokens up, a complete call with valid arguments, finish_reason stop."""
    grammar = case_grammar(engine, f"hermes:{tools}:parallel")
    least = engine.grammars.min_tokens(grammar, BIG)
    prompt = chat_ids(engine.loaded, "What's the weather in Paris?")
    budgets = [least, least + 1, least + 4, 60]
    results = engine.generate([prompt] * len(budgets), [SamplingParams(max_tokens=n, temperature=0, grammar=grammar)
                                                         for n in budgets])
    for n, r in zip(budgets, results, strict=True):
        assert r.finish_reason == "stop" and len(r.token_ids) <= n, (n, r.text)
        check_output(engine, f"hermes:{tools}:parallel", r.token_ids)
    assert_no_leaks(engine)


def test_compiled_grammars_are_kept_within_their_bytes(engine: Any, monkeypatch) -> None:
    """Distinct schemas are what any client can send: the grammars kept for reuse stay within a
    byte bound, keyed by digest, and a kept one is still reused."""
    from kvcellar.engine import constraints

    monkeypatch.setattr(constraints, "_CACHE_BYTES", 200_000)
    compiler = engine.grammars
    before = compiler.stats.compiled
    for i in range(40):
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "string"} for j in range(200)}}
        compiler.json_schema(schema, param="response_format")
    assert compiler.stats.compiled - before == 40
    assert 0 < compiler.cached_bytes <= 200_000
    hits = compiler.stats.cache_hits
    compiler.json_schema(schema, param="response_format")  # the newest is kept
    assert compiler.stats.cache_hits == hits + 1
