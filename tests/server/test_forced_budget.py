"""Forced tool calls and JSON schemas at small ``max_tokens``, through the real server.

The reported failure: a named tool (langchain's ``with_structured_output(method="function_calling")``
sends one with ``max_completion_tokens: 30``) or ``tool_choice: "required"`` with 12-30 tokens
ended ``finish_reason: length`` with half a call (``{"name": "``, ``{}`` without the required
``city``, an unterminated string, or no call at all). Now an output whose grammar can end
within ``max_tokens`` always does: from ``GrammarCompiler.min_tokens`` up, every response is
a complete call (or JSON document) that validates. Below it no valid output fits at all.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from kvcellar.engine.constraints import GrammarCompiler
from kvcellar.server.tools.grammar import forced_call_grammar
from tests._models import embedded
from tests.server.test_tools import TIME, WEATHER

CITY = {"type": "function", "function": {  # the tool: one required string
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_SETS = {"city": [CITY], "weather_time": [WEATHER, TIME]}
REPORT = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "temperature": {"type": "integer", "minimum": -90, "maximum": 60},
    "sky": {"type": "string", "enum": ["clear", "cloudy", "rain", "snow"]}},
    "required": ["city", "temperature", "sky"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
BUDGETS = (12, 16, 20, 30)  # the reported ones


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    """The server's grammar compiler, in process: same tokenizer and code, so the same
    ``min_tokens``."""
    loaded = embedded()
    return GrammarCompiler(loaded.tokenizer, int(loaded.model.config.vocab_size), loaded.eos_token_ids)


def min_call_tokens(compiler: GrammarCompiler, tools: list[dict[str, Any]]) -> int:
    # The embedded model runs the fallback (Hermes) markup; parallel calls do not change the minimum.
    least = compiler.min_tokens(forced_call_grammar(compiler, "hermes", tools, parallel=False), 10_000)
    assert least is not None
    return least


def tool_choice(kind: str, tools: list[dict[str, Any]]) -> Any:
    if kind == "required":
        return "required"
    return {"type": "function", "function": {"name": tools[0]["function"]["name"]}}


def check_calls(choice: Any, tools: list[dict[str, Any]], max_tokens: int, usage: Any) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert choice.finish_reason == "tool_calls", (max_tokens, choice)
    assert choice.message.tool_calls, (max_tokens, choice.message.content)
    for call in choice.message.tool_calls:
        assert call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert usage.completion_tokens <= max_tokens


@pytest.mark.parametrize("kind", ["named", "required"])
@pytest.mark.parametrize("tool_set", sorted(TOOL_SETS))
def test_forced_call_within_small_max_tokens(client: Any, model_name: str, compiler: GrammarCompiler,
                                             kind: str, tool_set: str) -> None:
    tools = TOOL_SETS[tool_set]
    least = min_call_tokens(compiler, tools if kind == "required" else tools[:1])  # the tools the grammar forces
    for max_tokens in sorted({*BUDGETS, least, least + 2}):
        if max_tokens < least:  # no valid call fits: a 400 up front (test_below_min_tokens_is_refused)
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_tokens=max_tokens,
                                               tools=tools, tool_choice=tool_choice(kind, tools))
            continue
        r = client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_tokens=max_tokens,
                                           tools=tools, tool_choice=tool_choice(kind, tools))
        check_calls(r.choices[0], tools, max_tokens, r.usage)


def test_langchain_structured_output_shape(client: Any, model_name: str, compiler: GrammarCompiler) -> None:
    """What ``with_structured_output(method="function_calling")`` sends: one named tool and
    ``max_completion_tokens: 30`` (the city-only tool needs fewer)."""
    assert min_call_tokens(compiler, [CITY]) <= 30
    r = client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_completion_tokens=30,
                                       tools=[CITY], tool_choice=tool_choice("named", [CITY]))
    check_calls(r.choices[0], [CITY], 30, r.usage)


def test_json_schema_within_small_max_tokens(client: Any, model_name: str, compiler: GrammarCompiler) -> None:
    least = compiler.min_tokens(compiler.json_schema(REPORT, param="response_format.json_schema.schema"), 10_000)
    assert least is not None
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    for max_tokens in sorted({*BUDGETS, least, least + 1, least + 4}):
        if max_tokens < least:
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model=model_name, messages=ASK, temperature=0,
                                               max_tokens=max_tokens, response_format=fmt)
            continue
        r = client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_tokens=max_tokens,
                                           response_format=fmt)
        assert r.choices[0].finish_reason == "stop", (max_tokens, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), REPORT)
        assert r.usage.completion_tokens <= max_tokens


@pytest.mark.parametrize("kind", ["named", "required"])
def test_below_min_tokens_is_refused(client: Any, model_name: str, compiler: GrammarCompiler, kind: str) -> None:
    """A forced call that cannot fit: a clear 400 naming the minimum, before anything is queued."""
    tools = TOOL_SETS["weather_time"]
    least = min_call_tokens(compiler, tools if kind == "required" else tools[:1])
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_tokens=least - 1,
                                       tools=tools, tool_choice=tool_choice(kind, tools))
    assert str(least) in bad.value.message
