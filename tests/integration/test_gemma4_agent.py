"""A coding agent's conversation with a Gemma 4 model served from a HF folder.

``kvcellar serve`` on a tiny gemma-4-26B-A4B-shaped folder (experts beside the dense MLP, wider
global heads) whose tokenizer holds Gemma 4's markup as special tokens and whose chat template
writes Gemma 4's turns, tool declarations, calls (``<|tool_call>call:NAME{ARGS}<tool_call|>``,
strings between ``<|"|>``) and results, under the default weights (``auto``): a call forced
on each API is valid against its tool's schema; turn 2 (the call and its result fed back,
re-rendered by the template as the model wrote them) reads at least 80 % of its prompt from
the cache and gives what the same computed cold gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._models import embedded
from tests.helpers import ServerProcess
from tests.integration.agent_turns import RULES, Agent
from tests.integration.test_gemma4 import MOE, gemma4

MODEL = "tiny-gemma4"
SYSTEM = RULES * 12  # an agent's long system prompt against a short call: turn 1 is most of turn 2
FORCED_TOKENS = 64
SHORT_CALL_TOKENS = 48  # a call as short as an agent's usual one (a random model's strings run long)
MARKUP = ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
          "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>"]
# Gemma 4's wire format as its chat template writes it: a system turn with the tool
# declarations, the model's reasoning in its thought channel (an empty one where thinking is
# off), its calls with their arguments in dictsort order, each result right after them in the
# same model turn (which the model then goes on writing).
TEMPLATE = r"""
{%- macro value(v) -%}
{%- if v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is boolean -%}{{ 'true' if v else 'false' }}
{%- elif v is mapping -%}{
{%- for k, x in v | dictsort -%}{{ k }}:{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}
}
{%- elif v is sequence -%}[ {%- for x in v -%}{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%} ]
{%- else -%}{{ v }}{%- endif -%}
{%- endmacro -%}
{{- bos_token or '' -}}
{%- set rest = messages -%}
{%- if tools or messages[0].role == 'system' -%}
<|turn>system
{% if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% set rest = messages[1:] %}{% endif -%}
{%- for tool in tools or [] -%}
<|tool>declaration:{{ tool.function.name }}{description:<|"|>{{ tool.function.description }}<|"|>,parameters:
{{- value(tool.function.parameters) }}}<tool|>
{%- endfor -%}
<turn|>
{% endif -%}
{%- set ns = namespace(last='') -%}
{%- for message in rest -%}
{%- if message.role == 'tool' -%}
<|tool_response>response:{{ message.name or 'tool' }}{value:<|"|>{{ message.content }}<|"|>}<tool_response|>
{%- else -%}
{%- if ns.last != 'tool' %}<|turn>{{ 'model' if message.role == 'assistant' else message.role }}
{% endif -%}
{%- if message.reasoning_content %}<|channel>thought
{{ message.reasoning_content }}
<channel|>{% endif -%}
{%- for call in message.tool_calls or [] -%}
<|tool_call>call:{{ call.function.name }}{
{%- for k, x in call.function.arguments | dictsort -%}{{ k }}:{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}
}<tool_call|>
{%- endfor -%}
{%- if message.content is string %}{{ message.content | trim }}{% endif -%}
{%- if not message.tool_calls %}<turn|>
{% endif -%}
{%- endif -%}
{%- set ns.last = 'tool' if message.role == 'tool' or message.tool_calls else message.role -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.last != 'tool' %}<|turn>model
{% if not enable_thinking %}<|channel>thought
<channel|>{% endif %}{% endif -%}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import copy

    tokenizer = copy.deepcopy(embedded("float32").tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKUP})
    tokenizer.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("gemma4-agent")
    model = gemma4(len(tokenizer), **MOE)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<turn|>", "<|tool_response>")]
    model.config.eos_token_id = ends
    model.generation_config.eos_token_id = ends
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def serve(folder: Path, cache: Path, models_dir: Path) -> ServerProcess:
    return ServerProcess(cache, "--model", str(folder), "--weights", "auto", "--served-model-name", MODEL,
                         models_dir=models_dir).start()


def test_forced_calls_and_turn_two_from_the_cache(folder: Path, tmp_path: Path, models_dir: Path) -> None:
    """(A restart serving Gemma 4's blocks from the SSD: test_gemma4.py.)"""
    server = serve(folder, tmp_path / "cache", models_dir)
    agent = Agent(server, MODEL, SYSTEM)
    try:
        assert server.health()["chat_format"] == {"tool_calls": "gemma4", "reasoning": "gemma4"}
        agent.forced_calls_on_every_api(FORCED_TOKENS)
        r1 = agent.chat(agent.first_turn(), tool_choice="required", max_tokens=SHORT_CALL_TOKENS)
        ((call),) = r1.choices[0].message.tool_calls
        turn2 = agent.second_turn(call.id, call.function.name, call.function.arguments)
        r2 = agent.chat(turn2, max_tokens=8)
        assert r2.usage.prompt_tokens_details.cached_tokens >= 0.8 * r2.usage.prompt_tokens
        # Every block of turn 1's prompt up to its generation prompt, whose empty thought
        # channel the template leaves out of a model turn it writes back (as Gemma 4's does).
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 16
        # Computed cold: a salt no cached block carries (what a server without a cache computes).
        reference = agent.chat(turn2, max_tokens=8, extra_body={"cache_salt": "uncached reference"})
        assert reference.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert server.stop() == 0
    assert r2.choices[0].message.content == reference.choices[0].message.content
    assert r2.choices[0].message.tool_calls == reference.choices[0].message.tool_calls
