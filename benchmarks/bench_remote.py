"""The shared remote tier (Redis) on replica B after replica A computed the prompt.

In one run, per prompt length: TTFT on B for a cold prompt, a remote hit (B's RAM and SSD
empty, Redis holds A's blocks), a local SSD hit and a RAM hit, next to the floor of a
remote hit: KV bytes / measured loopback Redis GET throughput + one step (the RAM-hit
TTFT, which computes only the last token). Then the cost of write-through to Redis on
decode throughput at 8 streams (interleaved rounds, with and without the remote tier).

Every engine is warmed up before it is measured, as ``kvcellar serve`` does (the remote
hit is B's first request: unwarmed, it paid the first run of each attention path). TTFT
ends when the engine emits the first token (``StampedStream``), as a server streams it,
not when the step that produced it is over.
Everything runs in process (engines share one loaded model) against a real
``redis-server`` started on a free loopback port (tests/remote/redis_server.py).

    .venv/bin/python benchmarks/bench_remote.py                 # 2048/4096/8176 tokens
    .venv/bin/python benchmarks/bench_remote.py --sizes 512 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvcellar  # noqa: F401  (OMP wait policy before torch)
from kvcellar.artifacts import ArtifactCache
from kvcellar.engine import Engine, EventStream, SamplingParams, TokenEvent, assemble_engine, observability
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.warmup import warm_up
from kvcellar.runtime import prepare_and_load
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from kvcellar.storage.remote.config import RemoteConfig
from kvcellar.storage.remote.tier import RemoteTier

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.remote.redis_server import RedisServer  # (the one way a real redis-server starts)

ONE = SamplingParams(max_tokens=1, temperature=0.0)


REMOTE_TIMEOUT_S = 0.25


def engine_with(model, cfg: EngineConfig, url: str | None, ssd_dir: Path | None) -> Engine:
    engine = assemble_engine(model, cfg)
    if ssd_dir is not None:
        engine.attach_tier(DiskTier(ssd_dir, engine.fingerprint, engine.block_spec, DiskConfig(min_free_bytes=0),
                                    descriptor=engine.descriptor))
    if url is not None:
        engine.attach_tier(RemoteTier(url, engine.fingerprint, engine.block_spec,
                                      RemoteConfig(timeout_s=REMOTE_TIMEOUT_S, load_timeout_s=60.0,
                                                       queue_blocks=1024)))
    return engine


def tier(engine: Engine, name: str):
    return next(a.tier for a in engine.lower.tiers if a.tier.name == name)


class StampedStream(EventStream):
    """Notes when the engine emits the first event: what a client sees, without the work
    the engine does after emitting it in the same step (promoting loaded blocks into
    faster tiers happens after the forward, ``LowerTierLink.flush``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: float | None = None

    def put(self, event: TokenEvent) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        super().put(event)


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    stream = StampedStream()
    t0 = time.perf_counter()
    result = engine.collect(engine.submit(prompt, ONE, stream=stream))
    assert stream.first is not None
    return stream.first - t0, result.num_cached_tokens


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def redis_get_throughput(server: RedisServer, value_bytes: int, count: int = 64) -> float:
    """Bytes/s of pipelined GETs of block-sized values over loopback (redis-py, one connection)."""
    client = server.client()
    value = bytes(value_bytes)
    for i in range(count):
        client.set(f"bench:{i}", value)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            pipe.get(f"bench:{i}")
        pipe.execute()
        best = max(best, count * value_bytes / (time.perf_counter() - t0))
    client.delete(*(f"bench:{i}" for i in range(count)))
    return best


def ttft_table(model, cfg, server, sizes, repeats, work: Path, rng) -> list[dict]:
    rows = []
    for n in sizes:
        prompt = random_prompt(rng, n)
        a = engine_with(model, cfg, server.url, None)
        warm_up(a)  # as a server does before it serves: no one-off costs in the figures
        t_cold_a, _ = ttft(a, prompt)
        assert tier(a, "remote").wait_idle(300)
        a.shutdown(60)
        block_bytes = None
        samples: dict[str, list[float]] = {"cold": [t_cold_a], "remote": [], "ssd": [], "ram": []}
        cached: dict[str, int] = {}
        for r in range(repeats):
            b = engine_with(model, cfg, server.url, work / f"b-{n}-{r}")
            warm_up(b)
            block_bytes = b.block_spec.nbytes
            t, cached["remote"] = ttft(b, prompt)
            samples["remote"].append(t)
            assert observability.snapshot(b)["remote_link_loaded_blocks"] > 0
            assert tier(b, "ssd").wait_idle(300)
            b.blocks.evict_all()
            t, cached["ssd"] = ttft(b, prompt)
            samples["ssd"].append(t)
            t, cached["ram"] = ttft(b, prompt)
            samples["ram"].append(t)
            if r + 1 < repeats or n <= 4096:  # a cold 8k prefill takes long: one is enough there
                t, _ = ttft(b, random_prompt(rng, n))
                samples["cold"].append(t)
            b.shutdown(60)
        assert block_bytes is not None
        kv_bytes = cached["remote"] // cfg.block_size * block_bytes
        rows.append({"tokens": n, "kv_bytes": kv_bytes, "cached": cached,
                     **{k: v for k, v in samples.items()}})
        print(f"[{n} tokens] {json.dumps(rows[-1])}", flush=True)
    return rows


def decode_cost(model, cfg, server, streams: int, rounds: int, rng) -> list[dict]:
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    out = []
    for r in range(rounds):
        for variant in (("off", "remote") if r % 2 == 0 else ("remote", "off")):
            engine = engine_with(model, cfg, server.url if variant == "remote" else None, None)
            prompts = [random_prompt(rng, 256) for _ in range(streams)]
            engine.generate([p[:16] for p in prompts[:1]], ONE)  # warm-up
            t0 = time.perf_counter()
            results = engine.generate(prompts, params)
            dt = time.perf_counter() - t0
            tokens = sum(len(x.token_ids) for x in results)
            stored = observability.snapshot(engine).get("remote_link_stored_blocks", 0)
            engine.shutdown(60)
            out.append({"round": r, "variant": variant, "tok_s": tokens / dt, "remote_blocks_offered": stored})
            print(f"[decode] {json.dumps(out[-1])}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048,4096,8176", help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved decode rounds per variant")
    ap.add_argument("--remote-timeout", type=float, default=2.0,
                    help="per round trip; larger than the serving default so a loaded machine measures "
                         "loads, not dropped writes (default %(default)s)")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    global REMOTE_TIMEOUT_S
    REMOTE_TIMEOUT_S = args.remote_timeout
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(1234)
    model = prepare_and_load(None, dtype=args.dtype, device="cpu", artifacts=ArtifactCache.open())
    cfg = EngineConfig(kv_cache_gb=1.0, block_size=16, max_step_tokens=512, max_prefill_step_tokens=2048,
                       max_num_seqs=16)
    with tempfile.TemporaryDirectory(prefix="kvc-bench-remote-") as tmp:
        work = Path(tmp)
        server = RedisServer(work / "redis", maxmemory="4gb", **{"maxmemory-policy": "allkeys-lru"}).start()
        try:
            probe = assemble_engine(model, cfg)
            block_bytes = probe.block_spec.nbytes
            probe.shutdown(10)
            throughput = redis_get_throughput(server, block_bytes)
            rows = ttft_table(model, cfg, server, sizes, args.repeats, work, rng)
            decode = decode_cost(model, cfg, server, args.streams, args.rounds, rng) if args.rounds else []
        finally:
            server.stop()

    med = statistics.median
    print(f"\nloopback Redis GET throughput (redis-py, pipelined, {block_bytes} B values): "
          f"{throughput / 2**20:.0f} MiB/s; dtype {args.dtype}\n")
    print("| tokens | cold s | remote hit s | SSD hit s | RAM hit s | floor s | remote/cold | remote/floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        floor = row["kv_bytes"] / throughput + med(row["ram"])
        remote = med(row["remote"])
        row["floor"] = floor
        rng_of = lambda xs: f"{med(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"  # noqa: E731
        print(f"| {row['tokens']} | {rng_of(row['cold'])} | {rng_of(row['remote'])} | {rng_of(row['ssd'])} | "
              f"{rng_of(row['ram'])} | {floor:.3f} | {remote / med(row['cold']):.3f} | {remote / floor:.2f} |")
    if decode:
        off = [d["tok_s"] for d in decode if d["variant"] == "off"]
        on = [d["tok_s"] for d in decode if d["variant"] == "remote"]
        print(f"\ndecode at {args.streams} streams, tok/s median (range): without remote {med(off):.1f} "
              f"({min(off):.1f}-{max(off):.1f}); write-through to Redis {med(on):.1f} ({min(on):.1f}-{max(on):.1f}); "
              f"cost {100 * (1 - med(on) / med(off)):.1f} %")
    if args.json:
        Path(args.json).write_text(json.dumps({"throughput_bps": throughput, "ttft": rows, "decode": decode},
                                              indent=2))


if __name__ == "__main__":
    main()
