"""A coding agent's conversation with a mixture-of-experts model served from GGUF.

``kvcellar serve`` on a qwen3moe GGUF (Qwen3-Coder-30B-A3B's architecture, small and random)
whose chat template writes Qwen3-Coder's tool markup, under the default weights (``auto``):
a call forced in that markup on each API is valid against its tool's schema; turn 2 of a
conversation (system + tools + the call and its result fed back) reads at least 80 % of its
prompt from the cache, in the same server and after a restart (from the SSD), and gives what
the same computed cold gives (a request whose cache salt no block carries)."""

from __future__ import annotations

from pathlib import Path

from tests._models import moe_gguf
from tests.helpers import ServerProcess
from tests.integration.agent_turns import RULES, Agent

MODEL = "tiny-qwen3moe"
SYSTEM = RULES * 3
FORCED_TOKENS = 160  # the markup a byte-level vocabulary spells a character at a time, and a path


def serve(cache: Path, *args: str, models_dir: Path) -> ServerProcess:
    return ServerProcess(cache, "--model", str(moe_gguf()), "--weights", "auto", *args, models_dir=models_dir).start()


def test_forced_calls_and_turn_two_from_the_cache_in_the_server_and_after_a_restart(tmp_path: Path,
                                                                                    models_dir: Path) -> None:
    cache = tmp_path / "cache"
    server = serve(cache, models_dir=models_dir)
    agent = Agent(server, MODEL, SYSTEM)
    try:
        health = server.health()
        experts = sum(v for k, v in health["linears"].items() if k.startswith("experts_"))
        assert experts == 3 * 8 * 2  # every layer's 8 experts, a gate-up and a down linear each
        if health["weights"] != "full":
            assert health["linears"][f"experts_{health['weights']}"] == experts
        agent.forced_calls_on_every_api(FORCED_TOKENS)
        r1 = agent.chat(agent.first_turn(), tool_choice="required", max_tokens=FORCED_TOKENS)
        ((call),) = r1.choices[0].message.tool_calls
        turn2 = agent.second_turn(call.id, call.function.name, call.function.arguments)
        r2 = agent.chat(turn2, max_tokens=8)
        assert r2.usage.prompt_tokens_details.cached_tokens >= 0.8 * r2.usage.prompt_tokens
    finally:
        assert server.stop() == 0
    restarted = serve(cache, models_dir=models_dir)
    try:
        again = agent.chat(turn2, restarted, max_tokens=8)
        assert again.usage.prompt_tokens_details.cached_tokens >= 0.8 * again.usage.prompt_tokens
        assert restarted.health()["tiers"]["ssd"]["counters"]["ssd_load_hits"] > 0
        # Computed cold: a salt no cached block carries (what a server without a cache computes).
        reference = agent.chat(turn2, restarted, max_tokens=8, extra_body={"cache_salt": "uncached reference"})
        assert reference.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert restarted.stop() == 0
    for got in (r2, again):
        assert got.choices[0].message.content == reference.choices[0].message.content
        assert got.choices[0].message.tool_calls == reference.choices[0].message.tool_calls
