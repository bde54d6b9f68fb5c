"""Cost of grammar-constrained decoding (issue 11), in one run.

    python benchmarks/bench_constrained.py [--dtype bfloat16] [--steps 48] [--repeats 3] [--json out.json]

* decode ms/step at batch 1 and 8: every sequence unconstrained vs every sequence under a
  JSON-schema grammar (same prompts, same number of steps, interleaved repeats); the
  difference is the mask work (llguidance's mask, the masked fill, grammar bookkeeping);
* grammar compile time for a typical tool schema: first compile, and a repeat (cached);
* per-token mask time inside a step (llguidance alone).

The grammar is an object holding an array of free strings, which the small model keeps
extending, so constrained sequences decode as many steps as unconstrained ones.
Every figure is the median of ``--repeats`` runs with min/max.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import json
import statistics
import time
from typing import Any

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch

from kvcellar.engine.config import EngineConfig
from kvcellar.engine import Engine, assemble_engine, SamplingParams
from kvcellar.engine.loader import load_model
from kvcellar.engine.tokenization import encode_chat
from kvcellar.server.tools.grammar import forced_call_grammar

LONG_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
               "required": ["notes"]}
TOOL = {"type": "function", "function": {"name": "search_code", "description": "Search the repository", "parameters": {
    "type": "object", "properties": {
        "query": {"type": "string"}, "path": {"type": "string"},
        "language": {"type": "string", "enum": ["python", "rust", "go", "typescript"]},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 100},
        "filters": {"type": "object", "properties": {"exclude_tests": {"type": "boolean"},
                                                     "globs": {"type": "array", "items": {"type": "string"}}}}},
    "required": ["query"]}}}


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def decode_ms(engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int) -> float:
    """Median ms of the decode steps (every sequence decoding) of one batch."""
    for p in prompts:
        engine.submit(p, params)
    times = []
    engine.step()  # admission + prefill of the whole batch
    while len(times) < steps and engine.num_active():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.run_until_idle()
    assert len(times) == steps, f"the batch ended after {len(times)} decode steps"
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    loaded = load_model(None, dtype=args.dtype)
    engine = assemble_engine(loaded, EngineConfig(prefix_caching=False, kv_cache_gb=0.5))
    compiler = engine.grammars
    t0 = time.perf_counter()
    compiler.prepare()
    prepare_s = time.perf_counter() - t0

    compile_ms = []
    for i in range(args.repeats):  # a fresh schema each time: a title makes the source unique
        tool = json.loads(json.dumps(TOOL))
        tool["function"]["parameters"]["title"] = f"run{i}"
        t0 = time.perf_counter()
        forced_call_grammar(compiler, "hermes", [tool], parallel=True)
        compile_ms.append(1000 * (time.perf_counter() - t0))
    t0 = time.perf_counter()
    forced_call_grammar(compiler, "hermes", [tool], parallel=True)
    cached_ms = 1000 * (time.perf_counter() - t0)

    grammar = compiler.json_schema(LONG_SCHEMA, param="response_format")
    budget = args.steps + 8  # steering toward the end starts only in the last max_tokens // 5
    free = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=budget * 6, temperature=0, grammar=grammar)
    users = [f"List notes about topic {i} as JSON." for i in range(8)]
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": u}]) for u in users]

    results: dict[str, Any] = {"dtype": str(loaded.dtype), "prepare_s": prepare_s,
                               "compile_ms": stats(compile_ms), "compile_cached_ms": cached_ms}
    for batch in (1, 8):
        runs: dict[str, list[float]] = {"free": [], "constrained": []}
        for _ in range(args.repeats):  # interleaved: load changes hit both alike
            runs["free"].append(decode_ms(engine, prompts[:batch], free, args.steps))
            runs["constrained"].append(decode_ms(engine, prompts[:batch], constrained, args.steps))
        f, c = statistics.median(runs["free"]), statistics.median(runs["constrained"])
        results[f"batch{batch}"] = {k: stats(v) for k, v in runs.items()} | {"overhead": c / f - 1}

    mask_ms = []
    constraint = compiler.constraint(grammar, max_tokens=10_000)
    logits = torch.randn(engine.vocab_size)
    for tok in loaded.tokenizer('{"notes": ["alpha", "beta", "gamma"', add_special_tokens=False).input_ids:
        t0 = time.perf_counter()
        constraint.mask(logits)
        mask_ms.append(1000 * (time.perf_counter() - t0))
        constraint.accept(tok)
    results["mask_ms"] = stats(mask_ms)

    print(f"dtype {results['dtype']}; llguidance tokenizer prepare {prepare_s:.2f} s")
    print(f"grammar compile (typical tool schema): {stats(compile_ms)['median']:.1f} ms "
          f"[{min(compile_ms):.1f}-{max(compile_ms):.1f}], cached {cached_ms:.3f} ms")
    m = results["mask_ms"]
    print(f"mask per token: {m['median']:.3f} ms [{m['min']:.3f}-{m['max']:.3f}]")
    print("| batch | free ms/step | constrained ms/step | overhead |")
    print("|---|---|---|---|")
    for batch in (1, 8):
        r = results[f"batch{batch}"]
        fr, co = r["free"], r["constrained"]
        print(f"| {batch} | {fr['median']:.1f} [{fr['min']:.1f}-{fr['max']:.1f}] | "
              f"{co['median']:.1f} [{co['min']:.1f}-{co['max']:.1f}] | {100 * r['overhead']:+.1f} % |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    engine.shutdown(timeout=5)


if __name__ == "__main__":
    main()
