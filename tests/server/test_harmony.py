"""gpt-oss's harmony format (server/harmony.py): its output read as reasoning (the analysis
channel), content and tool calls whatever the cut into pieces; forced calls in its own
syntax; and a served gpt-oss (tiny, random, with harmony's special tokens and a harmony chat
template) answering a forced call on all three APIs."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcellar.server.harmony import HarmonyReader, template_is_harmony
from kvcellar.server.tools.parsers import collect
from tests.helpers import ServerProcess

SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
THINK = "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."

# output -> (reasoning, content, calls)
OUTPUTS = [
    (THINK + CALL, "The user wants the weather; call the tool.", None, [("get_weather", '{"city": "Paris"}')]),
    (THINK + FINAL, "The user wants the weather; call the tool.", "It is sunny in Paris.", []),
    ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{}", "", None,
     [("get_weather", "{}")]),
    ("<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{\"path\": \"/\"}", "",
     '{"path": "/"}', []),  # a tool the request did not offer: its body is no call
    ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL, "", "Checking.",
     [("get_weather", '{"city": "Paris"}')]),
    ("Plain text, no header <|end|>.", "", "Plain text, no header <|end|>.", []),
    ("<|channel|>analysis<|message|>cut short by max_tok", "cut short by max_tok", "", []),
]


def read(text: str, pieces: list[str]) -> tuple[str, str | None, list[tuple[str, str]]]:
    reader = HarmonyReader(["get_weather"])
    deltas = [reader.feed(p) for p in pieces] + [reader.finish()]
    parsed = collect(deltas)
    return "".join(d.reasoning for d in deltas), parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), OUTPUTS, ids=range(len(OUTPUTS)))
def test_the_reading_is_the_same_for_every_cut(text: str, reasoning: str, content: str | None,
                                               calls: list[tuple[str, str]]) -> None:
    want = (reasoning, content, calls)
    assert read(text, [text]) == want
    parsed = HarmonyReader(["get_weather"]).parse(text)
    assert (parsed.reasoning or "", parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]) == want
    for a, b in itertools.combinations(range(0, len(text) + 1, 3), 2):
        assert read(text, [text[:a], text[a:b], text[b:]]) == want, (a, b)
    assert read(text, list(text)) == want


def test_harmony_templates_are_told_apart() -> None:
    assert template_is_harmony(HARMONY_TEMPLATE)
    assert not template_is_harmony("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}")


# ---- a served gpt-oss -------------------------------------------------------------------------------------

# The harmony format as gpt-oss's template writes it, cut down: tools as a developer message,
# an assistant turn's reasoning (``thinking``) on the analysis channel, calls to functions.NAME.
HARMONY_TEMPLATE = """\
<|start|>system<|message|>You are a helpful assistant.
# Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{%- for tool in tools %}
// {{ tool.function.description | default('') }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- for tc in m.tool_calls or [] %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json\
<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name | default('tool') }} to=assistant<|channel|>commentary\
<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
MODEL = "tiny-gpt-oss"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    from tests._models import embedded
    from tests.integration.test_gpt_oss import gpt_oss

    root = tmp_path_factory.mktemp("harmony")
    folder = root / MODEL
    tokenizer = embedded("float32").tokenizer
    tokenizer.save_pretrained(folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(folder)
    model = gpt_oss(len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    model.save_pretrained(folder)
    server = ServerProcess(root / "cache", "--model", str(folder), models_dir=models_dir).start()
    try:
        yield server
    finally:
        assert server.stop() == 0


def check_call(name: str, arguments: Any) -> None:
    assert name == "get_weather"
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(value["city"], str) and len(value["city"]) <= 20


def test_a_forced_call_in_harmony_on_every_api(served: ServerProcess) -> None:
    assert served.health()["chat_format"] == {"tool_calls": "harmony", "reasoning": "harmony"}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = served.client().chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                                max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((call),) = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)

    response = served.client().responses.create(
        model=MODEL, input="What is the weather in Paris?", max_output_tokens=60, temperature=0,
        tools=[{"type": "function", **WEATHER["function"]}], tool_choice={"type": "function", "name": "get_weather"})
    (item,) = [o for o in response.output if o.type == "function_call"]
    check_call(item.name, item.arguments)

    import anthropic

    claude = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    message = claude.messages.create(
        model=MODEL, max_tokens=60, messages=ask, extra_body={"temperature": 0}, tool_choice={"type": "any"},
        tools=[{"name": "get_weather", "description": "The weather in a city.",
                "input_schema": WEATHER["function"]["parameters"]}])
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    check_call(use.name, use.input)

    # The call and its result fed back: rendered in harmony, turn 2 reads turn 1's prompt from the cache.
    turn2 = [*ask, {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
                    "tool_calls": [{"id": call.id, "type": "function", "function": {
                        "name": call.function.name, "arguments": call.function.arguments}}]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = served.client().chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER], max_tokens=4,
                                                    temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 16


@pytest.fixture(scope="module")
def served_gguf(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    """A gpt-oss GGUF as llama.cpp writes them: MXFP4 experts, harmony's special tokens (the
    end of a turn ``<|return|>``), its chat template, the ``gpt-4o`` pre-tokenizer."""
    from tests.artifacts.gguf_files import gpt_oss_types, write_gguf

    root = tmp_path_factory.mktemp("harmony-gguf")
    path = write_gguf(root / f"{MODEL}.gguf", arch="gpt-oss", seed=3, hidden=256, layers=2, heads=4, kv_heads=2,
                      experts=4, experts_used=2, expert_ffn=128, types=gpt_oss_types, context=4096,
                      head_scale=0.5, chat_template=HARMONY_TEMPLATE, specials=SPECIALS, eos="<|return|>")
    server = ServerProcess(root / "cache", "--model", str(path), models_dir=models_dir).start()
    try:
        yield server
    finally:
        assert server.stop() == 0


def test_a_gpt_oss_gguf_answers_a_forced_call_in_harmony(served_gguf: ServerProcess) -> None:
    health = served_gguf.health()
    assert health["chat_format"] == {"tool_calls": "harmony", "reasoning": "harmony"}
    assert health["linears"]["experts_mxfp4"] == 2 * 4 * 2  # layers x experts x (gate-up, down)
    if health["kernel_dtype"] == "int8" and health["cpu_kernels"]:  # kept as panels (stored)
        assert health["linears"]["panels"] >= 2 * 4 * 2
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = served_gguf.client().chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                                     tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((call),) = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)
    # turn 2 (the call and its result fed back) reads turn 1's prompt from the cache
    fed_back = {"id": call.id, "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments}}
    turn2 = [*ask, {"role": "assistant", "content": None, "tool_calls": [fed_back]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = served_gguf.client().chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER], max_tokens=4,
                                                         temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 16
