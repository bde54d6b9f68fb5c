"""Batch-1 decode on larger models by weights mode, beside plain transformers and the
memory-bandwidth floor (issue 13).

    python benchmarks/bench_weights.py [--models qwen2.5-0.5b,qwen2.5-1.5b] [--modes full,int8,int4]

Models are built from the real configs' shapes (Qwen2.5-0.5B / 1.5B: hidden size, layers,
heads, GQA, intermediate size, vocabulary, tied embeddings) with random weights: speed
depends on shapes, not values. For each weights mode, a kvcellar engine (warmed up as the
server does: decode threads and the quantized kernels' cross-over measured) decodes at
context ``--context``; plain transformers (bf16, SDPA, DynamicCache, its own modules)
decodes the same number of steps. The floor is the bytes a decode step must read (every
linear's weights in that mode, the KV of the context) divided by the machine's read
bandwidth, measured here with the threads decode runs on.
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import gc
import json
import time
from typing import Any

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch
from torch import nn

from bench_engine import engine_decode_ms, hf_decode_ms, stats
from kvcellar.artifacts import ArtifactCache
from kvcellar.engine.config import EngineConfig
from kvcellar.engine import assemble_engine
from kvcellar.engine.loader import wrap_model
from kvcellar.quantization import quantize_model
from kvcellar.runtime import prepare_and_load
from kvcellar.engine.warmup import warm_up

# Shapes of the published configs (config.json of Qwen/Qwen2.5-0.5B-Instruct and -1.5B-Instruct).
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
}


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a sum over a buffer larger than any cache reads, best of ``repeats``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(before)


def build(name: str, tokenizer: Any, mode: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "smollm2-135m":
        return prepare_and_load(None, dtype="bfloat16", device="cpu", weights=mode, artifacts=ArtifactCache.open())
    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                               **CONFIGS[name])
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    quantized = quantize_model(model, mode)
    loaded = wrap_model(model, tokenizer, name=name, weights_id=f"random:{name}|weights={mode}")
    loaded.quantized = quantized
    return loaded


def step_bytes(loaded: Any, context: int) -> int:
    """Bytes a batch-1 decode step reads: each linear's weights as stored in its mode (the
    quantized form where there is one), one embedding row, and the KV of ``context`` tokens.
    Call it before an engine prepares the model (its linears are ``nn.Linear`` until then)."""
    total = 0
    for name, module in loaded.model.named_modules():
        if isinstance(module, nn.Linear):
            q = loaded.quantized.get(name)
            total += q.nbytes if q is not None else module.weight.numel() * module.weight.element_size()
    text = loaded.model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    total += text.hidden_size * 2 + context * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 2
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--modes", default="full,int8,int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    tokenizer = prepare_and_load(None, dtype="bfloat16", device="cpu", weights="full",
                                 artifacts=ArtifactCache.open()).tokenizer
    bandwidth = {n: read_bandwidth(n) for n in sorted({1, torch.get_num_threads()})}
    print("read bandwidth: " + ", ".join(f"{n} thread(s) {b / 1e9:.1f} GB/s" for n, b in bandwidth.items()))
    result: dict[str, Any] = {"bandwidth_bytes_per_s": bandwidth, "context": args.context, "models": {}}
    for name in args.models.split(","):
        rows: dict[str, Any] = {}
        plain = build(name, tokenizer, "full").model  # transformers' own modules, never prepared
        plain.set_attn_implementation("sdpa")
        hf = stats([hf_decode_ms(plain, 1, args.context, args.steps) for _ in range(args.repeats + 1)][1:])
        del plain
        gc.collect()
        print(f"\n{name}: transformers (bf16, DynamicCache) {hf['median']:.1f} ms/step "
              f"({1e3 / hf['median']:.1f} tok/s)")
        print(f"{'weights':>8} {'ms/step':>20} {'tok/s':>7} {'vs transformers':>16} {'MB/step':>8} "
              f"{'floor ms':>9} {'floor/step':>11}")
        for mode in args.modes.split(","):
            loaded = build(name, tokenizer, mode)
            nbytes = step_bytes(loaded, args.context)
            engine = assemble_engine(loaded, EngineConfig(kv_cache_gb=0.5, prefix_caching=False, max_num_seqs=4))
            warm_up(engine)
            ms = stats([engine_decode_ms(engine, 1, args.context, args.steps) for _ in range(args.repeats + 1)][1:])
            floor = nbytes / bandwidth[engine.runner.decode_threads] * 1e3
            rows[mode] = {"ms_per_step": ms, "tok_s": 1e3 / ms["median"], "bytes_per_step": nbytes,
                          "floor_ms": floor, "floor_fraction": floor / ms["median"],
                          "speedup_vs_transformers": hf["median"] / ms["median"],
                          "decode_threads": engine.runner.decode_threads}
            print(f"{mode:>8} {ms['median']:>8.1f} [{ms['min']:.1f}-{ms['max']:.1f}] {1e3 / ms['median']:>7.1f} "
                  f"{hf['median'] / ms['median']:>15.2f}x {nbytes / 1e6:>8.0f} {floor:>9.1f} "
                  f"{floor / ms['median']:>10.0%}")
            engine.shutdown(5)
            del engine, loaded
            gc.collect()
        result["models"][name] = {"transformers_ms_per_step": hf, "modes": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
