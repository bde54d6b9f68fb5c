"""Quantized KV (``--kv-bits 8|4``) beside 16-bit KV: bytes, restart and Redis hits, decode, quality.

    .venv/bin/python benchmarks/bench_kv_quant.py --out bench-results/kv-quant.json          # ~10 min
    .venv/bin/python benchmarks/bench_kv_quant.py --skip-quality --lengths 4096               # ~3 min

In one process, the embedded model in bf16 (``--model`` for another, ``--dtype float32`` for KV in
float32 as "16 bits"), for each of 16/8/4 bits:

1. bytes per token of the KV layout (also for a Qwen2.5-0.5B and a Llama-3.1-8B shape, from
   their configs' numbers), and the tokens ``--kv-cache-gb`` buys;
2. TTFT of a ``--lengths`` prompt cold, after a restart with its blocks on the SSD (page
   cache of the block files dropped, as a reboot would leave them), and on a second replica
   with its blocks in a real ``redis-server`` (started here on a free loopback port);
3. one decode step at ``--decode-context`` (4096) tokens of context, batch 1 (median of 16);
4. quality against 16-bit KV over the same prompts (a chat turn, a code question, a
   ~4k-token document): greedy tokens over ``--quality-tokens`` (256) generated, the index of
   the first that differs and the share of positions equal, and the max / mean |delta
   logprob| of the chosen token over the steps before the first difference (same context on
   both sides). On the embedded model and on a Qwen2.5-0.5B-shaped model with random weights
   (shape-driven error; its tokens mean nothing, their agreement does).

5. with ``--peer-bin`` (llama.cpp's ``llama-server``, default: where benchmarks/peer puts it,
   if there): the same GGUF served with ``-ctk f16 -ctv f16`` and ``-ctk q8_0 -ctv q8_0``
   (``-fa on``, which quantized V needs), its KV bytes per token from its log and its decode
   speed at ``--decode-context`` tokens (its own ``timings``).

Figures only, no asserts. Run on a quiet machine (``uptime`` below ~1.5).
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch

from kvcellar.artifacts import ArtifactCache
from kvcellar.bench.launch import ServerLauncher
from kvcellar.bench.pagecache import drop_page_cache
from kvcellar.bench.report import format_table, machine_info, table
from kvcellar.cache.kv_pool import KVLayout
from kvcellar.engine.config import EngineConfig
from kvcellar.engine import Engine, assemble_engine, SamplingParams
from kvcellar.engine.loader import LoadedModel, wrap_model
from kvcellar.engine.tokenization import encode_chat
from kvcellar.runtime import prepare_and_load
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from kvcellar.storage.remote.config import RemoteConfig
from kvcellar.storage.remote.tier import RemoteTier
from kvcellar.engine.warmup import warm_up

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.remote.redis_server import RedisServer  # (the one way a real redis-server starts)

BITS = (16, 8, 4)
PEER_BIN = Path(os.environ.get("LLAMA_SERVER_BIN", "/work/llama-server/bin/llama-server"))
ONE = SamplingParams(max_tokens=1, temperature=0.0)
# Configs' numbers: layers, KV heads, head dim.
SHAPES = {"Qwen2.5-0.5B": (24, 2, 64), "Llama-3.1-8B": (32, 8, 128)}
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, tie_word_embeddings=True,
                rope_theta=1_000_000.0)


def engine_for(model: LoadedModel, bits: int, kv_gb: float, *, ssd: Path | None = None, url: str | None = None,
               max_model_len: int = 0, block_size: int = EngineConfig.block_size) -> Engine:
    engine = assemble_engine(model, EngineConfig(kv_bits=bits, kv_cache_gb=kv_gb, max_model_len=max_model_len,
                                                 block_size=block_size))
    if ssd is not None:
        engine.attach_tier(DiskTier(ssd, engine.fingerprint, engine.block_spec, DiskConfig(min_free_bytes=0),
                                    descriptor=engine.descriptor))
    if url is not None:
        engine.attach_tier(RemoteTier(url, engine.fingerprint, engine.block_spec,
                                      RemoteConfig(load_timeout_s=120.0, queue_blocks=4096)))
    return engine


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    result = engine.collect(engine.submit(prompt, ONE))
    return time.perf_counter() - t0, result.num_cached_tokens


def lower(engine: Engine, name: str) -> Any:
    return next(a.tier for a in engine.lower.tiers if a.tier.name == name)


def show(title: str, rows: list[dict[str, Any]]) -> None:
    if rows:
        print(format_table(table(title, list(rows[0]), [list(r.values()) for r in rows])), flush=True)


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def bytes_table(model: LoadedModel, kv_gb: float) -> list[dict[str, Any]]:
    rows = []
    shapes = {model.name: None, **SHAPES}
    for name, shape in shapes.items():
        for bits in BITS:
            if shape is None:
                lay = KVLayout.from_model_config(model.config, 16, model.dtype, bits)
            else:
                lay = KVLayout(*shape, 16, torch.bfloat16, bits)
            base = (KVLayout.from_model_config(model.config, 16, model.dtype) if shape is None
                    else KVLayout(*shape, 16, torch.bfloat16))
            rows.append({"model": name, "kv_bits": bits, "bytes_per_token": lay.bytes_per_token,
                         "x_16bit": round(lay.bytes_per_token / base.bytes_per_token, 3),
                         "tokens_per_gb": int((1 << 30) // lay.bytes_per_token),
                         "pool_tokens": int(kv_gb * (1 << 30)) // lay.bytes_per_block * 16})
    return rows


def hit_table(model: LoadedModel, lengths: list[int], kv_gb: float, server: RedisServer, work: Path,
              bit_settings: tuple[int, ...] = BITS, block_size: int = EngineConfig.block_size) -> list[dict[str, Any]]:
    rows = []
    room = max(lengths) + 64  # an 8192-token prompt on an 8192-token model: past its trained context
    for n in lengths:
        prompt = random_prompt(n, n)
        for bits in bit_settings:
            ssd = work / f"ssd-{bits}-{n}"
            a = engine_for(model, bits, kv_gb, ssd=ssd, url=server.url, max_model_len=room, block_size=block_size)
            warm_up(a)
            cold, _ = ttft(a, prompt)
            # the cold prompt's blocks are written to the SSD and Redis first: a hit beside
            # that write-through shares the CPU with it
            assert lower(a, "remote").wait_idle(600) and lower(a, "ssd").wait_idle(600)
            ram, _ = ttft(a, prompt)
            assert a.shutdown(120)
            drop_page_cache([ssd])
            b = engine_for(model, bits, kv_gb, ssd=ssd, max_model_len=room,  # restart: the SSD holds it
                           block_size=block_size)
            warm_up(b)
            restart, cached_ssd = ttft(b, prompt)
            assert b.shutdown(120)
            c = engine_for(model, bits, kv_gb, url=server.url, max_model_len=room,  # another replica: Redis holds it
                           block_size=block_size)
            warm_up(c)
            redis_hit, cached_redis = ttft(c, prompt)
            assert c.shutdown(120)
            server.client().flushall()
            rows.append({"tokens": n, "kv_bits": bits, "cold_s": round(cold, 3), "ram_hit_s": round(ram, 3),
                         "ssd_restart_s": round(restart, 3), "redis_hit_s": round(redis_hit, 3),
                         "ssd_cached": cached_ssd, "redis_cached": cached_redis})
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        base = next((r for r in rows if r["tokens"] == row["tokens"] and r["kv_bits"] == 16), None)
        if base is None:
            continue
        row["ssd_x_16bit"] = round(row["ssd_restart_s"] / base["ssd_restart_s"], 2)
        row["redis_x_16bit"] = round(row["redis_hit_s"] / base["redis_hit_s"], 2)
    return rows


def decode_table(model: LoadedModel, context: int, kv_gb: float, steps: int = 16) -> list[dict[str, Any]]:
    rows = []
    prompt = random_prompt(context, 7)
    for bits in BITS:
        engine = engine_for(model, bits, kv_gb)
        warm_up(engine)
        handle = engine.submit(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
        times = []
        while True:
            t0 = time.perf_counter()
            if not engine.step():
                break
            times.append(time.perf_counter() - t0)
        engine.collect(handle)
        decode = [t for t in times if t < 5 * statistics.median(times[-steps:])][-steps:]
        rows.append({"kv_bits": bits, "context": context, "decode_step_ms": round(statistics.median(decode) * 1e3, 2)})
        engine.shutdown(30)
    for row in rows:
        row["x_16bit"] = round(row["decode_step_ms"] / rows[0]["decode_step_ms"], 3)
    return rows


def quality_prompts(model: LoadedModel) -> dict[str, list[int]]:
    doc_para = ("The municipal water board met on Tuesday to review the quarterly maintenance report. Pipe "
                "replacements in the northern district finished two weeks early, while the pumping station on "
                "River Road still waits for a new motor. Residents asked about billing errors from March. ")
    tok = model.tokenizer
    doc = doc_para * max(1, 4000 // len(tok(doc_para).input_ids))
    chats = {
        "chat": [{"role": "user", "content": "Plan a three-day trip to Lisbon for someone who likes museums."}],
        "code": [{"role": "user", "content": "Write a Python function that merges overlapping intervals, "
                                             "with a docstring and two examples."}],
        "doc-4k": [{"role": "system", "content": doc},
                   {"role": "user", "content": "Summarise what the board discussed and what is still open."}],
    }
    return {name: encode_chat(tok, messages) for name, messages in chats.items()}


def quality_rows(model: LoadedModel, label: str, tokens: int, kv_gb: float) -> list[dict[str, Any]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    prompts = quality_prompts(model)
    runs: dict[int, dict[str, Any]] = {}
    for bits in BITS:
        engine = engine_for(model, bits, kv_gb)
        runs[bits] = {name: engine.generate([p], params)[0] for name, p in prompts.items()}
        engine.shutdown(30)
    rows = []
    for bits in BITS[1:]:
        for name, prompt in prompts.items():
            ref, got = runs[16][name], runs[bits][name]
            n = min(len(ref.token_ids), len(got.token_ids))
            first = next((i for i in range(n) if ref.token_ids[i] != got.token_ids[i]), n)
            deltas = [abs(a - b) for a, b in zip(ref.logprobs[:first], got.logprobs[:first], strict=True)]
            rows.append({"model": label, "prompt": name, "prompt_tokens": len(prompt), "kv_bits": bits,
                         "first_diff": first if first < n else None, "generated": n,
                         "positions_equal": round(sum(a == b for a, b in zip(ref.token_ids, got.token_ids,
                                                                              strict=False)) / n, 3),
                         "max_dlogprob": round(max(deltas), 4) if deltas else None,
                         "mean_dlogprob": round(statistics.mean(deltas), 5) if deltas else None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def random_qwen(tokenizer: Any, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), **QWEN_05B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None
    return wrap_model(model, tokenizer, name="Qwen2.5-0.5B-shape-random")


def peer_rows(gguf: Path, binary: Path, context: int, work: Path, steps: int = 64) -> list[dict[str, Any]]:
    """llama-server on ``gguf`` with 16-bit and q8_0 KV: KV bytes per token (its log's
    ``llama_kv_cache: size = X MiB`` over its context) and decode tok/s at ``context``."""
    import httpx

    rows = []
    prompt = random_prompt(context, 7)
    for kind in ("f16", "q8_0"):
        ctx = context + steps + 64

        def command(port: int, kind: str = kind, ctx: int = ctx) -> list[str]:
            return [str(binary), "-m", str(gguf), "--port", str(port), "-c", str(ctx), "-np", "1",
                    "-t", str(os.cpu_count() or 1), "-fa", "on", "-ctk", kind, "-ctv", kind]

        log = work / f"llama-server-{kind}.log"
        server = ServerLauncher(command, log, name="llama-server")
        server.start(timeout=300)
        try:
            body = {"prompt": prompt, "max_tokens": steps, "temperature": 0.0, "ignore_eos": True}
            reply = httpx.post(server.url + "/completion", json={**body, "n_predict": steps}, timeout=3600).json()
            per_s = reply["timings"]["predicted_per_second"]
        finally:
            server.stop(60)
        mib = [float(m) for m in re.findall(r"llama_kv_cache:\s+size\s*=\s*([0-9.]+) MiB", log.read_text())]
        rows.append({"kv": kind, "context": context, "decode_step_ms": round(1e3 / per_s, 2),
                     "bytes_per_token": int(mib[-1] * (1 << 20) / ctx) if mib else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model kvcellar serves (default: the embedded one)")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192])
    p.add_argument("--decode-context", type=int, default=4096)
    p.add_argument("--quality-tokens", type=int, default=256)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--hit-bits", type=lambda s: tuple(int(x) for x in s.split(",")), default=BITS,
                   help="the kv settings the hit table measures (a 7B's cold prefill is minutes each)")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size,
                   help="tokens per KV block in the hit table: one SSD file / Redis value each")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-hits", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--quality-models", default="embedded,random",
                   help="whose quality to measure: the model served (embedded) and/or the random 0.5B shape")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the models' dtype, so the KV of '16 bits' (float32 is faster where bf16 is not native)")
    p.add_argument("--peer-bin", type=Path, default=PEER_BIN if PEER_BIN.exists() else None)
    p.add_argument("--weights", default="full", help="as `kvcellar serve --weights`: a 7-8B GGUF needs auto/int4 here")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    cache = ArtifactCache(Path(os.environ.get("KVCELLAR_CACHE_DIR", Path.home() / ".cache" / "kvcellar")) / "models")
    model = prepare_and_load(args.model, dtype=args.dtype, device="cpu", weights=args.weights, artifacts=cache)
    out: dict[str, Any] = {"machine": machine_info(), "model": model.name, "dtype": args.dtype, "weights": args.weights}
    out["bytes"] = bytes_table(model, args.kv_cache_gb)
    show("KV bytes per token", out["bytes"])
    if not args.skip_decode:
        out["decode"] = decode_table(model, args.decode_context, args.kv_cache_gb)
        show("decode step, batch 1", out["decode"])
    if not args.skip_hits:
        with tempfile.TemporaryDirectory(prefix="kvq-") as tmp:
            server = RedisServer(Path(tmp) / "redis", maxmemory="8gb").start()
            try:
                out["hits"] = hit_table(model, args.lengths, args.kv_cache_gb, server, Path(tmp), args.hit_bits,
                                        args.block_size)
            finally:
                server.stop()
        show("TTFT: cold, RAM hit, SSD after a restart, Redis on another replica", out["hits"])
    if not args.skip_quality:
        which = args.quality_models.split(",")
        out["quality"] = quality_rows(model, model.name, args.quality_tokens, args.kv_cache_gb) \
            if "embedded" in which else []
        if "random" in which:
            out["quality"] += quality_rows(random_qwen(model.tokenizer, model.dtype),
                                           "Qwen2.5-0.5B shape, random weights", args.quality_tokens, args.kv_cache_gb)
        show("quality against 16-bit KV", out["quality"])
    if args.peer_bin is not None and model.source.kind == "gguf" and not args.skip_peer:
        with tempfile.TemporaryDirectory(prefix="kvq-peer-") as tmp:
            out["llama_server"] = peer_rows(model.source.path, args.peer_bin, args.decode_context, Path(tmp))
        show("llama-server, same GGUF: f16 and q8_0 KV", out["llama_server"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
