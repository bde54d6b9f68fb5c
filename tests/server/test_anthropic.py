"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the real
server, with the official ``anthropic`` client and raw HTTP.

Greedy requests pass ``temperature`` through ``extra_body`` (the SDK's ``create`` has no such
keyword in this version). Forced tool calls are grammar-constrained exactly as on the OpenAI
API (tests/server/test_tools.py): their ``input`` validates against the tool's schema.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from kvcellar.server import errors
from tests.helpers import MODEL, ServerProcess

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "Name three primary colors."}]
WEATHER_ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "Get the local time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
# One earlier call in the history is enough for the small model to answer with a call of its own.
FEW_SHOT = [
    {"role": "user", "content": "Weather in London?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "London", "unit": "celsius"}}]},
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    """The official ``anthropic`` client pointed at the session server (no key needed)."""
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120.0)


def create(claude: anthropic.Anthropic, **kwargs: Any) -> Any:
    args = {"model": MODEL, "max_tokens": 40, "messages": ASK, "extra_body": GREEDY, **kwargs}
    return claude.messages.create(**args)


def stream_final(claude: anthropic.Anthropic, **kwargs: Any) -> Any:
    args = {"model": MODEL, "max_tokens": 40, "messages": ASK, "extra_body": GREEDY, **kwargs}
    with claude.messages.stream(**args) as stream:
        return stream.get_final_message()


def count(claude: anthropic.Anthropic, **kwargs: Any) -> int:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("max_tokens", "extra_body", "stop_sequences")}
    return claude.messages.count_tokens(**{"model": MODEL, "messages": ASK, **kwargs}).input_tokens


