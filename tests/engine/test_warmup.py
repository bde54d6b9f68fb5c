"""Warm-up: the engine runs every attention path before serving and leaves no trace.

"Cold" is counted, not timed: ``runner_cold_paths`` counts attention paths a request runs
for the first time in the process (kernel selection and lazy set-up happen then)."""

from __future__ import annotations

from pathlib import Path

from kvcellar.engine import SamplingParams, observability
from kvcellar.engine.attention import attention_paths
from kvcellar.engine.warmup import warm_up
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from tests._models import assert_same_output, chat_ids, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)
SYSTEM = "You answer questions about tea, briefly and precisely, citing the steeping time. " * 6


def first_requests(model) -> list[list[int]]:
    """A fresh prompt, then the same system prompt with another question (a prefix hit with
    a tail), then a batch of two."""
    return [chat_ids(model, "How long for green tea?", SYSTEM),
            chat_ids(model, "And for a black tea, how long exactly?", SYSTEM),
            chat_ids(model, "Oolong?"), chat_ids(model, "White tea?")]


def serve_first_requests(engine, model) -> list:
    prompts = first_requests(model)
    return [*engine.generate(prompts[:2], GREEDY), *engine.generate(prompts[2:], GREEDY)]


def test_without_warmup_first_requests_run_cold_paths(model):
    """The counter the server test relies on does move when nothing was warmed."""
    engine = make_engine(model)
    serve_first_requests(engine, model)
    assert observability.snapshot(engine)["runner_cold_paths"] > 0


def test_warmup_leaves_no_cold_path_and_no_trace(model, tmp_path: Path):
    engine = make_engine(model)
    tier = DiskTier(tmp_path, engine.fingerprint, engine.block_spec, DiskConfig(min_free_bytes=0),
                    descriptor=engine.descriptor)
    engine.attach_tier(tier, "write_through")
    before = observability.snapshot(engine)
    try:
        seconds = warm_up(engine)
        after = observability.snapshot(engine)
        assert seconds > 0 and after["engine_warmup_steps"] >= 4 and after["engine_warmup_left_out"] == 0
        assert engine.grammars.prepared  # the first constrained request does not build it
        # every attention path the engine has was run
        assert engine.runner.paths_seen >= attention_paths(engine.runner.device, engine.runner.pool.attends)
        # no trace: no blocks kept, nothing sent to the SSD, counters as before
        assert after["kv_blocks_cached"] == 0 and after["kv_blocks_used"] == 0
        assert not list(tmp_path.rglob("*.kvb"))
        for key in ("engine_requests_total", "engine_steps", "kv_registered", "kv_lookup_hits", "sched_admitted"):
            assert after[key] == before[key], key

        warmed = serve_first_requests(engine, model)
        assert observability.snapshot(engine)["runner_cold_paths"] == 0
        # the outputs are those of an engine that was not warmed
        cold = serve_first_requests(make_engine(model, prefix_caching=False), model)
        for got, ref in zip(warmed, cold, strict=True):
            assert_same_output(got, ref)
        assert warmed[1].num_cached_tokens > 0
    finally:
        engine.shutdown(timeout=10)


def test_a_warmup_out_of_time_leaves_out_the_costly_waves_and_changes_no_output(model):
    """With no time to spare only the cheapest wave runs (it prices the others): the long
    prefix's waves and the decode-thread measurement are left out and counted, their paths
    stay cold, and the first requests give what an engine that was not warmed gives."""
    engine = make_engine(model)
    try:
        warm_up(engine, budget_s=0.0)
        stats = observability.snapshot(engine)
        assert stats["engine_warmup_steps"] >= 2
        # the waves after the first (a fourth one where SDPA has a split path) and the measurement
        waves = 3 if "prefill_split" in attention_paths(engine.runner.device, engine.runner.pool.attends) else 2
        measured = engine.config.decode_threads == 0 and engine.runner.threads > 1
        assert stats["engine_warmup_left_out"] == waves + measured
        assert "prefill_split" not in engine.runner.paths_seen
        assert stats["runner_decode_threads"] == engine.runner.threads  # not measured: all of them
        warmed = serve_first_requests(engine, model)
        cold = serve_first_requests(make_engine(model, prefix_caching=False), model)
        for got, ref in zip(warmed, cold, strict=True):
            assert_same_output(got, ref)
    finally:
        engine.shutdown(timeout=10)

