"""A started server has already run every code path: the first request is not a cold one.

Checked by counters, not timing: ``runner_cold_paths`` counts attention paths a request ran
for the first time in the process (tests/engine/test_warmup.py shows it moves without
warm-up)."""

from __future__ import annotations

import pytest
import torch

from kvcellar.engine.linears import quant_kernels_run
from tests.helpers import MODEL, ServerProcess


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


@pytest.mark.slow
def test_default_bf16_server_warms_up_its_quantized_kernels_before_ready(tmp_path, models_dir) -> None:
    """The embedded Q4_1 model served int4 in bf16 (what ``--weights auto`` picks where a probe
    measures the kernel faster: ``test_auto_serves_a_4bit_gguf_in_int4_where_the_kernel_runs``;
    asked for here, so a busy CPU's probe cannot change the case): the warm-up has run its
    kernels' paths before /health says 200; the first requests run no cold path."""
    kernels = quant_kernels_run(torch.bfloat16, torch.device("cpu"))
    weights = ("--weights", "int4") if kernels else ()
    server = ServerProcess(tmp_path, "--dtype", "bfloat16", *weights, models_dir=models_dir, warmup=True).start()
    try:
        health = server.health()
        assert (health["weights"], health["dtype"]) == ("int4" if kernels else "full", "bfloat16")
        assert health["engine"]["engine_warmup_steps"] >= 4
        client = server.client()
        system = "You are a terse assistant for a bicycle repair shop. " * 8
        for question in ("How do I true a wheel?", "And how do I fix a flat?"):  # the second one hits the prefix
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            r = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True}, messages=messages)
            assert r.choices[0].message.content and r.usage.completion_tokens == 8
        after = server.health()
        assert after["runner"]["runner_cold_paths"] == 0
        assert after["engine"]["engine_warmup_steps"] == health["engine"]["engine_warmup_steps"]
        assert r.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        server.stop()
