"""Tools in the prompt: the model's template when it renders them, else the fallback format."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvcellar.engine.tokenization import render_chat
from kvcellar.server.tools.render import ToolPrompting, fallback_messages
from tests._models import embedded

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_a", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "-3 C"},
    {"role": "tool", "tool_call_id": "call_a", "content": "snow"},
    {"role": "user", "content": "Thanks"},
]

# A minimal Qwen/Hermes-style template that renders tools itself.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:{{ c.function.arguments.city }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return embedded().tokenizer


def test_smollm2_template_ignores_tools_so_the_fallback_is_used(tokenizer: Any) -> None:
    prompting = ToolPrompting.probe(tokenizer)
    assert not prompting.template_renders_tools
    assert prompting.family == "hermes"
    messages, kwargs = prompting.prepare(HISTORY, [TOOL])
    assert kwargs == {}
    text = render_chat(tokenizer, messages)
    assert text.count("<tools>\n{") == 1 and '"name": "get_weather"' in text
    assert text.index("Be brief.") < text.index("<tools>")  # appended to the caller's system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 3  # results share a turn
    assert '"content": "-3 C"' in text and "<|im_start|>tool" not in text


def test_fallback_is_deterministic_and_keeps_the_callers_messages(tokenizer: Any) -> None:
    original = copy.deepcopy(HISTORY)
    assert fallback_messages(HISTORY, [TOOL]) == fallback_messages(HISTORY, [TOOL])
    assert original == HISTORY
    without_system = fallback_messages(HISTORY[1:2], [TOOL])
    assert without_system[0]["role"] == "system" and "<tools>" in without_system[0]["content"]


def test_a_template_that_renders_tools_gets_them(tokenizer: Any) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    prompting = ToolPrompting.probe(tok)
    assert prompting.template_renders_tools
    assert prompting.family == "hermes"  # the template writes <tool_call>
    messages, kwargs = prompting.prepare(HISTORY, [TOOL])
    text = render_chat(tok, messages, **kwargs)
    assert "TOOLS:get_weather;" in text and "<tools>" not in text
    assert "<tool_call>get_weather:Oslo</tool_call>" in text  # arguments reach the template as a dict
    assert json.loads(HISTORY[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
