"""Replicas behind one Redis, as real ``kvcellar serve`` processes: B answers what A
computed from Redis and its reads leave every block there for the next, and a Redis killed
while loads are in flight, restarted and back costs no wrong answer and no 5xx.

A replica's first answer to a prompt is computed cold (its RAM and SSD are empty), so it
is the uncached reference the others must equal (greedy, float32). The replicas serve the
stand-in (``tests._models.server_stand_in``: the embedded model's KV geometry, a tenth of its
compute)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._models import SERVER_STAND_IN, stand_in_args
from tests.helpers import ServerProcess, wait_until

pytestmark = pytest.mark.slow

BS = 16
DOC = ("Runbook, storage team. Disk pressure: check `df -h` and the largest directories first; never "
       "delete snapshots without a ticket. Replication lag: compare the primary's LSN with each replica's "
       "before failing over; a failover with lag loses writes. Certificates: renew 14 days ahead. " * 10)


def ask(server: ServerProcess, question: str) -> dict[str, Any]:
    r = server.post("/v1/chat/completions", {
        "model": SERVER_STAND_IN, "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], "prompt": body["usage"]["prompt_tokens"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def tiers(server: ServerProcess) -> dict[str, Any]:
    """Counters by tier."""
    return {name: t["counters"] for name, t in server.health()["tiers"].items()}


def replica(tmp_path: Path, name: str, models_dir: Path, url: str) -> ServerProcess:
    return ServerProcess(tmp_path / name, *stand_in_args(), "--remote-url", url, "--remote-load-timeout", "30",
                         models_dir=models_dir).start()


def remote_drained(server: ServerProcess) -> bool:
    remote = server.health()["tiers"]["remote"]
    return remote["writer_queue_depth"] == 0 and remote["counters"]["remote_stored_blocks"] > 0


def test_two_replicas_share_one_redis_and_survive_restarts(redis_server, models_dir, tmp_path):
    question = "The replica is 40 MB behind. Fail over?"
    a = replica(tmp_path, "a", models_dir, redis_server.url)
    try:
        cold = ask(a, question)
        wait_until(lambda: remote_drained(a), timeout=60, what="A's blocks to reach Redis")
    finally:
        a.stop()
    written = set(redis_server.client().keys("*"))
    assert written
    b = replica(tmp_path, "b", models_dir, redis_server.url)
    try:
        warm = ask(b, question)
        assert warm["text"] == cold["text"]
        assert warm["cached"] >= 0.9 * warm["prompt"]
        t = tiers(b)
        assert t["remote"]["remote_link_loaded_blocks"] == -(-warm["cached"] // BS)  # all from Redis
        assert t["ssd"]["ssd_link_loaded_blocks"] == 0 and t["remote"]["remote_corrupt_total"] == 0
        assert b.health()["tiers"]["remote"]["state"] == "ok"
        metrics = httpx.get(b.url + "/metrics", timeout=10).text
        assert "kvcellar_remote_load_hits" in metrics and "kvcellar_remote_link_loaded_blocks" in metrics
    finally:
        b.stop()
    # B's reads left Redis whole: every block A wrote is still there for the next replica
    assert written <= set(redis_server.client().keys("*"))


def test_redis_killed_during_loads_then_back(private_redis, models_dir, tmp_path):
    redis = private_redis().start()
    questions = [f"Certificate {i} expires in {10 + i} days. Renew now?" for i in range(4)]
    a = replica(tmp_path, "a", models_dir, redis.url)
    try:
        cold = {q: ask(a, q) for q in questions}
        wait_until(lambda: a.health()["tiers"]["remote"]["counters"]["remote_writer_queue_depth"] == 0, timeout=60,
                   what="A's writes")
    finally:
        a.stop()
    b = replica(tmp_path, "b", models_dir, redis.url)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
            futures = {q: pool.submit(ask, b, q) for q in questions}
            redis.kill()  # while B looks up and loads them
            answers = {q: f.result(timeout=300) for q, f in futures.items()}  # every one 200 (ask asserts)
        assert all(answers[q]["text"] == cold[q]["text"] for q in questions)
        wait_until(lambda: b.health()["tiers"]["remote"]["state"] == "degraded", timeout=30, what="the tier to notice")
        assert b.health()["tiers"]["remote"]["last_error"]
        redis.start()  # same port, empty
        wait_until(lambda: b.health()["tiers"]["remote"]["state"] == "ok", timeout=60, what="B to reconnect")
        stored = tiers(b)["remote"]["remote_stored_blocks"]
        fresh = ask(b, "Disk is 97% full on the primary. What first? Answer in one line, with the command.")
        # the shared document is hot in B's RAM (it came from Redis: not stored back); the new
        # blocks are written through to the restarted, empty Redis
        computed = fresh["prompt"] // BS - fresh["cached"] // BS
        assert computed >= 1
        wait_until(lambda: tiers(b)["remote"]["remote_stored_blocks"] - stored >= computed, timeout=60,
                   what="B to write through to the restarted Redis")
        assert redis.client().dbsize() >= computed
        assert b.health()["server"]["server_requests_failed"] == 0
    finally:
        b.stop()
