"""What sealing blocks with a cache secret costs: per block, and on a restart / Redis hit.

    .venv/bin/python benchmarks/bench_sealed_blocks.py --out bench-results/sealed.json   # ~5 min
    .venv/bin/python benchmarks/bench_sealed_blocks.py --length 4096 --reps 7

In one process, the embedded model (``--model`` for another) as ``--weights auto`` serves it:

1. the seal alone: sealing and checking one block of this model's geometry (and a 64 MiB
   buffer), MB/s on one core, beside the payload CRC-32 every read already computes and the
   keyed hashes a MAC could otherwise be (HMAC-SHA256, keyed BLAKE2b);
2. TTFT of a ``--length``-token prompt whose blocks another engine wrote, with and without the
   secret, alternated ``--reps`` times (the host's speed drifts between minutes; medians):
   (a) a restart: the blocks on the SSD (page cache warm unless ``--drop-page-cache``, so the
   figure is the seal's CPU cost, not the disk's), (b) another replica: the blocks in a real
   ``redis-server`` started here on a free loopback port.

Figures only, no asserts.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import gc
import hashlib
import hmac
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch

from kvcellar.artifacts import ArtifactCache
from kvcellar.bench.pagecache import drop_page_cache
from kvcellar.bench.report import format_table, machine_info, table
from kvcellar.engine import Engine, SamplingParams, assemble_engine, native
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.loader import LoadedModel
from kvcellar.engine.warmup import warm_up
from kvcellar.runtime import open_disk_tier, open_remote_tier, prepare_and_load
from kvcellar.storage import block_format
from kvcellar.storage.block_format import BlockSeal, decode_block_into, encode_block
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.remote.config import RemoteConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.remote.redis_server import RedisServer  # (the one way a real redis-server starts)

SECRET = b"a secret for the benchmark only"
ONE = SamplingParams(max_tokens=1, temperature=0.0)


def rate(fn: Callable[[], object], nbytes: int, reps: int = 20) -> float:
    """MB/s of ``fn`` over ``nbytes``, the median of ``reps`` runs."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e6


def seal_table(engine: Engine) -> list[dict[str, Any]]:
    spec = engine.block_spec
    data = torch.randn(spec.shape).to(spec.dtype) if spec.dtype.is_floating_point else \
        torch.randint(0, 255, spec.shape, dtype=spec.dtype)
    key, digest, tokens = bytes(32), bytes(32), tuple(range(spec.block_size))
    seal = BlockSeal(SECRET, engine.fingerprint)
    sealed = encode_block(spec, key, digest, tokens, data, 0, seal=seal)
    plain = encode_block(spec, key, digest, tokens, data, 0)
    dest = torch.empty_like(data)
    big = os.urandom(64 << 20)
    big_header = bytearray(block_format.header_size_for(16))
    rows = []
    for what, nbytes, fns in (
        (f"one block ({spec.nbytes} bytes)", spec.nbytes, {
            "encode": lambda: encode_block(spec, key, digest, tokens, data, 0),
            "encode + seal": lambda: encode_block(spec, key, digest, tokens, data, 0, seal=seal),
            "check (CRC)": lambda: decode_block_into(plain, spec, key, digest, tokens, dest),
            "check (seal)": lambda: decode_block_into(sealed, spec, key, digest, tokens, dest, seal),
        }),
        ("64 MiB", len(big), {
            "CRC-32": lambda: block_format.payload_checksum(big),
            "seal (ChaCha20-Poly1305)": lambda: seal.seal(big_header, big, 16),
            "HMAC-SHA256": lambda: hmac.new(SECRET, big, "sha256").digest(),
            "keyed BLAKE2b": lambda: hashlib.blake2b(big, key=SECRET).digest(),
        }),
    ):
        for name, fn in fns.items():
            rows.append({"input": what, "operation": name, "MB_per_s": round(rate(fn, nbytes))})
    return rows