def prompt_tokens(message: Any) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def raw_events(server: ServerProcess, request: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of a raw SSE response; every frame is ``event:`` then ``data:``."""
    out: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", server.url + MESSAGES, json={**request, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name: str | None = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                assert name is None, f"two event lines in one frame: {line}"
                name = line[len("event: "):]
            elif line.startswith("data: "):
                assert name is not None, f"data without an event line: {line}"
                out.append((name, json.loads(line[len("data: "):])))
                name = None
            else:
                assert line == "", line
    assert name is None
    return out


def check_event_order(pairs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """message_start, (ping), then per block start / delta... / stop with indices 0, 1, ...,
    then message_delta, message_stop; each data's ``type`` is its event's name. Returns the
    content_block_start blocks."""
    names = [n for n, _ in pairs]
    for name, data in pairs:
        assert data["type"] == name, (name, data)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    middle = pairs[2:-2] if names[1] == "ping" else pairs[1:-2]
    kinds = [n for n, _ in middle]
    inner = [d for _, d in middle]
    assert "ping" not in kinds, names  # one ping at most, right after message_start
    blocks: list[dict[str, Any]] = []
    i = 0
    while i < len(kinds):
        assert kinds[i] == "content_block_start", names
        assert inner[i]["index"] == len(blocks)
        blocks.append(inner[i]["content_block"])
        i += 1
        while i < len(kinds) and kinds[i] == "content_block_delta":
            assert inner[i]["index"] == len(blocks) - 1
            i += 1
        assert i < len(kinds) and kinds[i] == "content_block_stop", names
        assert inner[i]["index"] == len(blocks) - 1
        i += 1
    start = pairs[0][1]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["stop_reason"] is None
    assert pairs[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    return blocks


def check_tool_uses(message: Any, allowed: set[str]) -> list[Any]:
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses, f"expected tool_use blocks: {message.content}"
    for use in uses:
        assert use.name in allowed
        assert use.id.startswith("toolu_") and len(use.id) > 10
        jsonschema.validate(use.input, SCHEMAS[use.name])
    assert len({u.id for u in uses}) == len(uses)
    return uses


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ---- text --------------------------------------------------------------------------------


def test_text_reply(claude: anthropic.Anthropic) -> None:
    r = create(claude)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert len(r.content) == 1 and r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    u = r.usage
    assert 0 < u.output_tokens <= 40
    assert u.input_tokens >= 0 and u.cache_read_input_tokens >= 0 and u.cache_creation_input_tokens == 0
    assert prompt_tokens(r) == count(claude)


def test_usage_adds_up_with_a_system_prompt_and_history(claude: anthropic.Anthropic) -> None:
    kwargs = {"system": "You are terse.", "messages": [*ASK, {"role": "assistant", "content": "Red, blue, yellow."},
                                                       {"role": "user", "content": "And secondary?"}]}
    r = create(claude, max_tokens=5, **kwargs)
    assert prompt_tokens(r) == count(claude, **kwargs)


@pytest.mark.parametrize("tools", [False, True], ids=["text", "forced-tool"])
def test_raw_stream_event_order(server: ServerProcess, tools: bool) -> None:
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 60, "messages": ASK, **GREEDY}
    if tools:
        request.update(messages=WEATHER_ASK, tools=TOOLS, tool_choice={"type": "any"})
    pairs = raw_events(server, request)
    blocks = check_event_order(pairs)
    assert blocks, "no content block"
    kinds = {b["type"] for b in blocks}
    assert kinds == ({"tool_use"} if tools else {"text"})
    deltas = [d["delta"]["type"] for n, d in pairs if n == "content_block_delta"]
    assert set(deltas) == ({"input_json_delta"} if tools else {"text_delta"})
    final = pairs[-2][1]
    assert final["delta"]["stop_reason"] in (("tool_use",) if tools else ("end_turn", "max_tokens"))
    assert final["usage"]["output_tokens"] > 0


def test_sdk_stream_equals_non_streamed(claude: anthropic.Anthropic) -> None:
    whole = create(claude, max_tokens=30)
    streamed = stream_final(claude, max_tokens=30)
    assert [b.type for b in streamed.content] == ["text"]
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(streamed) == prompt_tokens(whole)


def test_stop_sequences(claude: anthropic.Anthropic) -> None:
    reply = text_of(create(claude))
    words = reply.split()
    assert len(words) >= 3, reply
    stop = words[2]  # occurs in the greedy reply, not at its start
    cut = reply[:reply.index(stop)]
    for r in (create(claude, stop_sequences=["never-in-the-reply", stop]),
              stream_final(claude, stop_sequences=["never-in-the-reply", stop])):
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
        assert text_of(r) == cut and stop not in text_of(r)


def test_max_tokens_beyond_the_context_is_clamped(server: ServerProcess, claude: anthropic.Anthropic) -> None:
    """32000 > the 8192 context: answered, not a 400 (the SDK refuses such a non-streamed call
    client-side, so it is streamed there and sent raw here)."""
    kwargs: dict[str, Any] = {"max_tokens": 32000, "messages": [{"role": "user", "content": "Say hi."}],
                              "stop_sequences": ["\n", ".", "!"]}
    streamed = stream_final(claude, **kwargs)
    assert streamed.stop_reason in ("stop_sequence", "end_turn") and streamed.content
    r = server.post(MESSAGES, {"model": MODEL, **kwargs, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == streamed.content[0].text


# ---- tools --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_time"}, {"type": "any"}],
                         ids=["named", "any"])
def test_forced_tool_use(claude: anthropic.Anthropic, tool_choice: dict[str, Any], stream: bool) -> None:
    call = stream_final if stream else create
    r = call(claude, max_tokens=120, messages=WEATHER_ASK, tools=TOOLS, tool_choice=tool_choice)
    assert r.stop_reason == "tool_use"
    uses = check_tool_uses(r, {"get_time"} if tool_choice["type"] == "tool" else {"get_weather", "get_time"})
    if tool_choice["type"] == "tool":
        assert [u.name for u in uses] == ["get_time"]
    else:
        assert uses[0].name == "get_weather" and uses[0].input["city"] == "Paris"


def test_forced_tool_streamed_equals_whole(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"max_tokens": 120, "messages": WEATHER_ASK, "tools": TOOLS,
                              "tool_choice": {"type": "any"}}
    whole, streamed = create(claude, **kwargs), stream_final(claude, **kwargs)
    assert [(b.type, b.name, b.input) for b in streamed.content] == [(b.type, b.name, b.input) for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_disable_parallel_tool_use_gives_one_call(claude: anthropic.Anthropic) -> None:
    for call in (create, stream_final):
        r = call(claude, max_tokens=160, messages=WEATHER_ASK, tools=TOOLS,
                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
        assert r.stop_reason == "tool_use"
        assert len(check_tool_uses(r, {"get_weather", "get_time"})) == 1


def test_tool_result_turn_gets_a_reply(claude: anthropic.Anthropic) -> None:
    """call -> tool_result -> answer; the assistant turn is sent back as the SDK returned it."""
    first = create(claude, max_tokens=120, messages=WEATHER_ASK, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = check_tool_uses(first, {"get_weather"})
    messages = [*WEATHER_ASK, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "18 degrees celsius, sunny"}]}]
    for call in (create, stream_final):
        r = call(claude, max_tokens=40, messages=messages, tools=[WEATHER])
        assert r.stop_reason in ("end_turn", "max_tokens")
        assert [b.type for b in r.content] == ["text"] and r.content[0].text
        assert prompt_tokens(r) == count(claude, messages=messages, tools=[WEATHER])
        assert prompt_tokens(r) > prompt_tokens(first) + 20  # the call and its result are in the prompt
        assert r.usage.cache_read_input_tokens >= prompt_tokens(first) - 32  # and the prefix is cached


def test_auto_calls_on_its_own(claude: anthropic.Anthropic) -> None:
    r = create(claude, max_tokens=60, messages=FEW_SHOT, tools=TOOLS)
    assert r.stop_reason == "tool_use"
    (use,) = check_tool_uses(r, {"get_weather"})
    assert use.input["city"] == "Paris"


def test_tool_choice_none_never_uses_a_tool(claude: anthropic.Anthropic) -> None:
    # The same conversation makes the model call under "auto" (above): "none" must not.
    for call in (create, stream_final):
        r = call(claude, max_tokens=60, messages=FEW_SHOT, tools=TOOLS, tool_choice={"type": "none"})
        assert r.stop_reason in ("end_turn", "max_tokens")
        assert [b.type for b in r.content] == ["text"]


def test_tool_choice_none_leaks_no_call_markup(claude: anthropic.Anthropic) -> None:
    r = create(claude, max_tokens=60, messages=FEW_SHOT, tools=TOOLS, tool_choice={"type": "none"})
    assert "<tool_call>" not in text_of(r)


# ---- count_tokens and the prefix cache -------------------------------------------------------


def test_count_tokens(claude: anthropic.Anthropic, server: ServerProcess) -> None:
    short = count(claude)
    assert short > 0
    longer = count(claude, messages=[{"role": "user", "content": ASK[0]["content"] + " Explain each in detail."}])
    assert longer > short
    terse = count(claude, system="You are terse.")  # replaces the template's default system prompt
    assert count(claude, system="You are terse. Answer in French, in one line.") > terse
    assert count(claude, tools=TOOLS) > short + 50  # the tool definitions are in the prompt
    r = server.post(COUNT, {"model": MODEL, "messages": ASK})
    assert r.status_code == 200 and r.json() == {"input_tokens": short}


def long_system(salt: str) -> str:
    """~1500 tokens, unique to this run (its first word), so the first request computes it all."""
    rules = " ".join(f"Rule {i}: answer briefly and politely about topic number {i}." for i in range(95))
    return f"{salt} {rules}"


def test_long_system_prompt_is_cached(claude: anthropic.Anthropic) -> None:
    system = long_system("salt" + secrets.token_hex(6))
    first = create(claude, max_tokens=2, system=system, messages=[{"role": "user", "content": "Hi."}])
    assert 1200 <= prompt_tokens(first) <= 2500
    second = create(claude, max_tokens=2, system=system, messages=[{"role": "user", "content": "Hello there."}])
    assert second.usage.cache_read_input_tokens >= 0.8 * prompt_tokens(second)
    assert second.usage.input_tokens < first.usage.input_tokens


BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;{}"


def test_billing_pseudo_header_does_not_break_the_cache(claude: anthropic.Anthropic, server: ServerProcess) -> None:
    """Claude Code's first system block changes with every invocation: it is dropped, so
    the long system prompt after it is still a cached prefix."""
    long = long_system("billing" + secrets.token_hex(6))
    ask = [{"role": "user", "content": "Hi."}]

    def system(version: str, extra: str = "") -> list[dict[str, str]]:
        return [{"type": "text", "text": BILLING.format(version, extra)}, {"type": "text", "text": long}]

    dropped = server.health()["server"]["server_anthropic_pseudo_headers_dropped"]
    first = create(claude, max_tokens=2, system=system("1c0"), messages=ask)
    second = create(claude, max_tokens=2, system=system("c6f", " cch=abcd;"), messages=ask)
    assert second.usage.cache_read_input_tokens >= 0.95 * prompt_tokens(second)
    assert prompt_tokens(first) == prompt_tokens(second) == count(claude, system=long, messages=ask)
    assert server.health()["server"]["server_anthropic_pseudo_headers_dropped"] == dropped + 2
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert "kvcellar_server_anthropic_pseudo_headers_dropped_total" in metrics


# ---- fields that mean nothing here are accepted -------------------------------------------------


CLIENT_EXTRAS: dict[str, Any] = {
    "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi.", "cache_control": {"type": "ephemeral",
                                                                                          "ttl": "1h"}}]},
        {"role": "system", "content": "<system-reminder>Be kind.</system-reminder>"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "They greet me.", "signature": "sig"},
                                          {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "What's the weather in Paris?"},
    ],
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    "metadata": {"user_id": "user-1"},
    "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}},
              {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
    "service_tier": "auto",
    "output_config": {"effort": "low"},
}


def test_unused_fields_are_accepted(server: ServerProcess) -> None:
    r = server.post(MESSAGES, {"model": MODEL, "max_tokens": 5, **GREEDY, **CLIENT_EXTRAS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "message" and body["content"]
    counted = server.post(COUNT, {"model": MODEL, **CLIENT_EXTRAS})
    assert counted.status_code == 200, counted.text
    usage = body["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted.json()["input_tokens"]
    # the client tool is in the prompt, the server tool is not (it is ignored)
    without_server_tool = {**CLIENT_EXTRAS, "tools": [WEATHER]}
    assert server.post(COUNT, {"model": MODEL, **without_server_tool}).json() == counted.json()


def test_unused_fields_through_the_sdk(claude: anthropic.Anthropic) -> None:
    r = create(claude, max_tokens=5, thinking={"type": "enabled", "budget_tokens": 1024},
               metadata={"user_id": "user-1"}, system=CLIENT_EXTRAS["system"],
               messages=CLIENT_EXTRAS["messages"], tools=CLIENT_EXTRAS["tools"])
    assert r.content and r.stop_reason in ("end_turn", "max_tokens")


def test_server_tool_only_with_auto(server: ServerProcess) -> None:
    r = server.post(MESSAGES, {"model": MODEL, "max_tokens": 3, "messages": ASK, **GREEDY,
                               "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 200, r.text


# ---- errors ----------------------------------------------------------------------------------


def body(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for key, value in fields.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()
_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "get_weather",
                                          "input": {"city": "Oslo"}}]}

# (id, body, status, Anthropic error type, also for count_tokens)
ERRORS: list[tuple[str, Any, int, str, bool]] = [
    ("missing-max-tokens", body(max_tokens=_DROP), 400, "invalid_request_error", False),
    ("max-tokens-string", body(max_tokens="5"), 400, "invalid_request_error", False),
    ("max-tokens-zero", body(max_tokens=0), 400, "invalid_request_error", False),
    ("missing-messages", body(messages=_DROP), 400, "invalid_request_error", True),
    ("empty-messages", body(messages=[]), 400, "invalid_request_error", True),
    ("messages-string", body(messages="hi"), 400, "invalid_request_error", True),
    ("content-number", body(messages=[{"role": "user", "content": 5}]), 400, "invalid_request_error", True),
    ("bad-role", body(messages=[{"role": "tool", "content": "hi"}]), 400, "invalid_request_error", True),
    ("system-number", body(system=5), 400, "invalid_request_error", True),
    ("temperature-string", body(temperature="hot"), 400, "invalid_request_error", False),
    ("temperature-above-one", body(temperature=1.5), 400, "invalid_request_error", False),
    ("stop-sequences-numbers", body(stop_sequences=[1]), 400, "invalid_request_error", False),
    ("stream-string", body(stream="yes"), 400, "invalid_request_error", False),
    ("unknown-block-type", body(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]), 400,
     "invalid_request_error", True),
    ("image-block", body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
     400, "invalid_request_error", True),
    ("document-block", body(messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]),
     400, "invalid_request_error", True),
    ("orphan-tool-result", body(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "18C"}]}]), 400,
     "invalid_request_error", True),
    ("tool-result-answers-a-later-call", body(messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "18C"}]},
        _USE, {"role": "user", "content": "ok"}]), 400, "invalid_request_error", True),
    ("tool-use-in-a-user-turn", body(messages=[{"role": "user", "content": _USE["content"]}]), 400,
     "invalid_request_error", True),
    ("tool-result-with-an-image", body(messages=[{"role": "user", "content": "q"}, _USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": [{"type": "image", "source": {}}]}]}]), 400,
     "invalid_request_error", True),
    ("tool-use-input-not-object", body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a", "name": "f", "input": "x"}]}]), 400, "invalid_request_error", True),
    ("tool-choice-tool-without-name", body(tools=[WEATHER], tool_choice={"type": "tool"}), 400,
     "invalid_request_error", True),
    ("tool-choice-unknown-tool", body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_time"}), 400,
     "invalid_request_error", True),
    ("tool-choice-bogus-type", body(tools=[WEATHER], tool_choice={"type": "sometimes"}), 400,
     "invalid_request_error", True),
    ("tool-choice-any-without-tools", body(tool_choice={"type": "any"}), 400, "invalid_request_error", True),
    ("tool-schema-malformed", body(tools=[{"name": "f", "input_schema": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}]), 400, "invalid_request_error", True),
    ("tool-schema-not-object", body(tools=[{"name": "f", "input_schema": {"type": "array"}}]), 400,
     "invalid_request_error", True),
    ("duplicate-tools", body(tools=[WEATHER, WEATHER]), 400, "invalid_request_error", True),
    ("output-format-schema-malformed", body(output_config={"format": {"type": "json_schema", "schema": {"type": 5}}}),
     400, "invalid_request_error", False),
    ("prompt-over-context", body(messages=[{"role": "user", "content": "hello " * 9000}]), 400,
     "invalid_request_error", False),
    ("prompt-over-context-streamed", body(stream=True, messages=[{"role": "user", "content": "hello " * 9000}]), 400,
     "invalid_request_error", False),
    ("unknown-model", body(model="no-such-model"), 404, "not_found_error", True),
    ("unknown-model-streamed", body(model="no-such-model", stream=True), 404, "not_found_error", False),
    ("malformed-json", b'{"model": ', 400, "invalid_request_error", True),
    ("lone-surrogate", b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800"}]}'
     % MODEL.encode(), 400, "invalid_request_error", True),
]


def send(server: ServerProcess, path: str, payload: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    if isinstance(payload, bytes):
        return httpx.post(server.url + path, content=payload, timeout=60,
                          headers={"Content-Type": "application/json", **(headers or {})})
    return httpx.post(server.url + path, json=payload, headers=headers, timeout=60)


def assert_anthropic_error(r: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    payload = r.json()
    assert set(payload) == {"type", "error"} and payload["type"] == "error", payload
    err = payload["error"]
    assert set(err) == {"type", "message"}, err
    assert err["type"] == error_type, err
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize(("payload", "status", "error_type", "counted"), [c[1:] for c in ERRORS],
                         ids=[c[0] for c in ERRORS])
def test_errors_in_anthropic_shape(server: ServerProcess, payload: Any, status: int, error_type: str,
                                   counted: bool) -> None:
    assert_anthropic_error(send(server, MESSAGES, payload), status, error_type)
    if counted:  # the same prompt problem, asked of count_tokens (which has no max_tokens)
        if isinstance(payload, dict):
            payload = {k: v for k, v in payload.items() if k != "max_tokens"}
        assert_anthropic_error(send(server, COUNT, payload), status, error_type)


def test_error_messages_say_what_is_wrong(server: ServerProcess) -> None:
    def message(payload: Any) -> str:
        return assert_anthropic_error(send(server, MESSAGES, payload), 400, "invalid_request_error")["message"]

    assert "max_tokens" in message(body(max_tokens=_DROP))
    assert "'image'" in message(body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]))
    assert "toolu_nowhere" in message(body(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "18C"}]}]))
    assert "8192" in message(body(messages=[{"role": "user", "content": "hello " * 9000}]))


def test_unknown_block_type_is_named(server: ServerProcess) -> None:
    err = assert_anthropic_error(send(server, MESSAGES, body(messages=[{"role": "user", "content": [
        {"type": "video", "url": "x"}]}])), 400, "invalid_request_error")
    assert "video" in err["message"]


def test_sdk_raises_typed_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        claude.messages.create(model="no-such-model", max_tokens=2, messages=ASK)
    assert not_found.value.status_code == 404
    assert not_found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def test_unknown_route_under_messages(server: ServerProcess) -> None:
    assert_anthropic_error(send(server, MESSAGES + "/batches", body()), 404, "not_found_error")


@pytest.mark.parametrize(("status", "error_type"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (500, "api_error"), (503, "overloaded_error"),
    (504, "timeout_error"), (405, "invalid_request_error"),
])
def test_error_type_by_status(status: int, error_type: str) -> None:
    err = errors.APIError(status, "message").anthropic_body()
    assert err == {"type": "error", "error": {"type": error_type, "message": "message"}}


def test_no_internal_errors(server: ServerProcess) -> None:
    server.wait_idle()
    assert server.health()["server"]["server_internal_errors"] == 0


# ---- API key ---------------------------------------------------------------------------------

API_KEY = "sk-kvcellar-anthropic-test"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("anthropic-keyed"), api_key=API_KEY, models_dir=models_dir).start()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.mark.slow
def test_api_key(keyed_server: ServerProcess) -> None:
    url = keyed_server.url
    ok = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=120.0)  # sends x-api-key
    assert ok.messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens == 2
    assert ok.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    bearer = anthropic.Anthropic(base_url=url, auth_token=API_KEY, max_retries=0, timeout=120.0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=ASK).content
    wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0, timeout=120.0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert exc.value.status_code == 401 and exc.value.body["error"]["type"] == "authentication_error"
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": ""}):
        for path in (MESSAGES, COUNT):
            r = httpx.post(url + path, json=body(), headers=headers, timeout=60)
            assert_anthropic_error(r, 401, "authentication_error")
    r = httpx.post(url + MESSAGES, json=body(), headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 200, r.text
