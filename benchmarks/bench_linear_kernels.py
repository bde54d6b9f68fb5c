"""One int4 linear of a 7B's shapes on this CPU: kvcellar's kernel (the row kernel below 8
rows, int4 panels from 8 on) against the dense path in float32 and in bf16 (what a bf16 model
runs where the CPU computes bf16 natively: AMX).

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
            table = KernelTable(quant_max_rows=1 << 20, kernel_dtype=torch.int8)
            # the weight argument gives the dtype and shape only: lean linears read ``quant``
            linear = {dtype: FastLinear(torch.zeros(1, 1, dtype=dtype).expand(out, cols), None, quant, table)
                      for dtype in (torch.float32, torch.bfloat16)}
            for rows in args.rows:
                x = torch.randn(rows, cols, generator=gen)
                repeats = 3 if rows >= 64 else 10
                with torch.inference_mode():
                    timed = {
                        "kernel": median_ms(linear[torch.float32].quantized_kernel, x, repeats),
                        "dense float32": median_ms(linear[torch.float32].dense, x, repeats),
                        # a bf16 model's dense path: bf16 where the CPU has it natively, else float32
                        "dense, bf16 model, in "
                        f"{str(linear[torch.bfloat16].native_dense_dtype).removeprefix('torch.')}":
                            median_ms(linear[torch.bfloat16].dense, x.bfloat16(), repeats),
                    }
                flops = 2 * rows * out * cols
                print(f"threads {threads} {out}x{cols} rows {rows}: " + " | ".join(
                    f"{k} {ms:.2f} ms ({flops / ms / 1e6:.0f} GFLOP/s)" for k, ms in timed.items()), flush=True)


if __name__ == "__main__":
    main()
