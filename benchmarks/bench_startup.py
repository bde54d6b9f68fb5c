"""Start-up to first served token on the embedded model, with and without a prepared artifact.

Each start is a fresh process (imports included), as a server restart would be:

* ``no cache``   - the GGUF dequantized in memory, nothing stored (the path without §6);
* ``1st start``  - empty cache dir: the GGUF is prepared into the artifact cache, then
  loaded from the entry;
* ``2nd start``  - the entry is validated (``verify=fast``) and loaded;
* ``2nd, full``  - the same with ``verify=full`` (sha256 of every file on every start),
  to show what the fast check saves.

    python benchmarks/bench_startup.py [--dtype auto] [--no-baseline] [--json out.json]

The page cache is warm for every start after the first (as on a real restart of a machine
that has been running); the first start reads the GGUF cold only if nothing else did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = [
    ("import", "imports (torch, transformers, kvcellar)"),
    ("resolve", "resolve source"),
    ("source_identity", "source identity (GGUF sha256)"),
    ("artifact", "prepare / validate entry"),
    ("tokenizer", "tokenizer load"),
    ("weights", "weights load"),
    ("tokenizer_identity", "tokenizer identity"),
    ("engine", "engine build (KV pool)"),
    ("first_token", "first token (prefill + sample)"),
    ("total", "total in process"),
    ("wall", "wall: spawn -> first token"),
]


def child(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import kvcellar  # noqa: F401  (OMP wait policy before torch)

    # isort: split
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from kvcellar.artifacts import ArtifactCache, ArtifactConfig
    from kvcellar.engine import SamplingParams, assemble_engine
    from kvcellar.engine.config import EngineConfig
    from kvcellar.engine.loader import load_model
    from kvcellar.engine.tokenization import encode_chat
    from kvcellar.runtime import prepare_and_load

    out: dict[str, float | str | bool | None] = {"import": time.perf_counter() - t_start}
    t0 = time.perf_counter()
    if args.mode == "baseline":
        loaded = load_model(None, dtype=args.dtype, device=args.device)
    else:
        cache = ArtifactCache.open(args.cache_dir, ArtifactConfig(verify=args.verify))
        out["cache_open"] = time.perf_counter() - t0
        loaded = prepare_and_load(None, dtype=args.dtype, device=args.device, artifacts=cache, progress=False)
    out.update(loaded.load_seconds)
    if loaded.artifact is not None:
        out["hit"] = loaded.artifact.hit
        out.update({f"artifact.{k}": v for k, v in loaded.artifact.seconds.items()})

    t1 = time.perf_counter()
    engine = assemble_engine(loaded, EngineConfig(kv_cache_gb=0.25, dtype=args.dtype, device=args.device))
    out["engine"] = time.perf_counter() - t1

    t1 = time.perf_counter()
    ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    [res] = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    out["first_token"] = time.perf_counter() - t1
    out["total"] = time.perf_counter() - t0
    out["token"] = res.token_ids[0]
    out["weights_id"] = loaded.weights_id
    out["tokenizer_id"] = loaded.tokenizer_id
    print("RESULT " + json.dumps(out), flush=True)


def run_start(mode: str, cache_dir: Path, args: argparse.Namespace, verify: str = "fast") -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--cache-dir", str(cache_dir), "--verify", verify,
           "--dtype", args.dtype, "--device", args.device]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{mode} start failed:\n{proc.stderr[-4000:]}")
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["wall"] = wall
    return result


def fmt(v: object) -> str:
    return f"{v:8.3f}" if isinstance(v, float) else f"{'-':>8}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="cached", help=argparse.SUPPRESS)
    ap.add_argument("--verify", default="fast", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help="cache root to use (default: a fresh temporary one)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-baseline", action="store_true", help="skip the start without the artifact cache")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    tmp = None
    if args.cache_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="kvcellar-bench-startup-"))
        cache_dir = tmp
    else:
        cache_dir = Path(args.cache_dir)
        if (cache_dir / "models").exists():
            sys.exit(f"{cache_dir}/models exists; the first start needs an empty cache dir")
    try:
        runs: dict[str, dict] = {}
        if not args.no_baseline:
            runs["no cache"] = run_start("baseline", cache_dir, args)
        runs["1st start"] = run_start("cached", cache_dir, args)
        runs["2nd start"] = run_start("cached", cache_dir, args)
        runs["2nd, full"] = run_start("cached", cache_dir, args, verify="full")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    names = list(runs)
    print(f"\nStart-up to first token, embedded SmolLM2-135M-Instruct (GGUF Q4_1), dtype {args.dtype}, "
          f"{os.cpu_count()} CPUs; seconds\n")
    print(f"{'step':38}" + "".join(f"{n:>12}" for n in names))
    for key, label in ROWS:
        print(f"{label:38}" + "".join(f"{fmt(runs[n].get(key)):>12}" for n in names))
    first, second = runs["1st start"], runs["2nd start"]
    print(f"\nprepare step: 1st {first['artifact']:.3f} s -> 2nd {second['artifact']:.4f} s "
          f"({first['artifact'] / second['artifact']:.0f}x); full verify instead: "
          f"{runs['2nd, full']['artifact']:.3f} s")
    print(f"in-process start-up: 1st {first['total']:.2f} s -> 2nd {second['total']:.2f} s "
          f"({first['total'] / second['total']:.1f}x); wall incl. imports: {first['wall']:.2f} s -> "
          f"{second['wall']:.2f} s")
    detail = {k: round(v, 4) for k, v in first.items() if k.startswith("artifact.")}
    print(f"1st start prepare breakdown: {detail}")
    same = {(r["weights_id"], r["tokenizer_id"], r["token"]) for r in runs.values()}
    print(f"same identities and first token in every start: {len(same) == 1}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
