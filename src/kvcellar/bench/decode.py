"""decode: aggregate output tok/s at 1 and 8 concurrent streams, by SSD policy (write_through/evict_only/off).

kvcellar is started once per --policies entry (default write_through, evict_only, off: the
disk tier's cost on the decode loop); all of them, and any peer, stay up for the whole run
and are measured in turn, in a rotated order per repeat, so a noisy minute hits every
variant alike. Each measurement sends C streams at once (C from --concurrency-levels,
default 1 and 8), each with its own fresh prompt (--prompt-tokens) and ignore_eos, so each
stream generates exactly --max-tokens tokens (a peer that ignores ignore_eos may stop
earlier; the tokens it really sent are counted). Aggregate tok/s = all completion tokens /
wall time from the first request sent to the last stream done; per-stream tok/s = 1 / the
mean gap between a stream's tokens. Issue 5's target: write-through costs <= 5 % decode
throughput against off.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcellar.bench import report
from kvcellar.bench.client import ChatClient
from kvcellar.bench.prompts import sentences
from kvcellar.bench.stats import Summary, ratio, summarize
from kvcellar.bench.targets import (
    SsdWrites,
    Target,
    add_target_arguments,
    cleanup_cache,
    peer_targets,
    variant_targets,
)

NAME = "decode"
POLICIES = ("write_through", "evict_only", "off")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    g = p.add_argument_group("decode")
    g.add_argument("--policies", default=",".join(POLICIES),
                   help="kvcellar --ssd-policy variants, comma-separated (default %(default)s)")
    g.add_argument("--concurrency-levels", default="1,8", help="concurrent streams, comma-separated (default 1,8)")
    g.add_argument("--prompt-words", type=int, default=None, help="words of each stream's prompt (default 96; "
                                                                   "--fast 16)")
    g.add_argument("--max-tokens", type=int, default=None, help="tokens each stream generates (default 128; "
                                                                 "--fast 16)")


# ---- the result (field names are result.json's keys) ------------------------------------------


@dataclass
class DecodeConfig:
    policies: list[str]  # emptied for a --base-url server
    concurrency: list[int]
    prompt_words: int
    max_tokens: int
    repeats: int
    seed: str


@dataclass(frozen=True)
class StreamsRun:
    """One measurement: ``streams`` streams sent at once."""

    wall_s: float
    tokens: int
    streams: int
    ok: int
    errors: list[str | None]
    aggregate_tok_s: float | None
    per_stream_tok_s: list[float]
    ttft_s: list[float]
    completion_tokens: list[int]
    usage_reported: bool


@dataclass
class DecodeRow:
    """One concurrency level on one target; ``tok_s_over_off`` is set once every target is measured."""

    aggregate_tok_s: Summary | None
    per_stream_tok_s: Summary | None
    ttft_s: Summary | None
    tokens_per_stream: list[int]
    errors: list[str | None]
    runs: list[StreamsRun]
    tok_s_over_off: float | None = None


@dataclass(frozen=True)
class DecodeTarget:
    kind: str
    concurrency: dict[int, DecodeRow]
    ssd: SsdWrites | None


@dataclass(frozen=True)
class DecodeResult:
    config: DecodeConfig
    baseline: str | None  # the target the others are compared with: kvcellar with --ssd-policy off
    targets: dict[str, DecodeTarget]
    servers: list[dict[str, Any]]
    tables: list[dict[str, Any]]


def _config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        policies=[p for p in args.policies.split(",") if p],
        concurrency=[int(c) for c in args.concurrency_levels.split(",")],
        prompt_words=args.prompt_words or (16 if args.fast else 96),
        max_tokens=args.max_tokens or (16 if args.fast else 128),
        repeats=args.repeats or (1 if args.fast else 3),
        seed=str(args.seed),
    )


def run(args: argparse.Namespace) -> DecodeResult:
    cfg = _config(args)
    out: Path = args.out
    targets = variant_targets(args, out, "--ssd-policy", cfg.policies)
    if args.base_url:
        cfg.policies = []
    targets += peer_targets(args, out)
    raw: dict[str, dict[int, list[StreamsRun]]] = {t.name: {c: [] for c in cfg.concurrency} for t in targets}
    counters: dict[str, dict[str, float]] = {}
    try:
        for t in targets:
            t.start()
        models = {t.name: t.served_model() for t in targets}
        for t in targets:
            asyncio.run(_streams(t, models[t.name], cfg, 2, f"{cfg.seed}:warm:{t.name}", max_tokens=4))
        for rep in range(cfg.repeats):
            order = targets[rep % len(targets):] + targets[:rep % len(targets)]
            for t in order:
                for c in cfg.concurrency:
                    # the same prompts for every target: each has its own cache, so all are cold
                    raw[t.name][c].append(asyncio.run(_streams(t, models[t.name], cfg, c,
                                                               f"{cfg.seed}:decode:{rep}:{c}")))
        for t in targets:
            counters[t.name] = t.counters()
    finally:
        for t in targets:
            t.stop()
            cleanup_cache(t, getattr(args, "keep_cache", False))
    results = {t.name: _figures(t, raw[t.name], counters.get(t.name, {})) for t in targets}
    base = "kvcellar-off" if "kvcellar-off" in results else None
    for res in results.values():
        for c, row in res.concurrency.items():
            ref = results[base].concurrency[c].aggregate_tok_s if base else None
            row.tok_s_over_off = ratio(row.aggregate_tok_s, ref)
    return DecodeResult(config=cfg, baseline=base, targets=results, servers=[t.describe() for t in targets],
                        tables=_tables(cfg, results))


async def _streams(target: Target, model: str, cfg: DecodeConfig, n: int, seed: str,
                   max_tokens: int | None = None) -> StreamsRun:
    async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            client.stream_chat([{"role": "user", "content": f"Stream {seed}:{i}. " +
                                 sentences(f"{seed}:{i}", cfg.prompt_words)}],
                               max_tokens or cfg.max_tokens, ignore_eos=True)
            for i in range(n)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    steps = [r.decode_step_s for r in ok if r.decode_step_s]
    return StreamsRun(wall_s=wall, tokens=tokens, streams=n, ok=len(ok),
                      errors=[r.error for r in results if not r.ok],
                      aggregate_tok_s=tokens / wall if wall > 0 else None,
                      per_stream_tok_s=[1.0 / s for s in steps],
                      ttft_s=[r.ttft_s for r in ok if r.ttft_s is not None],  # an ok stream has its TTFT
                      completion_tokens=[r.output_tokens for r in ok],
                      usage_reported=all(r.completion_tokens is not None for r in ok))


def _figures(target: Target, raw: dict[int, list[StreamsRun]], counters: dict[str, float]) -> DecodeTarget:
    rows: dict[int, DecodeRow] = {}
    for c, runs in raw.items():
        per_stream = [sum(r.per_stream_tok_s) / len(r.per_stream_tok_s) for r in runs if r.per_stream_tok_s]
        rows[c] = DecodeRow(
            aggregate_tok_s=summarize(r.aggregate_tok_s for r in runs),
            per_stream_tok_s=summarize(per_stream),
            ttft_s=summarize(sorted(r.ttft_s)[len(r.ttft_s) // 2] for r in runs if r.ttft_s),
            tokens_per_stream=sorted({t for r in runs for t in r.completion_tokens}),
            errors=[e for r in runs for e in r.errors],
            runs=runs,
        )
    return DecodeTarget(kind=target.kind, concurrency=rows, ssd=SsdWrites.of(counters))


def _tables(cfg: DecodeConfig, targets: dict[str, DecodeTarget]) -> list[dict[str, Any]]:
    rows = []
    for name, res in targets.items():
        for c, row in res.concurrency.items():
            rows.append([name, c, report.num(row.aggregate_tok_s), report.num(row.per_stream_tok_s),
                         report.ms(row.ttft_s), report.x(row.tok_s_over_off, 3),
                         "/".join(str(t) for t in row.tokens_per_stream), str(len(row.errors))])
    ssd_rows = []
    for name, res in targets.items():
        w = res.ssd
        if w is None:
            ssd_rows.append([name, "n/a (not kvcellar)", "", "", ""])
            continue
        ssd_rows.append([name, str(int(w.stored_blocks)), f"{w.stored_bytes / (1 << 20):.1f}", str(int(w.dropped)),
                         f"{1000 * w.enqueue_wait_s:.1f}"])
    notes = [f"{cfg.max_tokens} tokens per stream (ignore_eos), prompts of ~{cfg.prompt_words} words, "
             f"fresh per measurement; median (min–max) of {cfg.repeats} repeat(s), variants interleaved",
             "vs off: aggregate tok/s over kvcellar with --ssd-policy off at the same concurrency "
             "(target: write_through >= 0.95x)"]
    for name, res in targets.items():
        if not all(r.usage_reported for row in res.concurrency.values() for r in row.runs):
            notes.append(f"{name}: streams carry no usage; tokens counted from streamed text chunks")
    return [
        report.table("Decode throughput", ["target", "streams", "aggregate tok/s", "per-stream tok/s", "TTFT ms",
                                           "vs off", "tokens/stream", "errors"], rows, notes),
        report.table("SSD writes during the run (kvcellar /health)", ["target", "blocks stored", "MiB stored",
                                                                      "writer drops", "enqueue wait ms"], ssd_rows),
    ]


def plot(result: DecodeResult, out_dir: Path) -> list[Path]:
    plt = report.pyplot()

    names = list(result.targets)
    levels = result.config.concurrency
    none = Summary(median=0, min=0, max=0, n=0, values=[])  # a level with no figure: an empty bar
    fig, ax = plt.subplots(figsize=(max(6, 2 + 2 * len(names)), 4.5))
    groups = []
    for c in levels:
        meds, lo, hi = [], [], []
        for name in names:
            s = result.targets[name].concurrency[c].aggregate_tok_s or none
            meds.append(s.median)
            lo.append(s.median - s.min)
            hi.append(s.max - s.median)
        groups.append((f"{c} stream{'s' if c != 1 else ''}", meds, [lo, hi]))
    report.grouped_bars(ax, names, groups)
    ax.set_ylabel("aggregate output tok/s (median, min–max)")
    ax.set_title("Decode throughput by SSD policy")
    return report.save_figure(fig, out_dir, "decode.png")
