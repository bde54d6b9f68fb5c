"""One int4 linear of a 7B's shapes on this CPU: kvcellar's kernel (the row kernel below 8
rows, int4 panels from 8 on) against the same weights dense (``--weights full``) in float32
and in bf16 (prepacked for oneDNN where the CPU computes bf16 natively: AMX).

    .venv/bin/python benchmarks/bench_linear_kernels.py                       # 2 threads, ~1 min
    .venv/bin/python benchmarks/bench_linear_kernels.py --threads 16,2 --rows 1,8,64,512

Random weights quantized to int4 (groups of 32); ms a call, median of 3 (10 below 64 rows)
after one warm-up, and the GFLOP/s that makes. Figures only, no asserts.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import statistics
import time
from collections.abc import Callable

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch

from kvcellar.engine import native
from kvcellar.engine.linears import FastLinear, KernelTable, native_bf16_cpu
from kvcellar.quantization import quantize


def median_ms(run: Callable[[torch.Tensor], object], x: torch.Tensor, repeats: int) -> float:
    run(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=ints, default=[2])
    p.add_argument("--shapes", default="18944x3584,3584x18944", help="out x in, comma-separated")
    p.add_argument("--rows", type=ints, default=[1, 8, 64, 512])
    args = p.parse_args()
    if not native.available():
        raise SystemExit("kvcellar's kernels cannot be built on this machine")
    print(f"native bf16: {native_bf16_cpu()}", flush=True)
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shapes.split(","):
            out, cols = (int(v) for v in shape.split("x"))
            quant = quantize(torch.randn(out, cols, generator=gen) * 0.02, "int4")
            # the weight argument gives the dtype and shape only: lean linears read ``quant``
            kernel = FastLinear(torch.zeros(1, 1).expand(out, cols), None, quant,
                                KernelTable(kernel_dtype=torch.int8))
            # the same weights dense (``--weights full``): float32, and bf16 prepacked where native
            dense = {dtype: FastLinear(quant.dequantize(dtype), None, None, KernelTable())
                     for dtype in (torch.float32, torch.bfloat16)}
            for rows in args.rows:
                x = torch.randn(rows, cols, generator=gen)
                repeats = 3 if rows >= 64 else 10
                with torch.inference_mode():
                    timed = {
                        "kernel": median_ms(kernel.quantized_kernel, x, repeats),
                        "dense float32": median_ms(dense[torch.float32].dense, x, repeats),
                        f"dense bf16 ({dense[torch.bfloat16].dense_kind})":
                            median_ms(dense[torch.bfloat16].dense, x.bfloat16(), repeats),
                    }
                flops = 2 * rows * out * cols
                print(f"threads {threads} {out}x{cols} rows {rows}: " + " | ".join(
                    f"{k} {ms:.2f} ms ({flops / ms / 1e6:.0f} GFLOP/s)" for k, ms in timed.items()), flush=True)


if __name__ == "__main__":
    main()
