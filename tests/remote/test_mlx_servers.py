"""``kvcellar serve --engine mlx`` as real processes (four starts: each costs seconds): the
three APIs end to end (chat, stream, a forced tool call, Anthropic Messages, Responses), its
blocks from the SSD after a restart and from Redis in a second process, and a torch server on
the same cache directory and Redis reading none of them.

The servers serve the stand-in saved as a folder (``tests._models.mlx_stand_in_folder``):
MLX's CPU backend on Linux multiplies with a reference BLAS, at which the embedded model takes
seconds a request (it is checked against mlx-lm in tests/engine/test_mlx_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests._models import mlx_stand_in_folder
from tests.helpers import ServerProcess, wait_until

pytestmark = pytest.mark.slow

MODEL = "mlx-stand-in"
DOC = ("Runbook, storage team. Disk pressure: check `df -h` and the largest directories first; never "
       "delete snapshots without a ticket. Replication lag: compare the primary's LSN with each replica's "
       "before failing over. " * 4)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}


def server(cache_dir: Path, *args: str, engine: str = "mlx") -> ServerProcess:
    return ServerProcess(cache_dir, "--engine", engine, "--model", str(mlx_stand_in_folder()), *args).start()


def ask(s: ServerProcess, question: str) -> dict[str, Any]:
    r = s.post("/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 8, "logprobs": True,
        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"tokens": [t["token"] for t in body["choices"][0]["logprobs"]["content"]],
            "logprobs": [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == pytest.approx(b["logprobs"], abs=2e-4)


def hits(s: ServerProcess) -> dict[str, int]:
    tiers = s.health()["tiers"]
    return {name: int(t["counters"].get(f"{name}_hit_blocks", t["counters"].get(f"{name}_hits", 0)))
            for name, t in tiers.items()}


def the_three_apis_end_to_end(s: ServerProcess) -> None:
    """Chat, a stream, a forced tool call, Anthropic Messages and Responses on ``s``."""
    health = s.health()
    assert health["backend"] == "mlx" and health["model"] == MODEL
    client = s.client()
    messages = [{"role": "user", "content": "Where is the runbook?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reply.choices[0].message.content
    call = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    tool = call.choices[0].message.tool_calls[0]
    assert call.choices[0].finish_reason == "tool_calls" and tool.function.name == "get_weather"
    assert isinstance(json.loads(tool.function.arguments)["city"], str)

    claude = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120.0)
    message = claude.messages.create(model=MODEL, max_tokens=6, messages=messages, extra_body={"temperature": 0})
    assert message.content[0].type == "text" and message.content[0].text == reply.choices[0].message.content
    response = client.responses.create(model=MODEL, input="Where is the runbook?", max_output_tokens=6,
                                       temperature=0)
    assert response.output_text == reply.choices[0].message.content
    assert s.health()["engine"]["engine_requests_failed"] == 0


def test_served_end_to_end_from_the_ssd_after_a_restart_from_redis_in_another_process_never_to_torch(
        redis_server, tmp_path):
    question = "The replica is 40 MB behind. Fail over?"
    remote = ("--remote-url", redis_server.url, "--remote-load-timeout", "30")
    a = server(tmp_path / "a", *remote)
    try:
        cold = ask(a, question)
        assert cold["cached"] == 0
        the_three_apis_end_to_end(a)
        wait_until(lambda: a.health()["tiers"]["remote"]["writer_queue_depth"] == 0
                   and a.health()["tiers"]["remote"]["counters"]["remote_stored_blocks"] > 0,
                   timeout=60, what="the MLX server's blocks to reach Redis")
    finally:
        a.stop()

    again = server(tmp_path / "a", "--remote-url", "redis://127.0.0.1:1")  # SSD only: Redis unreachable
    try:
        warm = ask(again, question)
        assert warm["cached"] > 0
        same(warm, cold)
    finally:
        again.stop()

    b = server(tmp_path / "b", *remote)  # another replica: empty RAM and SSD
    try:
        shared = ask(b, question)
        assert shared["cached"] > 0
        same(shared, cold)
    finally:
        b.stop()

    t = server(tmp_path / "a", *remote, engine="torch")  # same directory, same Redis, another namespace
    try:
        theirs = ask(t, question)
        assert theirs["cached"] == 0
        assert t.health()["backend"] == "torch"
    finally:
        t.stop()
