"""Weight-only int8 linears (``--weights int8``) beside full-precision weights, in one run.

    python benchmarks/bench_quantization.py [--dtype bfloat16] [--repeats 3] [--json out.json]

* quality on a fixed prompt set (plain transformers forward, no engine): greedy agreement
  (the full model's greedy continuation, teacher-forced through the int8 model: the share of
  positions whose argmax agrees; and the tokens until free-running greedy outputs first
  differ) and the max |logit difference|;
* decode ms/step at batch 1, 2, 4 and 8 (context 512), full and int8 engines interleaved;
* prefill tok/s at 512 tokens, both;
* where an int8 batch-1 decode step goes (torch profiler).
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
from kvcellar.config import EngineConfig
from kvcellar.engine import Engine
from kvcellar.engine.attention import ATTENTION_NAME
from kvcellar.engine.tokenization import encode_chat
from kvcellar.runtime import prepare_and_load

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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    loaded = {mode: prepare_and_load(None, dtype=args.dtype, device="cpu", weights=mode,
                                         artifacts=ArtifactCache.open(kvcellar_cache()))
              for mode in ("full", "int8")}
    result: dict[str, Any] = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    q = quality(loaded["full"].model, loaded["int8"].model, loaded["full"].tokenizer, args.new_tokens)
    result["quality"] = q
    print(f"quality vs full {args.dtype} ({len(PROMPTS)} prompts, {args.new_tokens} greedy tokens):")
    for k, v in q.items():
        print(f"  {k:<40} {v:.4g}")

    cfg = EngineConfig(kv_cache_gb=1.0, max_step_tokens=512, max_prefill_step_tokens=2048, prefix_caching=False,
                       max_num_seqs=16)
    engines = {mode: Engine(ld, cfg) for mode, ld in loaded.items()}
    result["decode"] = {}
    print(f"\ndecode ms/step (context {args.context}, {args.decode_steps} steps), full vs int8 interleaved")
    for batch in [int(b) for b in args.batches.split(",")]:
        times: dict[str, list[float]] = {"full": [], "int8": []}
        for r in range(args.repeats + 1):
            for mode, engine in engines.items():
                t = engine_decode_ms(engine, batch, args.context, args.decode_steps)
                if r:
                    times[mode].append(t)
        a, b = stats(times["full"]), stats(times["int8"])
        result["decode"][batch] = {"full_ms": a, "int8_ms": b, "speedup": a["median"] / b["median"]}
        print(f"  batch {batch}: full {a['median']:.1f} [{a['min']:.1f}-{a['max']:.1f}]  "
              f"int8 {b['median']:.1f} [{b['min']:.1f}-{b['max']:.1f}]  {a['median'] / b['median']:.2f}x  "
              f"({batch * 1e3 / b['median']:.1f} tok/s int8)")

    prefill: dict[str, list[float]] = {"full": [], "int8": []}
    for r in range(args.repeats + 1):
        for mode, engine in engines.items():
            t = engine_prefill(engine, prompt_of(512, 500 + r))
            if r:
                prefill[mode].append(512 / t)
    a, b = stats(prefill["full"]), stats(prefill["int8"])
    result["prefill_512_tok_s"] = {"full": a, "int8": b}
    print(f"\nprefill 512 tokens tok/s: full {a['median']:.0f} [{a['min']:.0f}-{a['max']:.0f}]  "
          f"int8 {b['median']:.0f} [{b['min']:.0f}-{b['max']:.0f}]")

    breakdown = profile_decode_step(engines["int8"], args.context)
    result["int8_decode_step_breakdown_ms"] = breakdown
    print("\nint8 batch-1 decode step, where the time goes (ms; the int8 kernel counts under 'rest'):")
    for k, v in breakdown.items():
        print(f"  {k:<45} {v:>7.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
