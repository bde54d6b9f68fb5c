"""Weight-only quantized linears (``--weights int8|int4``) beside full-precision weights, in one run.

    python benchmarks/bench_quantization.py [--dtype bfloat16] [--repeats 3] [--json out.json]

* quality on a fixed prompt set (plain transformers forward, no engine): greedy agreement
  (the full model's greedy continuation, teacher-forced through the quantized model: the share of
  positions whose argmax agrees; and the tokens until free-running greedy outputs first
  differ) and the max |logit difference|;
* decode ms/step at batch 1, 2, 4 and 8 (context 512), full and quantized engines interleaved;
* prefill tok/s at 512 tokens, both;
* where a batch-1 decode step goes, per mode (torch profiler).
"""

from __future__ import annotations

# ruff: noqa: I001  -- kvcellar is imported before torch on purpose (OMP_WAIT_POLICY)

import argparse
import json
from typing import Any

import kvcellar  # noqa: F401  (OMP wait policy before torch)
import torch

from bench_engine import engine_decode_ms, engine_prefill, kvcellar_cache, profile_decode_step, prompt_of, stats
from kvcellar.artifacts import ArtifactCache
from kvcellar.engine.config import EngineConfig
from kvcellar.engine import assemble_engine
from kvcellar.engine.attention import ATTENTION_NAME
from kvcellar.engine.tokenization import encode_chat
from kvcellar.runtime import prepare_and_load
from kvcellar.engine.warmup import warm_up

PROMPTS = (
    "Explain what a hash table is in two sentences.",
    "Write a haiku about a cold morning.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List three uses of a paperclip.",
    "Translate 'good evening, friends' into French.",
    "How do I reverse a list in Python?",
    "Give me a one-line summary of photosynthesis.",
    "What is 17 times 23?",
)


@torch.inference_mode()
def quality(full: Any, quant: Any, tokenizer: Any, new_tokens: int) -> dict[str, float]:
    agree = total = 0
    max_diff = 0.0
    same_prefix: list[int] = []
    for model in (full, quant):
        model.set_attn_implementation("sdpa")
    try:
        for text in PROMPTS:
            ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
            x = torch.tensor([ids])
            ref = full.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)
            got = quant.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
            a, b = ref[0, len(ids):].tolist(), got[0, len(ids):].tolist()
            same_prefix.append(next((i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q),
                                    min(len(a), len(b))))
            # teacher-forced: both models see the full model's continuation
            lf = full(ref, use_cache=False).logits[0, len(ids) - 1 : -1].float()
            lq = quant(ref, use_cache=False).logits[0, len(ids) - 1 : -1].float()
            agree += int((lf.argmax(-1) == lq.argmax(-1)).sum())
            total += lf.shape[0]
            max_diff = max(max_diff, float((lf - lq).abs().max()))
    finally:
        for model in (full, quant):
            model.set_attn_implementation(ATTENTION_NAME)
    return {"teacher_forced_argmax_agreement": agree / total, "max_abs_logit_diff": max_diff,
            "free_running_identical_tokens_median": sorted(same_prefix)[len(same_prefix) // 2],
            "free_running_fully_identical": sum(n == new_tokens for n in same_prefix) / len(same_prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="int8,int4", help="quantized modes to set beside full weights")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    modes = ["full", *args.modes.split(",")]
    loaded = {mode: prepare_and_load(None, dtype=args.dtype, device="cpu", weights=mode,
                                     artifacts=ArtifactCache.open(kvcellar_cache()))
              for mode in modes}
    result: dict[str, Any] = {"dtype": args.dtype, "threads": torch.get_num_threads(), "quality": {}}
    for mode in modes[1:]:
        q = quality(loaded["full"].model, loaded[mode].model, loaded["full"].tokenizer, args.new_tokens)
        result["quality"][mode] = q
        print(f"quality of {mode} vs full {args.dtype} ({len(PROMPTS)} prompts, {args.new_tokens} greedy tokens):")
        for k, v in q.items():
            print(f"  {k:<40} {v:.4g}")

    cfg = EngineConfig(kv_cache_gb=1.0, max_step_tokens=512, max_prefill_step_tokens=2048, prefix_caching=False,
                       max_num_seqs=16)
    engines = {mode: assemble_engine(ld, cfg) for mode, ld in loaded.items()}
    for mode, engine in engines.items():
        warm_up(engine)  # as the server does: the decode threads measured
        print(f"{mode}: decode on {engine.runner.decode_threads} thread(s)")
    result["decode"] = {}
    print(f"\ndecode ms/step (context {args.context}, {args.decode_steps} steps), modes interleaved")
    for batch in [int(b) for b in args.batches.split(",")]:
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for r in range(args.repeats + 1):
            for mode, engine in engines.items():
                t = engine_decode_ms(engine, batch, args.context, args.decode_steps)
                if r:
                    times[mode].append(t)
        row = {mode: stats(ts) for mode, ts in times.items()}
        result["decode"][batch] = row
        print(f"  batch {batch}: " + "  ".join(
            f"{mode} {v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}] ({batch * 1e3 / v['median']:.1f} tok/s)"
            for mode, v in row.items()))

    prefill: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(args.repeats + 1):
        for mode, engine in engines.items():
            t = engine_prefill(engine, prompt_of(512, 500 + r))
            if r:
                prefill[mode].append(512 / t)
    result["prefill_512_tok_s"] = {mode: stats(v) for mode, v in prefill.items()}
    print("\nprefill 512 tokens tok/s: " + "  ".join(
        f"{mode} {v['median']:.0f} [{v['min']:.0f}-{v['max']:.0f}]" for mode, v in result["prefill_512_tok_s"].items()))

    for mode in modes:
        breakdown = profile_decode_step(engines[mode], args.context)
        result[f"{mode}_decode_step_breakdown_ms"] = breakdown
        print(f"\n{mode} batch-1 decode step, where the time goes (ms):")
        for k, v in breakdown.items():
            print(f"  {k:<45} {v:>7.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
