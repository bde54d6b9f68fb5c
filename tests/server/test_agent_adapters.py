"""The API adapters on what the real agents send (bodies recorded from Claude Code, Codex CLI and
opencode: tests/server/fixtures/agents/): every body is accepted, and what changes between an
agent's requests without changing the conversation (Claude Code's billing pseudo-header, Codex's
item ids and prompt_cache_key, a system message sent as blocks or as a string) never reaches the
prompt, so the next turn's prompt starts with the previous one and hits the cache."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvcellar.engine.tokenization import render_chat
from kvcellar.server.anthropic import adapter as anthropic
from kvcellar.server.anthropic.protocol import MessagesRequest
from kvcellar.server.internal import InternalRequest
from kvcellar.server.protocol import ChatCompletionRequest
from kvcellar.server.responses import adapter as responses
from kvcellar.server.responses.protocol import ResponsesRequest
from kvcellar.server.tools.render import ToolPrompting
from kvcellar.server.tools.request import plan_tools
from tests.server.agent_fixtures import body


@pytest.fixture(scope="module")
def tokenizer(model: Any) -> Any:
    return model.tokenizer


def rendered(tokenizer: Any, ireq: InternalRequest, *, generation_prompt: bool = True) -> str:
    prompting = ToolPrompting.probe(tokenizer)
    messages, kwargs = prompting.prepare(ireq.messages, ireq.tools.tools if ireq.tools else None)
    return render_chat(tokenizer, messages, add_generation_prompt=generation_prompt, **kwargs)


def claude(name: str) -> tuple[InternalRequest, int]:
    return anthropic.to_internal(MessagesRequest.model_validate(body(name)))


def codex(name: str) -> InternalRequest:
    ireq, _, _ = responses.to_internal(ResponsesRequest.model_validate(body(name)), [])
    return ireq


def test_claude_code_request_is_read_whole(tokenizer: Any) -> None:
    raw = body("claude_code_messages.json")
    ireq, dropped = claude("claude_code_messages.json")
    assert dropped == 1 and raw["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert ireq.messages[0]["role"] == "system" and "x-anthropic" not in ireq.messages[0]["content"]
    assert any(m["role"] == "system" for m in ireq.messages[1:])  # the environment entry inside messages
    assert ireq.tools is not None and ireq.tools.choice == "auto"
    assert len(ireq.tools.tools) == len(raw["tools"]) == 12
    assert ireq.max_tokens == 32000 and ireq.stream
    text = rendered(tokenizer, ireq)
    assert "x-anthropic-billing-header" not in text and "cc_version" not in text
    assert all(t["name"] in text for t in raw["tools"])


def test_claude_code_billing_header_of_another_session_renders_the_same_prompt(tokenizer: Any) -> None:
    other = copy.deepcopy(body("claude_code_messages.json"))
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.331.c6f; cc_entrypoint=sdk-cli; cch=0a1b2;"
    ireq_other, dropped = anthropic.to_internal(MessagesRequest.model_validate(other))
    assert dropped == 1
    assert rendered(tokenizer, ireq_other) == rendered(tokenizer, claude("claude_code_messages.json")[0])


@pytest.mark.parametrize("second", ["claude_code_messages_turn2.json", "claude_code_messages_tool_result.json"])
def test_claude_code_next_request_starts_with_the_previous_prompt(tokenizer: Any, second: str) -> None:
    first = rendered(tokenizer, claude("claude_code_messages.json")[0], generation_prompt=False)
    assert rendered(tokenizer, claude(second)[0]).startswith(first)


def test_codex_request_is_read_whole(tokenizer: Any) -> None:
    raw = body("codex_responses.json")
    ireq, names, _ = responses.to_internal(ResponsesRequest.model_validate(raw), [])
    namespaced = [t for t in raw["tools"] if t["type"] == "namespace"]
    functions = [t for t in raw["tools"] if t["type"] == "function"]
    assert namespaced and any(t["type"] == "web_search" for t in raw["tools"])
    inner = [f"{ns['name']}.{t['name']}" for ns in namespaced for t in ns["tools"]]
    assert ireq.tools is not None
    assert [t["function"]["name"] for t in ireq.tools.tools] == \
        [t["name"] for t in functions[:4]] + inner + [t["name"] for t in functions[4:]]
    assert set(names.namespaced) == set(inner)
    assert [m["role"] for m in ireq.messages] == ["system", "system", "user", "user"]
    assert ireq.max_tokens is None and ireq.stream
    text = rendered(tokenizer, ireq)
    for item in raw["input"]:  # item ids, the cache key and client metadata are not prompt text
        assert item["id"] not in text
    assert raw["prompt_cache_key"] not in text


@pytest.mark.parametrize("second", ["codex_responses_turn2.json", "codex_responses_tool_result.json"])
def test_codex_next_request_starts_with_the_previous_prompt(tokenizer: Any, second: str) -> None:
    first = rendered(tokenizer, codex("codex_responses.json"), generation_prompt=False)
    assert rendered(tokenizer, codex(second)).startswith(first)


def test_codex_new_item_ids_render_the_same_prompt(tokenizer: Any) -> None:
    other = copy.deepcopy(body("codex_responses.json"))
    for i, item in enumerate(other["input"]):
        item["id"] = f"msg_other_{i}"
    other["prompt_cache_key"] = "another-session"
    ireq, _, _ = responses.to_internal(ResponsesRequest.model_validate(other), [])
    assert rendered(tokenizer, ireq) == rendered(tokenizer, codex("codex_responses.json"))


@pytest.mark.parametrize("name", ["opencode_chat.json", "opencode_chat_title.json", "opencode_chat_turn2.json",
                                  "opencode_chat_tool_result.json"])
def test_opencode_requests_are_valid_chat_requests(name: str) -> None:
    req = ChatCompletionRequest.model_validate(body(name))
    if req.tools:
        plan = plan_tools(req)
        assert plan is not None and len(plan.tools) == len(req.tools)


def test_claude_code_2_1_197_request_is_read_whole(tokenizer: Any) -> None:
    """The older release's first request (recorded once): 24 tools, two with ``propertyNames``."""
    raw = body("claude_code_2_1_197_messages.json")
    ireq, dropped = claude("claude_code_2_1_197_messages.json")
    assert dropped == 1 and ireq.tools is not None and ireq.tools.choice == "auto"
    assert len(ireq.tools.tools) == len(raw["tools"]) == 24
    assert "propertyNames" in json.dumps(ireq.tools.tools[14]["function"]["parameters"])
    assert all(t["name"] in rendered(tokenizer, ireq) for t in raw["tools"])
