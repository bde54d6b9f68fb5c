"""A coding agent's conversation with a hybrid Qwen3.5 model served from GGUF, across a restart
and onto another replica.

``kvcellar serve`` on a qwen35 GGUF (Gated DeltaNet layers beside gated attention, small and
random, Q8_0; a chat template of Qwen3.5's rules, ``QWEN35_TEMPLATE``: Qwen3-Coder's XML calls,
``<think>`` opened by the generation prompt, reasoning rendered back only after the last user
question) under the default weights (``auto``), with the SSD tier and a real Redis: a call forced
in that markup on each API is valid against its tool's schema; four turns — a forced call, its
result fed back, a new question (which changes how every earlier reply renders) answered by
another forced call, its result fed back — each reply's reasoning kept out of its content and
sent back; turns 2-4 read at least 80 % of their prompts from the cache — blocks and a
recurrent-state snapshot — in the same server, after a restart (from the SSD), and on a second
server with an empty SSD (from Redis), and give what the same prompt computed cold gives (a
cache salt no cached block or snapshot carries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests._models import needs_native, qwen35_gguf
from tests.helpers import ServerProcess
from tests.integration.agent_turns import RULES, Agent, valid

MODEL = "tiny-qwen35"
SYSTEM = RULES * 6
FORCED_TOKENS = 160  # the markup a byte-level vocabulary spells a character at a time, and a path
FOLLOW_UP = "Now fix it: return an error instead of panicking."
EDITED = "src/parse.rs: line 2 replaced."
ANSWER = {"max_tokens": 8}
CALL = {"max_tokens": FORCED_TOKENS, "tool_choice": "required"}
TURNS = (ANSWER, CALL, ANSWER)  # turns 2-4

pytestmark = needs_native  # a hit equals the uncached tokens under the default weights' kernels


def serve(cache: Path, redis_url: str, *, models_dir: Path) -> ServerProcess:
    return ServerProcess(cache, "--model", str(qwen35_gguf()), "--weights", "auto", "--remote-url", redis_url,
                         models_dir=models_dir).start()


def cached_share(reply: Any) -> float:
    return reply.usage.prompt_tokens_details.cached_tokens / reply.usage.prompt_tokens


def counters(server: ServerProcess, tier: str) -> dict[str, float]:
    return server.health()["tiers"][tier]["counters"]


def fed_back(reply: Any) -> dict[str, Any]:
    """A reply as the agent sends it back: content, calls and reasoning."""
    message = reply.choices[0].message
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if reasoning := (message.model_extra or {}).get("reasoning_content"):
        out["reasoning_content"] = reasoning
    return out


def one_call(reply: Any) -> Any:
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    ((call),) = reply.choices[0].message.tool_calls
    valid(call.function.name, call.function.arguments)
    return call


def conversation(agent: Agent) -> tuple[list[list[dict[str, Any]]], list[Any]]:
    """The conversation (ask -> call; its result -> answer; a new question -> call; its result
    -> answer): turns 2-4's prompts and their replies."""
    call = one_call(agent.chat(agent.first_turn(), **CALL))
    turn2 = agent.second_turn(call.id, call.function.name, call.function.arguments)
    r2 = agent.chat(turn2, **ANSWER)
    turn3 = [*turn2, fed_back(r2), {"role": "user", "content": FOLLOW_UP}]
    r3 = agent.chat(turn3, **CALL)
    call = one_call(r3)
    turn4 = [*turn3, fed_back(r3), {"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                    "content": EDITED}]
    r4 = agent.chat(turn4, **ANSWER)
    for answer in (r2, r4):  # the template opened <think>: what the model wrote is reasoning
        message = answer.choices[0].message
        assert (message.model_extra or {}).get("reasoning_content"), message
        assert "think>" not in (message.content or "")
    return [turn2, turn3, turn4], [r2, r3, r4]


def calls(reply: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or ()]


def same_output(got: Any, want: Any) -> None:
    assert got.choices[0].message.content == want.choices[0].message.content
    assert calls(got) == calls(want)  # the calls' ids are random
    assert got.choices[0].message.model_extra == want.choices[0].message.model_extra  # the reasoning


def test_turns_two_to_four_from_the_cache_in_the_server_after_a_restart_and_on_a_replica(
        tmp_path: Path, models_dir: Path, redis_server: Any) -> None:
    server = serve(tmp_path / "a", redis_server.url, models_dir=models_dir)
    agent = Agent(server, MODEL, SYSTEM)
    try:
        agent.forced_calls_on_every_api(FORCED_TOKENS)
        turns, first = conversation(agent)
        assert all(cached_share(r) >= 0.8 for r in first), [cached_share(r) for r in first]
        health = server.health()
        assert health["state"]["state_snapshots_loaded"] >= 3
        assert health["speculative"]["mode"] == "suffix"  # a hybrid drafts under auto
    finally:
        assert server.stop() == 0  # drains both tiers' writers
    restarted = serve(tmp_path / "a", redis_server.url, models_dir=models_dir)
    try:
        again = [agent.chat(turn, restarted, **how) for turn, how in zip(turns, TURNS, strict=True)]
        assert all(cached_share(r) >= 0.8 for r in again), [cached_share(r) for r in again]
        assert counters(restarted, "ssd")["ssd_link_snapshots_loaded"] >= 1
    finally:
        assert restarted.stop() == 0
    replica = serve(tmp_path / "b", redis_server.url, models_dir=models_dir)
    try:
        remote = [agent.chat(turn, replica, **how) for turn, how in zip(turns, TURNS, strict=True)]
        assert all(cached_share(r) >= 0.8 for r in remote), [cached_share(r) for r in remote]
        assert counters(replica, "remote")["remote_link_snapshots_loaded"] >= 1
        # Computed cold: a salt no cached block or snapshot carries (a server without a cache);
        # a salt each, or a turn would reuse the one before.
        reference = [agent.chat(turn, replica, **how, extra_body={"cache_salt": f"uncached reference {i}"})
                     for i, (turn, how) in enumerate(zip(turns, TURNS, strict=True))]
        assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in reference)
    finally:
        assert replica.stop() == 0
    for got in (first, again, remote):
        for reply, want in zip(got, reference, strict=True):
            same_output(reply, want)
