"""Where a decode step's time goes, on any device: greedy tokens through the engine, then
one profiled run (torch.profiler), summarised as per-token figures.

    python benchmarks/bench_step_profile.py                         # CPU, the dtype auto picks
    python benchmarks/bench_step_profile.py --device cuda --batch 8

Prints the wall time per step, and from the profile: torch's CPU time per step, the device's
kernel time per step and the kernel launches per step (on CUDA a step far above its kernel
time is bound by launching kernels from Python), then the ops by CPU time.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)
import argparse
import time

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch
from torch.profiler import ProfilerActivity, profile

from kvcellar.artifacts import ArtifactCache
from kvcellar.engine import SamplingParams, assemble_engine
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.tokenization import encode_chat
from kvcellar.runtime import prepare_and_load

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--rows", type=int, default=25, help="ops listed")
    args = ap.parse_args()

    loaded = prepare_and_load(args.model, dtype=args.dtype, device=args.device, weights=args.weights,
                              artifacts=ArtifactCache.open())
    device = next(loaded.model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    engine = assemble_engine(loaded, EngineConfig(kv_cache_gb=0.5, block_size=16, max_num_seqs=max(args.batch, 1)))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def prompts(salt: int) -> list[list[int]]:
        return [encode_chat(loaded.tokenizer, [{"role": "user", "content": f"Story {salt}-{i}: a cat."}])
                for i in range(args.batch)]

    def timed(salt: int, p: SamplingParams) -> float:
        sync()
        start = time.perf_counter()
        engine.generate(prompts(salt), p)
        sync()
        return time.perf_counter() - start

    engine.generate(prompts(0), params)  # warm: kernels, allocator, caches
    first = timed(1, SamplingParams(max_tokens=1, temperature=0.0))
    wall_ms = (timed(3, params) - first) * 1e3 / max(args.tokens - 1, 1)  # the prefill taken out
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.generate(prompts(2), params)
        sync()
    events = prof.key_averages()
    cpu_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.tokens
    device_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 / args.tokens
    launches = sum(e.count for e in events if e.key in LAUNCHES) / args.tokens
    layers = getattr(loaded.config.get_text_config(), "num_hidden_layers", 0) or 1
    print(f"{device} {loaded.model.dtype} weights={args.weights} batch {args.batch}, {args.tokens} tokens "
          "(the profiled run includes the short prompts' prefill)")
    print(f"  decode step {wall_ms:.2f} ms (unprofiled, prefill taken out); profiled run: "
          f"torch CPU time {cpu_ms:.2f} ms/token")
    if device.type == "cuda":
        print(f"  device kernels {device_ms:.2f} ms/token; {launches:.0f} kernel launches/token "
              f"({launches / layers:.1f} per layer)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
