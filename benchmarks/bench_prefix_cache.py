"""RAM prefix-cache hits beside cold prefill and one decode step, per block size (issue 4).

    python benchmarks/bench_prefix_cache.py [--tokens 4096] [--block-sizes 16,32,64,128]

For each block size, in one process: cold TTFT of a ``--tokens`` prompt (prefix cache on,
never seen), RAM-hit TTFT of the same prompt, one batch-1 decode step at that context, and
decode ms/step at context 512 for batch 1 and 8 (block size also changes the attention
gather). Target: RAM-hit TTFT <= 1.2x one decode step at 4096 context. Every figure is the
median of ``--repeats`` with min/max.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import json
import statistics
import time

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch

from kvcellar.artifacts import ArtifactCache
from kvcellar.engine.config import EngineConfig
from kvcellar.engine import Engine, SamplingParams, assemble_engine
from kvcellar.runtime import prepare_and_load


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    """Seconds from submit to the first token (engine driven in this thread)."""
    t0 = time.perf_counter()
    handle = engine.submit(ids, SamplingParams(max_tokens=1, temperature=0))
    result = engine.collect(handle)
    return time.perf_counter() - t0, result.num_cached_tokens


def decode_step_ms(engine: Engine, ids: list[int], steps: int = 8) -> float:
    """Median time between tokens of one sequence at ``len(ids)`` context (RAM-hit prefill)."""
    handle = engine.submit(ids, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    times = []
    while True:
        t0 = time.perf_counter()
        if not engine.step():
            break
        times.append(time.perf_counter() - t0)
    engine.collect(handle)
    return statistics.median(times[1:]) * 1e3  # the first step is the (hit) prefill


def batch_decode_ms(engine: Engine, batch: int, context: int, steps: int = 16) -> float:
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    handles = [engine.submit(prompt_of(context, 500 + i), params) for i in range(batch)]
    engine.step()  # drains the inbox: from here on the scheduler sees every sequence
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    engine.step()
    t0 = time.perf_counter()
    n = 0
    while engine.step():
        n += 1
    for h in handles:
        engine.collect(h)
    return (time.perf_counter() - t0) / max(n, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-sizes", default="16,32,64,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-step-tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    loaded = prepare_and_load(None, dtype=args.dtype, device="cpu", artifacts=ArtifactCache.open())
    rows = {}
    print(f"{args.tokens}-token prompt, {args.dtype}, {torch.get_num_threads()} threads, "
          f"step budget {args.max_step_tokens}; medians of {args.repeats} [min-max]")
    header = (f"{'block':>5} {'cold TTFT s':>20} {'RAM-hit TTFT ms':>20} {'decode@ctx ms':>18} "
              f"{'hit/step':>8} {'cached':>7} {'b1@512 ms':>10} {'b8@512 ms':>10}")
    print(header)
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        cfg = EngineConfig(block_size=bs, kv_cache_gb=1.5, max_step_tokens=args.max_step_tokens)
        engine = assemble_engine(loaded, cfg)
        cold, hit, step, cached = [], [], [], 0
        for r in range(args.repeats + 1):
            ids = prompt_of(args.tokens, 10 * bs + r)
            t_cold, _ = ttft(engine, ids)
            t_hit, cached = ttft(engine, ids)
            t_step = decode_step_ms(engine, ids)
            if r:  # round 0 warms up
                cold.append(t_cold)
                hit.append(t_hit * 1e3)
                step.append(t_step)
        b1 = batch_decode_ms(engine, 1, 512)
        b8 = batch_decode_ms(engine, 8, 512)
        c, h, s = stats(cold), stats(hit), stats(step)
        ratio = h["median"] / s["median"]
        rows[bs] = {"cold_ttft_s": c, "ram_hit_ttft_ms": h, "decode_step_ms": s, "hit_over_step": ratio,
                    "cached_tokens": cached, "decode_b1_ctx512_ms": b1, "decode_b8_ctx512_ms": b8}
        print(f"{bs:>5} {c['median']:>7.2f} [{c['min']:.2f}-{c['max']:.2f}] {h['median']:>7.1f} "
              f"[{h['min']:.0f}-{h['max']:.0f}] {s['median']:>6.1f} [{s['min']:.0f}-{s['max']:.0f}] "
              f"{ratio:>7.2f}x {cached:>7} {b1:>10.1f} {b8:>10.1f}")
        del engine
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"tokens": args.tokens, "dtype": args.dtype, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
