"""Prefill through kvcellar's attention kernel (every position by the decode step's
arithmetic, reading the blocks where they lie) against SDPA over the gathered context, the
path prefill took before, on one engine over the embedded model (or ``--model``).

    .venv/bin/python benchmarks/bench_prefill_attention.py                      # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_prefill_attention.py --lengths 1000,4000 --weights full

A cache-disabled engine prefills each prompt in chunks of ``--chunk`` tokens; the two paths
alternate, ``--repeats`` times each. Prints seconds (median, min) and the ratio; figures
only, no asserts.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import statistics
import time

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch

from kvcellar.engine import SamplingParams, assemble_engine
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.tokenization import encode_chat
from kvcellar.runtime import prepare_and_load


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="auto")
    p.add_argument("--lengths", type=ints, default=[1000, 3000])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    loaded = prepare_and_load(args.model, dtype=args.dtype, device="cpu", weights=args.weights)
    cfg = EngineConfig(kv_cache_gb=1.0, block_size=16, max_step_tokens=args.chunk, max_prefill_step_tokens=0,
                       prefix_caching=False, max_num_seqs=4)
    engine = assemble_engine(loaded, cfg)
    pool = engine.runner.pool
    kernel = pool._attend_direct
    if kernel is None:
        raise SystemExit("kvcellar's attention kernel does not take this model's KV here")
    print(f"{loaded.name}: dtype {loaded.dtype}, weights {loaded.weights}, {torch.get_num_threads()} threads, "
          f"chunks of {args.chunk}", flush=True)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    filler = " ".join(f"Item {i} of the list is a red box on shelf {i % 7}." for i in range(4000))
    ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": "Summarise: " + filler}])
    engine.generate([ids[:64]], params)  # one-off costs of both paths
    pool._attend_direct = None
    engine.generate([ids[:64]], params)
    for n in args.lengths:
        prompt = ids[:n]
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        for _ in range(args.repeats):
            for name in times:
                pool._attend_direct = kernel if name == "kernel" else None
                t0 = time.perf_counter()
                engine.generate([prompt], params)
                times[name].append(time.perf_counter() - t0)
        k, s = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
        print(f"{len(prompt)} tokens: kernel {k:.2f} s (min {min(times['kernel']):.2f}) | SDPA {s:.2f} s "
              f"(min {min(times['sdpa']):.2f}) | kernel / SDPA {k / s:.2f}x", flush=True)
    pool._attend_direct = kernel
    engine.shutdown(5)


if __name__ == "__main__":
    main()
