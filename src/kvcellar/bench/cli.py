"""``kvcellar bench <scenario>``: run one scenario, print its tables, save JSON and PNGs."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from kvcellar.bench.registry import discover
from kvcellar.bench.report import default_out_dir, format_tables, machine_info, save_json, to_json


def add_bench_commands(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark scenario (table + JSON + PNG)",
                                  description="Benchmark scenarios; see benchmarks/README.md.")
    scenarios = bench.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name, module in discover().items():
        doc = (module.__doc__ or "").strip()
        p = scenarios.add_parser(name, help=doc.splitlines()[0] if doc else name, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        add_common_arguments(p)
        module.add_arguments(p)
        p.set_defaults(func=functools.partial(cmd_bench, module))


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: bench-results/<scenario>-<timestamp>/)")
    p.add_argument("--fast", action="store_true", help="tiny sizes and one repeat (CI smoke run)")
    p.add_argument("--seed", default="0", help="seed of the generated prompts (default 0)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of each measurement (scenario default)")


def cmd_bench(module: ModuleType, args: argparse.Namespace) -> int:
    out = Path(args.out or default_out_dir(module.NAME))
    out.mkdir(parents=True, exist_ok=True)
    args.out = out
    meta = {"scenario": module.NAME, "argv": sys.argv[1:], "machine": machine_info()}
    t0 = time.perf_counter()
    result = module.run(args)  # a dataclass whose fields are result.json's keys (see registry.py)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    json_path = save_json(to_json({"scenario": module.NAME, "meta": meta, **to_json(result)}), out)
    print(format_tables(result.tables))
    pngs: list[Path] = []
    try:
        pngs = list(module.plot(result, out))
    except ImportError as exc:  # matplotlib is an optional dependency (extras "bench")
        print(f"\nno plot: {exc} (pip install 'kvcellar[bench]')", file=sys.stderr)
    print(f"\nresult: {json_path}")
    for png in pngs:
        print(f"plot:   {png}")
    return 0
