"""Engine throughput beside plain transformers, in one run (issue 2).

    python benchmarks/bench_engine.py [--dtype bfloat16] [--repeats 3] [--json out.json]

* prefill tok/s at 512/2048/4096 tokens: kvcellar (chunked under its step budget: a lone
  prompt gets the nothing-decoding budget, ``--max-prefill-step-tokens``; prefix
  cache off) vs one plain transformers forward over the prompt (SDPA, no cache reuse);
* decode tok/s at batch 1 and 8 (context 512): kvcellar's step loop (``--weights``) vs
  plain transformers (full weights, its own modules) with a DynamicCache, the same number
  of steps, and kvcellar through transformers' modules instead of its lean forward
  (``lean_forward=False``, engine/lean_forward.py);
* where a batch-1 decode step goes (torch profiler, grouped).

Every figure is the median of ``--repeats`` runs with min/max.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch
from transformers import DynamicCache

from kvcellar.artifacts import ArtifactCache
from kvcellar.engine.config import EngineConfig
from kvcellar.engine import Engine, assemble_engine, SamplingParams
from kvcellar.runtime import prepare_and_load
from kvcellar.engine.warmup import warm_up


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


@torch.inference_mode()
def hf_prefill(model: Any, ids: list[int]) -> float:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    model(input_ids=x, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t0


def engine_prefill(engine: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_decode_ms(model: Any, batch: int, context: int, steps: int) -> float:
    """ms per decode step of ``batch`` sequences with a DynamicCache (prefill excluded)."""
    x = torch.tensor([prompt_of(context, 7 + i) for i in range(batch)])
    cache = DynamicCache(config=model.config)
    out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - t0) / steps * 1e3


def engine_decode_ms(engine: Engine, batch: int, context: int, steps: int) -> float:
    """ms per engine step while ``batch`` sequences decode (their prefill excluded)."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    handles = [engine.submit(prompt_of(context, 7 + i), params) for i in range(batch)]
    engine.step()  # drains the inbox: from here on the scheduler sees every sequence
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    engine.step()  # every sequence is decoding from here on
    t0 = time.perf_counter()
    n = 0
    while engine.step():
        n += 1
    elapsed = time.perf_counter() - t0
    for h in handles:
        engine.collect(h)
    return elapsed / max(n, 1) * 1e3


