"""A started server has already run every code path: the first request is not a cold one.

Checked by counters, not timing: ``runner_cold_paths`` counts attention paths a request ran
for the first time in the process (tests/engine/test_warmup.py shows it moves without
warm-up)."""

from __future__ import annotations

from tests.helpers import ServerProcess


def test_first_request_after_start_runs_no_cold_path(server: ServerProcess, client, model_name: str) -> None:
    health = server.health()
    assert health["engine"]["engine_warmup_steps"] >= 4
    system = "You are a terse assistant for a bicycle repair shop. " * 8
    for question in ("How do I true a wheel?", "And how do I fix a flat?"):  # the second one hits the prefix
        client.chat.completions.create(model=model_name, max_tokens=4, temperature=0,
                                       messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": question}])
    health = server.health()
    assert health["runner"]["runner_cold_paths"] == 0
    assert health["engine"]["engine_requests_total"] >= 2
