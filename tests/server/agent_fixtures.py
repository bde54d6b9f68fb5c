"""The recorded agent requests (tests/server/fixtures/agents/, see its README) and their tools
as the server sees them: OpenAI-shaped function tools, converted by each API's own adapter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcellar.server.anthropic import adapter as anthropic
from kvcellar.server.anthropic.protocol import MessagesRequest
from kvcellar.server.protocol import ChatCompletionRequest
from kvcellar.server.responses import adapter as responses
from kvcellar.server.responses.protocol import ResponsesRequest
from kvcellar.server.tools.request import plan_tools

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
# Each agent's first request that offers tools, by the API it speaks.
AGENT_REQUESTS = {
    "claude_code_2.1.197": ("messages", "claude_code_2_1_197_messages.json"),
    "claude_code_2.1.331": ("messages", "claude_code_messages.json"),
    "codex_0.169.0": ("responses", "codex_responses.json"),
    "opencode_1.18.33": ("chat", "opencode_chat.json"),
}


def body(name: str) -> dict[str, Any]:
    data = json.loads((FIXTURES / name).read_text())
    return data.get("body", data)


def agent_tools(agent: str) -> list[dict[str, Any]]:
    """The function tools of ``agent``'s recorded request, OpenAI-shaped (``{"type": "function",
    "function": {"name", "parameters", ...}}``), in the request's order."""
    api, name = AGENT_REQUESTS[agent]
    raw = body(name)
    if api == "messages":
        ireq, _ = anthropic.to_internal(MessagesRequest.model_validate(raw))
    elif api == "responses":
        ireq, _, _ = responses.to_internal(ResponsesRequest.model_validate(raw), [])
    else:
        plan = plan_tools(ChatCompletionRequest.model_validate(raw))
        assert plan is not None
        return plan.tools
    assert ireq.tools is not None
    return ireq.tools.tools