def profile_decode_step(engine: Engine, context: int) -> dict[str, float]:
    """Group one batch-1 decode step's kernel time by kind of work (ms, torch profiler);
    ``rest`` is the unprofiled step's wall time minus those kernels: Python, dispatch,
    sampling and the small ops not named (the profiler's own overhead is not in it)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    handle = engine.submit(prompt_of(context, 99), params)
    for _ in range(5):
        engine.step()
    groups = {"matmul (linear)": ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm",
                                  "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
                                  "mkldnn::_linear_pointwise"),
              "attention (sdpa)": ("aten::scaled_dot_product_attention",
                                   "aten::_scaled_dot_product_flash_attention_for_cpu"),
              "kv gather": ("aten::index_select",),
              "kv write": ("aten::index_put_", "aten::_index_put_impl_"),
              "norms/rope/act": ("aten::rsqrt", "aten::pow", "aten::mean", "aten::silu", "aten::mul", "aten::add",
                                 "aten::cat", "aten::neg", "aten::cos", "aten::sin")}
    t0 = time.perf_counter()
    for _ in range(10):
        engine.step()
    wall = (time.perf_counter() - t0) / 10 * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.step()
    totals = {k: 0.0 for k in groups}
    for evt in prof.key_averages():
        for name, ops in groups.items():
            if evt.key in ops:
                totals[name] += evt.self_cpu_time_total / 1e3 / 10
    engine.cancel(handle.seq_id)
    engine.run_until_idle()
    out = {k: round(v, 2) for k, v in totals.items()}
    out["step wall (unprofiled)"] = round(wall, 2)
    out["rest (python, dispatch, sampling, small ops)"] = round(wall - sum(totals.values()), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-step-tokens", type=int, default=512)
    ap.add_argument("--max-prefill-step-tokens", type=int, default=2048,
                    help="budget of a step with nothing decoding (a lone prompt's prefill chunks)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--weights", default="full", choices=["full", "int8", "int4"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    loaded = prepare_and_load(None, dtype=args.dtype, device="cpu", weights=args.weights,
                              artifacts=ArtifactCache.open(kvcellar_cache()))
    # Plain transformers runs on a copy of its own with full weights: the engines prepare
    # (pack, fuse, quantize) the linears of the models they are given.
    model = prepare_and_load(None, dtype=args.dtype, device="cpu", weights="full",
                             artifacts=ArtifactCache.open(kvcellar_cache())).model
    model.set_attn_implementation("sdpa")
    cfg = EngineConfig(kv_cache_gb=1.0, block_size=args.block_size, max_step_tokens=args.max_step_tokens,
                       max_prefill_step_tokens=args.max_prefill_step_tokens, prefix_caching=False, max_num_seqs=16)
    engine = assemble_engine(loaded, cfg)
    # its own copy of the model: an engine prepares its model's linears (fused QKV/gate-up for
    # the lean forward), which transformers' modules would run three times over
    modules = assemble_engine(prepare_and_load(None, dtype=args.dtype, device="cpu", weights=args.weights,
                                      artifacts=ArtifactCache.open(kvcellar_cache())),
                     dataclasses.replace(cfg, lean_forward=False))
    for e in (engine, modules):
        warm_up(e)  # as the server does: it also picks the decode threads (engine/model_runner.py)
    print(f"decode steps on {engine.runner.decode_threads} of {engine.runner.threads} threads (measured at warm-up)")
    result: dict[str, Any] = {"dtype": args.dtype, "weights": args.weights,
                              "decode_threads": engine.runner.decode_threads, "threads": torch.get_num_threads(),
                              "max_step_tokens": args.max_step_tokens,
                              "max_prefill_step_tokens": args.max_prefill_step_tokens, "block_size": args.block_size,
                              "prefill": {}, "decode": {}}

    print(f"prefill ({args.dtype}, {torch.get_num_threads()} threads, step budget {args.max_step_tokens}, "
          f"{max(args.max_step_tokens, args.max_prefill_step_tokens)} with nothing decoding)")
    print(f"{'tokens':>7} {'kvcellar tok/s':>22} {'transformers tok/s':>22} {'ratio':>6}")
    for n in [int(x) for x in args.lengths.split(",")]:
        ours, theirs = [], []
        for r in range(args.repeats + 1):
            ids = prompt_of(n, 1000 + r)
            t_hf = hf_prefill(model, ids)
            t_us = engine_prefill(engine, ids)
            if r:  # the first round warms both up
                ours.append(n / t_us)
                theirs.append(n / t_hf)
        a, b = stats(ours), stats(theirs)
        ratio = a["median"] / b["median"]
        result["prefill"][n] = {"kvcellar_tok_s": a, "transformers_tok_s": b, "ratio": ratio}
        print(f"{n:>7} {a['median']:>8.0f} [{a['min']:.0f}-{a['max']:.0f}]{'':>3} "
              f"{b['median']:>8.0f} [{b['min']:.0f}-{b['max']:.0f}]{'':>3} {ratio:>5.2f}x")

    print(f"\ndecode (context {args.context}, {args.decode_steps} steps)")
    print(f"{'batch':>5} {'kvcellar ms/step':>20} {'tok/s':>7} {'transformers ms/step':>22} {'tok/s':>7} {'ratio':>6}"
          f" {'kvcellar via modules ms/step':>30}")
    for batch in (1, 8):
        ours, theirs, via_modules = [], [], []
        for r in range(args.repeats + 1):
            t_hf = hf_decode_ms(model, batch, args.context, args.decode_steps)
            t_us = engine_decode_ms(engine, batch, args.context, args.decode_steps)
            t_mod = engine_decode_ms(modules, batch, args.context, args.decode_steps)
            if r:
                ours.append(t_us)
                theirs.append(t_hf)
                via_modules.append(t_mod)
        a, b, m = stats(ours), stats(theirs), stats(via_modules)
        result["decode"][batch] = {"kvcellar_ms_per_step": a, "transformers_ms_per_step": b,
                                   "kvcellar_modules_ms_per_step": m,
                                   "kvcellar_tok_s": batch * 1e3 / a["median"],
                                   "transformers_tok_s": batch * 1e3 / b["median"],
                                   "speedup_vs_transformers": b["median"] / a["median"]}
        print(f"{batch:>5} {a['median']:>8.1f} [{a['min']:.1f}-{a['max']:.1f}] {batch * 1e3 / a['median']:>7.1f} "
              f"{b['median']:>10.1f} [{b['min']:.1f}-{b['max']:.1f}] {batch * 1e3 / b['median']:>7.1f} "
              f"{b['median'] / a['median']:>5.2f}x {m['median']:>14.1f} [{m['min']:.1f}-{m['max']:.1f}]")
    agg = result["decode"][8]["kvcellar_tok_s"] / result["decode"][1]["kvcellar_tok_s"]
    result["decode"]["batch8_over_batch1"] = agg
    print(f"batch-8 aggregate / batch-1: {agg:.2f}x")

    breakdown = profile_decode_step(engine, args.context)
    result["decode_step_breakdown_ms"] = breakdown
    print("\nbatch-1 decode step, where the time goes (ms):")
    for k, v in breakdown.items():
        print(f"  {k:<45} {v:>7.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


def kvcellar_cache():
    from kvcellar.paths import resolve_cache_dir

    return resolve_cache_dir(None)


if __name__ == "__main__":
    main()