def engine_for(model: LoadedModel, room: int, *, ssd: Path | None = None, url: str | None = None,
               secret: bytes | None = None) -> Engine:
    engine = assemble_engine(model, EngineConfig(kv_cache_gb=0.3, max_model_len=room))
    if ssd is not None:
        open_disk_tier(engine, ssd, DiskConfig(min_free_bytes=0), secret=secret)
    if url is not None:
        open_remote_tier(engine, RemoteConfig(url=url, load_timeout_s=120.0, queue_blocks=4096), secret=secret)
    return engine


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    result = engine.collect(engine.submit(prompt, ONE))
    return time.perf_counter() - t0, result.num_cached_tokens


def hit_table(model: LoadedModel, length: int, reps: int, server: RedisServer, work: Path,
              drop: bool) -> list[dict[str, Any]]:
    prompt = [random.Random(length).randrange(1000, 40000) for _ in range(length)]
    room = length + 64
    for sealed in (False, True):  # one engine computes and writes to both tiers, per setting
        writer = engine_for(model, room, ssd=work / f"ssd-{sealed}", url=server.url[:-1] + str(int(sealed)),
                            secret=SECRET if sealed else None)
        ttft(writer, prompt)
        assert writer.shutdown(600)
    times: dict[tuple[str, bool], list[float]] = {}
    cached: dict[tuple[str, bool], int] = {}
    for rep in range(reps):
        for sealed in ((False, True) if rep % 2 == 0 else (True, False)):
            secret = SECRET if sealed else None
            for where in ("ssd", "redis"):
                if where == "ssd":
                    if drop:
                        drop_page_cache([work / f"ssd-{sealed}"])
                    engine = engine_for(model, room, ssd=work / f"ssd-{sealed}", secret=secret)
                else:
                    engine = engine_for(model, room, url=server.url[:-1] + str(int(sealed)), secret=secret)
                warm_up(engine)
                seconds, n = ttft(engine, prompt)
                engine.shutdown(120)
                del engine
                gc.collect()  # each engine's KV pool, before the next is made
                times.setdefault((where, sealed), []).append(seconds)
                cached[(where, sealed)] = n
                print(json.dumps({"rep": rep, "where": where, "sealed": sealed, "ttft_s": round(seconds, 3),
                                  "cached": n}), flush=True)
    rows = []
    for where in ("ssd", "redis"):
        off, on = statistics.median(times[(where, False)]), statistics.median(times[(where, True)])
        rows.append({"hit": "SSD restart" if where == "ssd" else "Redis replica", "tokens": length,
                     "cached_tokens": cached[(where, True)], "off_s": round(off, 3), "sealed_s": round(on, 3),
                     "sealed_x_off": round(on / off, 3),
                     "off_all_s": [round(t, 3) for t in times[(where, False)]],
                     "sealed_all_s": [round(t, 3) for t in times[(where, True)]]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model kvcellar serves (default: the embedded one)")
    p.add_argument("--weights", default="auto")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5, help="alternations of sealed and not (medians)")
    p.add_argument("--drop-page-cache", action="store_true", help="drop the block files' page cache first")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cache = ArtifactCache(Path(os.environ.get("KVCELLAR_CACHE_DIR", Path.home() / ".cache" / "kvcellar")) / "models")
    model = prepare_and_load(args.model, device="cpu", weights=args.weights, artifacts=cache)
    if native.folds_crc32():
        block_format.use_crc32(native.crc32)  # what an engine with a tier does
    out: dict[str, Any] = {"machine": machine_info(), "model": model.name, "weights": args.weights}
    probe = engine_for(model, args.length + 64)
    out["seal"] = seal_table(probe)
    probe.shutdown(30)
    rows = out["seal"]
    print(format_table(table("the seal alone, one core", list(rows[0]), [list(r.values()) for r in rows])), flush=True)
    with tempfile.TemporaryDirectory(prefix="kvc-sealed-") as tmp:
        server = RedisServer(Path(tmp) / "redis", maxmemory="8gb", databases="2").start()
        try:
            out["hits"] = hit_table(model, args.length, args.reps, server, Path(tmp), args.drop_page_cache)
        finally:
            server.stop()
    rows = [{k: v for k, v in r.items() if not k.endswith("_all_s")} for r in out["hits"]]
    print(format_table(table(f"TTFT of a {args.length}-token hit, medians of {args.reps}", list(rows[0]),
                             [list(r.values()) for r in rows])), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
