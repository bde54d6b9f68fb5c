"""The gated delta rule of a Qwen3.5-9B-shaped Gated DeltaNet layer (16 key / 32 value heads of
128, hidden 4096), float32, on this CPU: kvcellar's kernel (``native/recurrent.c``) against the
torch recurrence it replaces (``engine/deltanet.gated_delta`` a token at a time), for a prefill
chunk of one sequence and for decode batches; then the whole layer as kvcellar runs it (its
linears in float32 here) beside transformers' own module (the chunked form for a prompt).
Figures only, no asserts.

    .venv/bin/python benchmarks/bench_deltanet.py [--rows 512] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512, help="prefill chunk length (tokens)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from kvcellar.cache.state_pool import StateLayout, StatePool
    from kvcellar.engine import native
    from kvcellar.engine.deltanet import GatedDeltaNet, RecurrentStep, gated_delta, l2_normalized
    from kvcellar.engine.linears import call_of

    if not native.available():
        raise SystemExit("kvcellar's CPU kernels do not build here: nothing to compare")
    heads, dim = 32, 128
    print(f"threads {torch.get_num_threads()}; state per sequence and layer {heads * dim * dim * 4 / 2**20:.0f} MiB")

    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        q = l2_normalized(torch.randn(rows, heads, dim)) * dim ** -0.5
        k = l2_normalized(torch.randn(rows, heads, dim))
        return q, k, torch.randn(rows, heads, dim), torch.rand(rows, heads) * 0.5 + 0.5, torch.rand(rows, heads)

    with torch.inference_mode():
        rows = args.rows
        q, k, v, decay, beta = inputs(rows)
        states = torch.zeros(9, heads, dim, dim)
        slots = torch.zeros(rows, dtype=torch.int64)
        none = torch.full((rows,), -1, dtype=torch.int64)
        kernel = best(lambda: native.gated_delta(q, k, v, decay, beta, states, slots, none), args.repeat)

        def torch_span() -> None:
            state = states[0]
            for t in range(rows):
                gated_delta(q[t], k[t], v[t], decay[t], beta[t], state)

        loop = best(torch_span, max(1, args.repeat - 1))
        print(f"prefill {rows} tokens, the rule alone: kernel {kernel * 1e3:.1f} ms ({rows / kernel:.0f} tok/s), "
              f"torch {loop * 1e3:.0f} ms ({rows / loop:.0f} tok/s): {loop / kernel:.1f}x")
        for n in (1, 8):
            q, k, v, decay, beta = inputs(n)
            slots = torch.arange(n)
            none = torch.full((n,), -1, dtype=torch.int64)
            kernel = best(partial(native.gated_delta, q, k, v, decay, beta, states, slots, none), 20)
            loop = best(partial(gated_delta, q, k, v, decay, beta, states[:n].clone()), 20)
            print(f"decode batch of {n}, the rule alone: kernel {kernel * 1e3:.2f} ms, torch {loop * 1e3:.2f} ms a "
                  f"layer: {loop / kernel:.1f}x")

        cfg = AutoConfig.for_model("qwen3_5_text", hidden_size=4096, num_hidden_layers=4, linear_num_key_heads=16,
                                   linear_num_value_heads=heads, linear_key_head_dim=dim, linear_value_head_dim=dim)
        torch.manual_seed(0)
        module = Qwen3_5GatedDeltaNet(cfg, 0).eval()
        layer = GatedDeltaNet(module, 0, call_of)
        layout = StateLayout.from_model_config(cfg)
        assert layout is not None
        pool = StatePool(layout, 10)
        x = torch.randn(1, rows, 4096) * 0.1
        slot = pool.acquire()
        ours = best(lambda: layer(x, RecurrentStep(pool, None, [(0, rows, slot)], {})), max(1, args.repeat - 1))
        theirs = best(lambda: module(x), max(1, args.repeat - 1))
        print(f"the whole layer, prefill {rows}: kvcellar {ours * 1e3:.0f} ms ({rows / ours:.0f} tok/s), "
              f"transformers chunked {theirs * 1e3:.0f} ms ({rows / theirs:.0f} tok/s)")
        for n in (1, 8):
            decode = torch.tensor([pool.acquire() for _ in range(n)])
            x = torch.randn(1, n, 4096) * 0.1
            step = best(partial(layer, x, RecurrentStep(pool, decode, [], {})), 10)
            print(f"the whole layer, decode batch of {n}: kvcellar {step * 1e3:.1f} ms a step")


if __name__ == "__main__":
    main()
