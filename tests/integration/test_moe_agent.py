"""A coding agent's conversation with a mixture-of-experts model served from GGUF.

``kvcellar serve`` on a qwen3moe GGUF (Qwen3-Coder-30B-A3B's architecture, small and random)
whose chat template writes Qwen3-Coder's tool markup, under the default weights (``auto``):
a call forced in that markup on each API is valid against its tool's schema; turn 2 of a
conversation (system + tools + the call and its result fed back) reads at least 80 % of its
prompt from the cache, in the same server and after a restart (from the SSD), and gives what
the same computed cold gives (a request whose cache salt no block carries)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

from tests._models import moe_gguf
from tests.helpers import ServerProcess

MODEL = "tiny-qwen3moe"
READ = {"type": "object", "properties": {"path": {"type": "string"}, "max_lines": {"type": "integer", "minimum": 1}},
        "required": ["path"]}
EDIT = {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                         "text": {"type": "string"}}, "required": ["path", "line", "text"]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                           "parameters": READ}},
         {"type": "function", "function": {"name": "edit_file", "description": "Replace one line of a file.",
                                           "parameters": EDIT}}]
SCHEMAS = {"read_file": READ, "edit_file": EDIT}
SYSTEM = ("You are a coding agent working in a Rust repository. Read before you edit; keep changes small; "
          "run the tests after each edit. ") * 3
ASK = "The parser panics on empty input. Find the bug in src/parse.rs."
FORCED_TOKENS = 160  # the markup a byte-level vocabulary spells a character at a time, and a path


def serve(cache: Path, *args: str, models_dir: Path) -> ServerProcess:
    return ServerProcess(cache, "--model", str(moe_gguf()), "--weights", "auto", *args, models_dir=models_dir).start()


def valid(name: str, arguments: Any) -> dict[str, Any]:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMAS[name])
    return value


def first_turn() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]


def second_turn(call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
    return [*first_turn(),
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id,
             "content": "fn parse(s: &str) -> Expr {\n    let first = s.chars().next().unwrap();\n    ...\n}"}]


def chat(server: ServerProcess, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return server.client().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                                   **kwargs)


def forced_calls_on_every_api(server: ServerProcess) -> None:
    health = server.health()
    experts = sum(v for k, v in health["linears"].items() if k.startswith("experts_"))
    assert experts == 3 * 8 * 2  # every layer's 8 experts, a gate-up and a down linear each
    if health["weights"] != "full":
        assert health["linears"][f"experts_{health['weights']}"] == experts
    r = chat(server, first_turn(), tool_choice="required", max_tokens=FORCED_TOKENS)
    assert r.choices[0].finish_reason == "tool_calls", r
    ((call),) = r.choices[0].message.tool_calls
    valid(call.function.name, call.function.arguments)
    assert r.choices[0].message.content is None

    named = server.client().responses.create(
        model=MODEL, input=ASK, instructions=SYSTEM, temperature=0, max_output_tokens=FORCED_TOKENS,
        tools=[{"type": "function", **t["function"]} for t in TOOLS],
        tool_choice={"type": "function", "name": "edit_file"})
    calls = [o for o in named.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["edit_file"] and named.status == "completed"
    valid("edit_file", calls[0].arguments)

    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": ASK}], max_tokens=FORCED_TOKENS,
        extra_body={"temperature": 0}, tool_choice={"type": "any"},
        tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in TOOLS])
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    valid(uses[0].name, uses[0].input)


def test_forced_calls_and_turn_two_from_the_cache_in_the_server_and_after_a_restart(tmp_path: Path,
                                                                                    models_dir: Path) -> None:
    cache = tmp_path / "cache"
    server = serve(cache, models_dir=models_dir)
    try:
        forced_calls_on_every_api(server)
        r1 = chat(server, first_turn(), tool_choice="required", max_tokens=FORCED_TOKENS)
        ((call),) = r1.choices[0].message.tool_calls
        turn2 = second_turn(call.id, call.function.name, call.function.arguments)
        r2 = chat(server, turn2, max_tokens=8)
        assert r2.usage.prompt_tokens_details.cached_tokens >= 0.8 * r2.usage.prompt_tokens
    finally:
        assert server.stop() == 0
    restarted = serve(cache, models_dir=models_dir)
    try:
        again = chat(restarted, turn2, max_tokens=8)
        assert again.usage.prompt_tokens_details.cached_tokens >= 0.8 * again.usage.prompt_tokens
        assert restarted.health()["tiers"]["ssd"]["counters"]["ssd_load_hits"] > 0
        # Computed cold: a salt no cached block carries (what a server without a cache computes).
        reference = chat(restarted, turn2, max_tokens=8, extra_body={"cache_salt": "uncached reference"})
        assert reference.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert restarted.stop() == 0
    for got in (r2, again):
        assert got.choices[0].message.content == reference.choices[0].message.content
        assert got.choices[0].message.tool_calls == reference.choices[0].message.tool_calls
