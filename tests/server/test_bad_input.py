"""Every kind of bad input gets a 4xx with OpenAI's error body, never a 500 or a hang."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import MODEL, ServerProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def _body(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    body = dict(base)
    for key, value in fields.items():
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def chat_body(**fields: Any) -> dict[str, Any]:
    return _body({"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 2}, fields)


def completion_body(**fields: Any) -> dict[str, Any]:
    return _body({"model": MODEL, "prompt": "hi", "max_tokens": 2}, fields)


_DROP = object()

def _tool(name: str = "get_weather", parameters: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


_TOOL = _tool(parameters={"type": "object", "properties": {"city": {"type": "string"}}})

# (id, path, body (dict -> JSON, bytes -> raw), expected status, expected param or None for "any")
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("malformed-json", CHAT, b'{"model": ', 400, None),
    ("json-not-object", CHAT, b"[1, 2, 3]", 400, None),
    ("json-null", CHAT, b"null", 400, None),
    ("invalid-utf8", CHAT, b'{"model": "\xff\xfe", "messages": []}', 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("nan-literal", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
     % MODEL.encode(), 400, "temperature"),
    ("lone-surrogate-content", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udc80b"}]}'
     % MODEL.encode(), 400, "messages[0].content"),
    ("lone-surrogate-model", CHAT, b'{"model": "x\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 400,
     "model"),
    ("lone-surrogate-tool", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
     b'"tools": [{"type": "function", "function": {"name": "f\\ud800"}}]}' % MODEL.encode(), 400,
     "tools[0].function.name"),
    ("lone-surrogate-prompt", COMPLETIONS, b'{"model": "%s", "prompt": ["ok", "a\\ud800"]}' % MODEL.encode(),
     400, "prompt[1]"),
    ("missing-model", CHAT, chat_body(model=_DROP), 400, "model"),
    ("model-wrong-type", CHAT, chat_body(model=7), 400, "model"),
    ("unknown-model", CHAT, chat_body(model="gpt-4o"), 404, "model"),
    ("missing-messages", CHAT, chat_body(messages=_DROP), 400, "messages"),
    ("empty-messages", CHAT, chat_body(messages=[]), 400, "messages"),
    ("messages-string", CHAT, chat_body(messages="hello"), 400, "messages"),
    ("message-no-role", CHAT, chat_body(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("message-bad-role", CHAT, chat_body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("content-number", CHAT, chat_body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("content-image", CHAT, chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages[0].content[0]"),
    ("max-tokens-zero", CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CHAT, chat_body(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-string", CHAT, chat_body(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-float", CHAT, chat_body(max_tokens=1.5), 400, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, chat_body(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("prompt-over-context", CHAT, chat_body(messages=[{"role": "user", "content": "hello " * 9000}]), 400, None),
    ("temperature-negative", CHAT, chat_body(temperature=-0.5), 400, "temperature"),
    ("temperature-too-high", CHAT, chat_body(temperature=2.5), 400, "temperature"),
    ("temperature-string", CHAT, chat_body(temperature="hot"), 400, "temperature"),
    ("top-p-zero", CHAT, chat_body(top_p=0), 400, "top_p"),
    ("top-p-above-one", CHAT, chat_body(top_p=1.5), 400, "top_p"),
    ("top-k-negative", CHAT, chat_body(top_k=-3), 400, "top_k"),
    ("n-zero", CHAT, chat_body(n=0), 400, "n"),
    ("n-absurd", CHAT, chat_body(n=100000), 400, "n"),
    ("n-over-server-limit", CHAT, chat_body(n=17), 400, "n"),
    ("stop-number", CHAT, chat_body(stop=5), 400, "stop"),
    ("stop-too-many", CHAT, chat_body(stop=[str(i) for i in range(40)]), 400, "stop"),
    ("stop-list-of-numbers", CHAT, chat_body(stop=[1, 2]), 400, "stop"),
    ("stop-too-long", CHAT, chat_body(stop=["x" * 5000]), 400, "stop"),
    ("top-logprobs-too-many", CHAT, chat_body(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat_body(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs-string", CHAT, chat_body(logprobs="yes"), 400, "logprobs"),
    ("stream-string", CHAT, chat_body(stream="yes"), 400, "stream"),
    ("stream-options-wrong", CHAT, chat_body(stream=True, stream_options={"include_usage": "y"}), 400,
     "stream_options.include_usage"),
    ("presence-penalty-high", CHAT, chat_body(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty-low", CHAT, chat_body(frequency_penalty=-3), 400, "frequency_penalty"),
    ("seed-string", CHAT, chat_body(seed="abc"), 400, "seed"),
    ("seed-too-big", CHAT, chat_body(seed=2**70), 400, "seed"),
    ("logit-bias", CHAT, chat_body(logit_bias={"50": 10}), 400, "logit_bias"),
    ("tool-choice-bogus", CHAT, chat_body(tools=[_TOOL], tool_choice="bogus"), 400, "tool_choice"),
    ("tool-choice-unknown-name", CHAT, chat_body(tools=[_TOOL], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), 400, "tool_choice"),
    ("tool-choice-without-tools", CHAT, chat_body(tool_choice="required"), 400, "tool_choice"),
    ("tool-schema-malformed", CHAT, chat_body(tools=[_tool(parameters={"type": "object", "properties": {
        "city": {"type": "strin"}}})]), 400, "tools[0].function.parameters"),
    ("tool-schema-not-object", CHAT, chat_body(tools=[_tool(parameters={"type": "array"})]), 400,
     "tools[0].function.parameters"),
    ("tool-schema-uncompilable", CHAT, chat_body(tools=[_tool(parameters={"type": "object", "properties": {
        "city": {"type": "string", "pattern": "(?<=x)y"}}})], tool_choice="required"), 400,
     "tools[0].function.parameters"),
    ("tool-duplicate-name", CHAT, chat_body(tools=[_TOOL, _TOOL]), 400, "tools[1].function.name"),
    ("tool-bad-name", CHAT, chat_body(tools=[_tool(name="get weather!")]), 400, "tools[0].function.name"),
    ("tool-wrong-type", CHAT, chat_body(tools=[{"type": "retrieval"}]), 400, "tools[0].type"),
    ("tool-message-without-id", CHAT, chat_body(messages=[{"role": "user", "content": "hi"},
                                                          {"role": "tool", "content": "18C"}]), 400,
     "messages[1].tool_call_id"),
    ("assistant-call-bad-arguments-type", CHAT, chat_body(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]), 400,
     "messages[0].tool_calls[0].function.arguments"),
    ("response-format-schema-missing", CHAT, chat_body(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("response-format-schema-malformed", CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": "a"}}}), 400, "response_format.json_schema.schema"),
    ("response-format-schema-uncompilable", CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}}), 400, "response_format.json_schema.schema"),
    ("completion-response-format-malformed", COMPLETIONS, completion_body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), 400,
     "response_format.json_schema.schema"),
    ("response-format-bad", CHAT, chat_body(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("stop-token-ids-strings", CHAT, chat_body(stop_token_ids=["a"]), 400, "stop_token_ids[0]"),
    ("cache-salt-number", CHAT, chat_body(cache_salt=5), 400, "cache_salt"),
    ("timeout-zero", CHAT, chat_body(first_token_timeout=0), 400, "first_token_timeout"),
    ("completion-missing-prompt", COMPLETIONS, completion_body(prompt=_DROP), 400, "prompt"),
    ("completion-empty-prompt", COMPLETIONS, completion_body(prompt=""), 400, "prompt"),
    ("completion-empty-list", COMPLETIONS, completion_body(prompt=[]), 400, "prompt"),
    ("completion-empty-token-list", COMPLETIONS, completion_body(prompt=[[]]), 400, "prompt"),
    ("completion-mixed-list", COMPLETIONS, completion_body(prompt=["a", 1]), 400, "prompt"),
    ("completion-token-out-of-vocab", COMPLETIONS, completion_body(prompt=[10**9]), 400, "prompt"),
    ("completion-token-negative", COMPLETIONS, completion_body(prompt=[-1]), 400, "prompt"),
    ("completion-suffix", COMPLETIONS, completion_body(suffix="tail"), 400, "suffix"),
    ("completion-echo-logprobs", COMPLETIONS, completion_body(echo=True, logprobs=1), 400, "echo"),
    ("completion-best-of", COMPLETIONS, completion_body(best_of=3), 400, "best_of"),
    ("completion-logprobs-high", COMPLETIONS, completion_body(logprobs=99), 400, "logprobs"),
    ("completion-over-context", COMPLETIONS, completion_body(prompt="hello " * 9000), 400, "prompt"),
    ("completion-too-many-choices", COMPLETIONS, completion_body(prompt=["a"] * 9, n=2), 400, "n"),
    ("completion-max-tokens-zero", COMPLETIONS, completion_body(max_tokens=0), 400, "max_tokens"),
]


def send(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"},
                          timeout=60)
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(server: ServerProcess, path: str, body: Any, status: int, param: str | None) -> None:
    assert_openai_error(send(server, path, body), status, param)


def test_empty_body_says_so(server: ServerProcess) -> None:
    err = assert_openai_error(send(server, CHAT, b""), 400)
    assert "body is empty" in err["message"] and "None" not in err["message"]


def test_context_length_code(server: ServerProcess) -> None:
    err = assert_openai_error(send(server, CHAT, chat_body(messages=[{"role": "user", "content": "hello " * 9000}])),
                              400, "messages")
    assert err["code"] == "context_length_exceeded"


def test_max_tokens_beyond_the_context_is_clamped_not_refused(server: ServerProcess) -> None:
    """Agents send max_tokens 32000 whatever the model (tests/engine/test_limits.py checks the
    exact clamp); only a prompt that does not fit by itself is a 400."""
    colors = [{"role": "user", "content": "Name three primary colors."}]  # greedy: a short reply, then EOS
    for max_tokens in (32000, 10**9):
        body = chat_body(max_tokens=max_tokens, temperature=0, messages=colors)
        r = send(server, CHAT, body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_oversized_body_is_refused_before_reading(server: ServerProcess) -> None:
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (17 << 20) + b'"}]}'
    assert_openai_error(send(server, CHAT, big), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(17):
            yield b"a" * (1 << 20)
        yield b'"}]}'

    try:
        r = httpx.post(server.url + CHAT, content=chunked(), headers={"Content-Type": "application/json"},
                       timeout=60)
    except httpx.RemoteProtocolError:
        pass  # the server answered 413 and closed while we were still sending: also fine
    else:
        assert_openai_error(r, 413)


def test_unknown_route_and_method(server: ServerProcess) -> None:
    assert_openai_error(httpx.get(server.url + "/v1/nope"), 404)
    assert_openai_error(httpx.get(server.url + CHAT), 405)


def test_escaped_surrogate_pair_is_fine(server: ServerProcess) -> None:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83c\\udf0a"}], "max_tokens": 2}'
    r = send(server, CHAT, body % MODEL.encode())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_declared_json_is_refused_in_each_apis_shape(server: ServerProcess, content_type) -> None:
    """What a web page can send without a CORS preflight (text/plain, a form, no type) never
    reaches the API: 415, in the shape of the API called."""
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(server.url + CHAT, content=json.dumps(chat_body()).encode(), headers=headers, timeout=60)
    assert_openai_error(r, 415)
    assert r.json()["error"]["code"] == "unsupported_media_type"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/messages", content=json.dumps(body).encode(), headers=headers, timeout=60)
    assert r.status_code == 415 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "application/json" in r.json()["error"]["message"]
    r = httpx.post(server.url + CHAT, content=json.dumps(chat_body()).encode(),
                   headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text


def test_server_survives_and_is_idle(server: ServerProcess) -> None:
    r = httpx.post(server.url + CHAT, json=chat_body(), timeout=60)
    assert r.status_code == 200
    server.wait_idle()
    assert server.health()["server"]["server_internal_errors"] == 0
