"""Tool calling through the real server with the official ``openai`` client.

The embedded SmolLM2's chat template ignores ``tools``, so these run the fallback format
(tool definitions in the system turn, Hermes-style ``<tool_call>`` markup). Forced calls
(``required``, named) are grammar-constrained: their arguments must validate against the
tool's ``parameters`` schema every time.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def chat(client: Any, model_name: str, **kwargs: Any) -> Any:
    args = {"model": model_name, "messages": ASK, "temperature": 0, "max_tokens": 60, **kwargs}
    return client.chat.completions.create(**args)


def check_calls(calls: Any, allowed: set[str]) -> None:
    assert calls, "expected tool calls"
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def streamed(client: Any, model_name: str, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str | None, list[Any]]:
    """(content, calls rebuilt from delta.tool_calls, finish_reason, raw tool-call deltas)."""
    content, calls, finish, deltas = [], [], None, []
    for chunk in chat(client, model_name, stream=True, **kwargs):
        choice = chunk.choices[0]
        if choice.delta.content:
            content.append(choice.delta.content)
        for d in choice.delta.tool_calls or []:
            deltas.append(d)
            if d.index == len(calls):
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return "".join(content), calls, finish, deltas


def test_required_returns_valid_calls(client: Any, model_name: str) -> None:
    r = chat(client, model_name, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"


def test_named_tool_is_the_only_call(client: Any, model_name: str) -> None:
    r = chat(client, model_name, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    check_calls(choice.message.tool_calls, {"get_time"})


def test_parallel_tool_calls_false_gives_one_call(client: Any, model_name: str) -> None:
    r = chat(client, model_name, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    assert len(r.choices[0].message.tool_calls) == 1


def test_none_never_calls(client: Any, model_name: str) -> None:
    # The same conversation makes the model call under "auto" (test_auto_...): "none" must not.
    r = chat(client, model_name, messages=FEW_SHOT, tools=TOOLS, tool_choice="none")
    choice = r.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content


# One earlier call in the history (rendered in the fallback markup) is enough for the small
# model to answer the next question with a call of its own.
FEW_SHOT = [
    {"role": "user", "content": "Weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "London", "unit": "celsius"}'}}]},
    {"role": "user", "content": "Weather in Paris?"},
]


def test_auto_parses_the_models_own_call(client: Any, model_name: str) -> None:
    r = chat(client, model_name, messages=FEW_SHOT, tools=TOOLS, tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather"})
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"
    plain = chat(client, model_name, messages=[{"role": "user", "content": "Hi! How are you?"}], tools=TOOLS)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_calls_match_non_streamed(client: Any, model_name: str, tool_choice: str) -> None:
    messages = ASK if tool_choice == "required" else FEW_SHOT
    whole = chat(client, model_name, messages=messages, tools=TOOLS, tool_choice=tool_choice)
    content, calls, finish, deltas = streamed(client, model_name, messages=messages, tools=TOOLS,
                                              tool_choice=tool_choice)
    assert finish == "tool_calls"
    assert "<tool_call>" not in content and "tool_call" not in content
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert all(c["id"] and c["id"].startswith("call_") for c in calls)
    first = deltas[0]  # id and name first, arguments as fragments after
    assert first.id and first.function.name and first.type == "function"
    assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:2])


def test_tools_reach_the_prompt_and_are_cached(client: Any, model_name: str) -> None:
    system = {"role": "system", "content": "You answer questions about weather and time. " * 8}
    bare = chat(client, model_name, messages=[system, *ASK], max_tokens=1)
    first = chat(client, model_name, messages=[system, *ASK], tools=TOOLS, max_tokens=1)
    assert first.usage.prompt_tokens > bare.usage.prompt_tokens + 100  # both signatures are in the prompt
    other = chat(client, model_name, tools=TOOLS, max_tokens=1,
                 messages=[system, {"role": "user", "content": "What time is it in Tokyo?"}])
    # Everything up to the user turn (system text + tool block) comes from the cache.
    assert other.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32


def test_three_step_loop(client: Any, model_name: str) -> None:
    """call -> tool result -> answer, with the call and its result rendered in the history."""
    messages: list[dict[str, Any]] = list(ASK)
    r1 = chat(client, model_name, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = r1.choices[0].message.tool_calls[0]
    messages.append(r1.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"})
    r2 = chat(client, model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40)
    answer = r2.choices[0].message
    assert answer.tool_calls is None and answer.content
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + 20  # the call and its result are in the prompt
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 16
    messages.append({"role": "assistant", "content": answer.content})
    messages.append({"role": "user", "content": "And in Rome?"})
    r3 = chat(client, model_name, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    check_calls(r3.choices[0].message.tool_calls, {"get_weather", "get_time"})


def test_n_choices_each_call(client: Any, model_name: str) -> None:
    r = chat(client, model_name, tools=[WEATHER], tool_choice="required", n=2, temperature=0.8, seed=3)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"get_weather"})
