"""The issue-24 report, as a user met it: ``kvcellar serve --remote-url redis+cluster://``
naming a node that is down. Every request is answered from compute (before the fix, the first
one never was), /health stays 200 with the remote tier degraded and naming the cluster
client's exception, and the RAM tier still serves repeats with the same answers (the
stand-in model: ``tests._models.server_stand_in``)."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests._models import SERVER_STAND_IN, stand_in_args
from tests.helpers import ServerProcess, free_port

pytestmark = pytest.mark.slow

QUESTIONS = ["What is a cache?", "Name two prime numbers.", "What does TLS stand for?"]


def ask(server: ServerProcess, question: str) -> str:
    r = server.post("/v1/chat/completions", {"model": SERVER_STAND_IN, "temperature": 0, "max_tokens": 12,
                                             "messages": [{"role": "user", "content": question}]}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_cluster_that_is_down_at_start_costs_no_request(models_dir, tmp_path):
    down = ServerProcess(tmp_path / "cache", *stand_in_args(), "--remote-url", f"redis+cluster://127.0.0.1:{free_port()}",
                         models_dir=models_dir).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            cold = list(pool.map(lambda q: ask(down, q), QUESTIONS))  # computed: the uncached reference
        assert [ask(down, q) for q in QUESTIONS] == cold  # again, from RAM
        health = down.health()
        assert health["status"] == "ok" and health["engine_steps"]["step_failures"] == 0
        remote = health["tiers"]["remote"]
        assert remote["state"] == "degraded"
        assert "RedisClusterException" in str(remote["last_error"]) or "ClusterError" in str(remote["last_error"])
        assert health["tiers"]["ssd"]["state"] == "ok"
    finally:
        assert down.stop() == 0
