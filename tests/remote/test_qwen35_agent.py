"""A coding agent's conversation with a hybrid Qwen3.5 model served from GGUF, across a restart
and onto another replica.

``kvcellar serve`` on a qwen35 GGUF (Gated DeltaNet layers beside gated attention, small and
random, Q8_0; Qwen3-Coder's tool markup in its chat template, as Qwen3.5's) under the default
weights (``auto``), with the SSD tier and a real Redis: a call forced in that markup on each API
is valid against its tool's schema; turns 2 and 3 of the conversation (the call and its result
fed back, then another question) read at least 80 % of their prompts from the cache — blocks
and a recurrent-state snapshot — in the same server, after a restart (from the SSD), and on a
second server with an empty SSD (from Redis), and give what the same prompt computed cold gives
(a cache salt no cached block or snapshot carries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests._models import needs_native, qwen35_gguf
from tests.helpers import ServerProcess
from tests.integration.agent_turns import RULES, Agent

MODEL = "tiny-qwen35"
SYSTEM = RULES * 6
FORCED_TOKENS = 160  # the markup a byte-level vocabulary spells a character at a time, and a path
FOLLOW_UP = "Now fix it: return an error instead of panicking."

pytestmark = needs_native  # a hit equals the uncached tokens under the default weights' kernels


def serve(cache: Path, redis_url: str, *, models_dir: Path) -> ServerProcess:
    return ServerProcess(cache, "--model", str(qwen35_gguf()), "--weights", "auto", "--remote-url", redis_url,
                         models_dir=models_dir).start()


def cached_share(reply: Any) -> float:
    return reply.usage.prompt_tokens_details.cached_tokens / reply.usage.prompt_tokens


def counters(server: ServerProcess, tier: str) -> dict[str, float]:
    return server.health()["tiers"][tier]["counters"]


def test_turns_two_and_three_from_the_cache_in_the_server_after_a_restart_and_on_a_replica(
        tmp_path: Path, models_dir: Path, redis_server: Any) -> None:
    server = serve(tmp_path / "a", redis_server.url, models_dir=models_dir)
    agent = Agent(server, MODEL, SYSTEM)
    try:
        agent.forced_calls_on_every_api(FORCED_TOKENS)
        r1 = agent.chat(agent.first_turn(), tool_choice="required", max_tokens=FORCED_TOKENS)
        ((call),) = r1.choices[0].message.tool_calls
        turn2 = agent.second_turn(call.id, call.function.name, call.function.arguments)
        r2 = agent.chat(turn2, max_tokens=8)
        turn3 = [*turn2, {"role": "assistant", "content": r2.choices[0].message.content},
                 {"role": "user", "content": FOLLOW_UP}]
        r3 = agent.chat(turn3, max_tokens=8)
        assert cached_share(r2) >= 0.8 and cached_share(r3) >= 0.8
        assert server.health()["state"]["state_snapshots_loaded"] >= 2
    finally:
        assert server.stop() == 0  # drains both tiers' writers
    restarted = serve(tmp_path / "a", redis_server.url, models_dir=models_dir)
    try:
        again = [agent.chat(turn, restarted, max_tokens=8) for turn in (turn2, turn3)]
        assert all(cached_share(r) >= 0.8 for r in again)
        assert counters(restarted, "ssd")["ssd_link_snapshots_loaded"] >= 1
    finally:
        assert restarted.stop() == 0
    replica = serve(tmp_path / "b", redis_server.url, models_dir=models_dir)
    try:
        remote = [agent.chat(turn, replica, max_tokens=8) for turn in (turn2, turn3)]
        assert all(cached_share(r) >= 0.8 for r in remote)
        assert counters(replica, "remote")["remote_link_snapshots_loaded"] >= 1
        # Computed cold: a salt no cached block or snapshot carries (a server without a cache).
        reference = [agent.chat(turn, replica, max_tokens=8, extra_body={"cache_salt": f"uncached reference {i}"})
                     for i, turn in enumerate((turn2, turn3))]  # a salt each: turn 3 would reuse turn 2's
        assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in reference)
    finally:
        assert replica.stop() == 0
    for got in ((r2, r3), again, remote):
        for reply, want in zip(got, reference, strict=True):
            assert reply.choices[0].message.content == want.choices[0].message.content
            assert reply.choices[0].message.tool_calls == want.choices[0].message.tool_calls
