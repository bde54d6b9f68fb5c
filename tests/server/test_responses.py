"""The Responses API (``/v1/responses``, ``/v1/responses/input_tokens``) through the real server,
with the official ``openai`` client's ``responses`` resource and raw HTTP."""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import MODEL, ServerProcess

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120.0)


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 30,
                                      "input": "Name three primary colors.", **kwargs})


def test_text_response(client: openai.OpenAI) -> None:
    r = create(client)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text and r.output[0].content[0].text == r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 30
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_and_final_response_equal_the_whole(client: openai.OpenAI) -> None:
    whole = create(client)
    types, final, numbers, deltas = [], None, [], []
    for ev in create(client, stream=True):
        types.append(ev.type)
        numbers.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert numbers == list(range(len(numbers)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert final is not None and final.output_text == whole.output_text and final.status == whole.status
    assert "".join(deltas) == whole.output_text


def test_forced_function_call_and_its_output_turn(client: openai.OpenAI) -> None:
    r = create(client, input="What's the weather in Paris?", tools=[WEATHER], max_output_tokens=40,
               tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = create(client, tools=[WEATHER], input=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}])
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens


def test_streamed_forced_call_equals_whole(client: openai.OpenAI) -> None:
    args = {"input": "What's the weather in Rome?", "tools": [WEATHER], "max_output_tokens": 40,
            "tool_choice": "required"}
    whole = [item for item in create(client, **args).output if item.type == "function_call"]
    deltas, done = [], None
    for ev in create(client, stream=True, **args):
        if ev.type == "response.function_call_arguments.delta":
            deltas.append(ev.delta)
        elif ev.type == "response.function_call_arguments.done":
            done = ev.arguments
    assert whole and done == "".join(deltas) == whole[0].arguments


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    r = create(client, input="Invent a person.", max_output_tokens=60,
               text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_previous_response_id_continues_and_hits_the_cache(client: openai.OpenAI) -> None:
    instructions = f"{secrets.token_hex(4)} You are a terse assistant. " + "Answer in few words. " * 60
    first = create(client, instructions=instructions)
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = create(client, instructions=instructions, input="And two more.", previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * second.usage.input_tokens


def test_repeat_is_cached(client: openai.OpenAI) -> None:
    instructions = f"{secrets.token_hex(4)} " + "You help with code. " * 80
    create(client, instructions=instructions)
    again = create(client, instructions=instructions)
    assert again.usage.input_tokens_details.cached_tokens >= 0.8 * again.usage.input_tokens


def test_unknown_previous_response_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        create(client, previous_response_id="resp_does_not_exist")
    assert err.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_input_tokens_counts_the_rendered_prompt(client: openai.OpenAI) -> None:
    short = client.responses.input_tokens.count(model=MODEL, input="hi")
    long = client.responses.input_tokens.count(model=MODEL, input="hi " * 100)
    assert 0 < short.input_tokens < long.input_tokens
    assert create(client, input="hi").usage.input_tokens == short.input_tokens


def test_codex_shapes_are_accepted(server: ServerProcess) -> None:
    """Item ids, namespace, custom and hosted tools, include/reasoning/store/prompt_cache_key."""
    body = {"model": MODEL, "max_output_tokens": 8, "temperature": 0, "store": False,
            "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
            "prompt_cache_key": "k", "client_metadata": {"a": "b"},
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "Be brief."}]},
                      {"type": "reasoning", "id": "rs_1", "summary": []},
                      {"type": "message", "id": "msg_2", "role": "user",
                       "content": [{"type": "input_text", "text": "hello"}]}],
            "tools": [WEATHER, {"type": "web_search"},
                      {"type": "namespace", "name": "ns", "description": "d", "tools": [
                          {"type": "function", "name": "inner", "parameters": {"type": "object", "properties": {}}}]},
                      {"type": "custom", "name": "apply_patch", "description": "patch",
                       "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "ok"'}}]}
    r = httpx.post(server.base_url + "/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = {"type": "custom", "name": "apply_patch"}
    forced = httpx.post(server.base_url + "/responses", timeout=120,
                        json={**body, "max_output_tokens": 20, "tool_choice": choice})
    assert forced.status_code == 200, forced.text
    items = forced.json()["output"]
    assert items[0]["type"] == "custom_tool_call" and items[0]["input"] == "ok"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "max_output_tokens": "x"}, "max_output_tokens"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "mystery"}]}, "input[0]"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "absent"}}, "tool_choice"),
    ({"input": "hello " * 9000}, "input"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 3}, "max_output_tokens"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "hi", "metadata": {"k": {"nested": "object"}}}, "metadata"),
])
def test_bad_input_is_a_400_in_openai_shape(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    r = httpx.post(server.base_url + "/responses", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


def test_the_store_keeps_conversations_within_its_bytes_and_only_for_their_owner() -> None:
    from kvcellar.server.responses.store import ResponseStore, StoredResponse

    store = ResponseStore(capacity=1000, max_bytes=1 << 20)
    turn = [{"role": "user", "content": "x" * 100_000}]
    for i in range(50):  # 5 MB offered
        store.put(f"r{i}", StoredResponse(turn, owner="alice"))
    assert store.nbytes <= 1 << 20 and len(store) == 10  # the newest that fit
    assert store.get("r49", "alice") is not None and store.get("r0", "alice") is None
    assert store.get("r49", "bob") is None and store.get("r49") is None  # another tenant's: unknown
    store.put("huge", StoredResponse([{"role": "user", "content": "x" * (2 << 20)}]))
    assert store.get("huge") is None and len(store) == 10  # larger than the store: not kept, nothing dropped
