"""agent: multi-turn agent sessions over a shared system/tool prefix, twice with a restart between.

S sessions x T turns. Every turn sends the shared system prompt (instructions + a block of
tool definitions, the same for every session), that session's history so far (its user
messages and the server's own replies) and a new user message; replies are bounded by
--reply-tokens. C clients run concurrently: each takes the next session whose previous turn
has finished, so sessions interleave as agents do.

The workload runs twice on the same server: pass 1 on a fresh cache, then the server is
restarted with the page cache dropped, and pass 2 sends the same sessions again (same
seeds; histories are rebuilt from pass 2's own replies). What pass 2 gains over pass 1 is
the persistent tier's effect. Reported per pass: TTFT p50/p95, end-to-end latency p50/p95,
output tok/s (all completion tokens over the pass's wall time), cached-token ratio
(usage.prompt_tokens_details.cached_tokens / prompt_tokens) and, for kvcellar, where the
cached tokens came from (RAM vs SSD, from /health counter deltas). With --repeats R the
whole thing runs R times with different seeds and every figure is the median (min–max).
Tools are written into the system prompt as JSON text, so every server sees the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcellar.bench import report
from kvcellar.bench.client import ChatClient
from kvcellar.bench.prompts import PromptMaker, find_tokenizer_dir, resolve_tokenizer, sentences, words
from kvcellar.bench.stats import percentile, ratio, summarize
from kvcellar.bench.targets import (
    Target,
    TierSplit,
    add_target_arguments,
    cleanup_cache,
    default_models_dir,
    targets_from_args,
)

NAME = "agent"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    g = p.add_argument_group("agent")
    g.add_argument("--sessions", type=int, default=None, help="sessions S (default 8; --fast 2)")
    g.add_argument("--turns", type=int, default=None, help="turns per session T (default 4; --fast 2)")
    g.add_argument("--concurrency", type=int, default=None, help="concurrent clients C (default 4; --fast 2)")
    g.add_argument("--system-tokens", type=int, default=None,
                   help="tokens of the shared system + tools prompt, at least (default 1536; --fast 64)")
    g.add_argument("--user-tokens", type=int, default=None, help="tokens of each new user message (default 64; "
                                                                  "--fast 16)")
    g.add_argument("--reply-tokens", type=int, default=None, help="max_tokens of each reply (default 64; --fast 8)")
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="folder with the model's tokenizer (default: the prepared model in --models-dir)")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    fast = args.fast
    return {
        "sessions": args.sessions or (2 if fast else 8),
        "turns": args.turns or (2 if fast else 4),
        "concurrency": args.concurrency or (2 if fast else 4),
        "system_tokens": args.system_tokens or (64 if fast else 1536),
        "user_tokens": args.user_tokens or (16 if fast else 64),
        "reply_tokens": args.reply_tokens or (8 if fast else 64),
        "repeats": args.repeats or (1 if fast else 3),
        "seed": str(args.seed),
    }


@dataclass
class Session:
    index: int
    system: dict[str, str]
    users: list[str]
    history: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0


# ---- the workload ---------------------------------------------------------------------------------


def system_prompt(maker: PromptMaker, seed: str, min_tokens: int) -> str:
    """Instructions plus tool definitions (JSON), grown tool by tool to at least ``min_tokens``."""
    intro = "You are a careful coding agent. " + sentences(f"{seed}:intro", max(8, min(60, min_tokens // 3)))
    tools: list[dict[str, Any]] = []
    text = intro
    i = 0
    while maker.count(text) < min_tokens:
        name = "_".join(words(f"{seed}:tool:{i}", 2))
        params = {w: {"type": "string", "description": sentences(f"{seed}:tool:{i}:{w}", 8)}
                  for w in dict.fromkeys(words(f"{seed}:tool:{i}:params", 3))}
        tools.append({"type": "function", "function": {
            "name": f"{name}_{i}", "description": sentences(f"{seed}:tool:{i}:desc", 16),
            "parameters": {"type": "object", "properties": params, "required": list(params)[:1]}}})
        text = intro + "\n\n# Tools\nCall a tool by answering with JSON.\n" + json.dumps(tools, indent=1)
        i += 1
    return text


def make_sessions(maker: PromptMaker, cfg: dict[str, Any], seed: str) -> list[Session]:
    system = {"role": "system", "content": system_prompt(maker, seed, cfg["system_tokens"])}
    return [Session(s, system, [" ".join(maker.fill(f"{seed}:user:{s}:{t}", cfg["user_tokens"]))
                                for t in range(cfg["turns"])])
            for s in range(cfg["sessions"])]


async def run_pass(client: ChatClient, sessions: list[Session], cfg: dict[str, Any]) -> dict[str, Any]:
    """All turns of all sessions, C at a time; returns per-request records and the wall time."""
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        s.history, s.turn = [], 0
        queue.put_nowait(s)
    records: list[dict[str, Any]] = []

    async def worker() -> None:
        while True:
            s = await queue.get()
            try:
                user = {"role": "user", "content": s.users[s.turn]}
                res = await client.stream_chat([s.system, *s.history, user], cfg["reply_tokens"])
                row = res.as_dict()
                row.pop("text")
                records.append({"session": s.index, "turn": s.turn, **row})
                s.history += [user, {"role": "assistant", "content": res.text}]
                s.turn += 1
                if s.turn < len(s.users):
                    queue.put_nowait(s)
            finally:
                queue.task_done()

    t0 = time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(cfg["concurrency"])]
    try:
        await queue.join()
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return {"wall_s": time.perf_counter() - t0, "records": records}


def pass_figures(p: dict[str, Any], before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in p["records"] if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    prompt = [r["prompt_tokens"] for r in ok]
    cached = [r["cached_tokens"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    fig: dict[str, Any] = {
        "requests": len(p["records"]), "errors": [r["error"] for r in p["records"] if not r["ok"]],
        "wall_s": p["wall_s"],
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
        "output_tokens": out_tokens, "output_tok_s": out_tokens / p["wall_s"] if p["wall_s"] > 0 else None,
        "prompt_tokens": sum(prompt) if prompt and None not in prompt else None,
        "cached_tokens": sum(cached) if cached and None not in cached else None,
    }
    fig["cached_ratio"] = ratio(fig["cached_tokens"], fig["prompt_tokens"])
    turns = sorted({r["turn"] for r in ok})
    fig["ttft_p50_by_turn_s"] = {str(t): percentile([r["ttft_s"] for r in ok if r["turn"] == t], 50) for t in turns}
    if before and after:
        split = TierSplit.between(before, after)
        fig["tiers"] = dataclasses.asdict(split)
        fig["ram_ratio"] = ratio(split.ram_tokens, fig["prompt_tokens"])
        fig["ssd_ratio"] = ratio(split.ssd_tokens, fig["prompt_tokens"])
    else:
        fig["tiers"] = fig["ram_ratio"] = fig["ssd_ratio"] = None
    return fig


# ---- run ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    targets = targets_from_args(args, args.out)
    maker: PromptMaker | None = None
    results: dict[str, Any] = {}
    try:
        for target in targets:
            target.start()
            try:
                if maker is None:
                    maker = PromptMaker(resolve_tokenizer(
                        args.tokenizer or find_tokenizer_dir(args.models_dir or default_models_dir(),
                                                             target.served_model())))
                results[target.name] = _measure(target, maker, cfg)
            finally:
                target.stop()
    finally:
        for target in targets:
            target.stop()
            cleanup_cache(target, getattr(args, "keep_cache", False))
    result = {"config": cfg, "targets": results, "servers": [t.describe() for t in targets]}
    result["tables"] = _tables(result)
    return result


def _measure(target: Target, maker: PromptMaker, cfg: dict[str, Any]) -> dict[str, Any]:
    kvcellar = target.is_kvcellar
    model = target.served_model()
    repeats: list[dict[str, Any]] = []
    for rep in range(cfg["repeats"]):
        seed = f"{cfg['seed']}:agent:{rep}"
        sessions = make_sessions(maker, cfg, seed)
        shared = len(maker.encode([sessions[0].system]))
        passes: list[dict[str, Any]] = []
        restart: dict[str, Any] | None = None
        for pass_no in (1, 2):
            if pass_no == 2 and target.can_restart:
                restart = {"page_cache": target.restart(drop_cache=True),
                           "start_s": getattr(target, "last_start_s", None)}
            asyncio.run(_warm_up(target, model, f"{seed}:{pass_no}"))
            before = target.counters() if kvcellar else {}

            async def one_pass(sessions: list[Session] = sessions) -> dict[str, Any]:
                async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
                    return await run_pass(client, sessions, cfg)

            p = asyncio.run(one_pass())
            after = target.counters() if kvcellar else {}
            passes.append({"pass": pass_no, **pass_figures(p, before, after), "records": p["records"]})
        repeats.append({"seed": seed, "shared_prefix_tokens": shared, "restart": restart, "passes": passes})
    keys = ("ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s", "output_tok_s", "cached_ratio", "ram_ratio",
            "ssd_ratio", "prompt_tokens", "wall_s")
    summary: dict[str, dict[str, Any]] = {
        str(n): {k: summarize(r["passes"][n - 1][k] for r in repeats) for k in keys} for n in (1, 2)}
    for n in (1, 2):
        turns = sorted({t for r in repeats for t in r["passes"][n - 1]["ttft_p50_by_turn_s"]}, key=int)
        summary[str(n)]["ttft_p50_by_turn_s"] = {
            t: summarize(r["passes"][n - 1]["ttft_p50_by_turn_s"].get(t) for r in repeats) for t in turns}
        summary[str(n)]["errors"] = sum(len(r["passes"][n - 1]["errors"]) for r in repeats)
    return {"kind": target.kind, "is_kvcellar": kvcellar, "restarted": target.can_restart,
            "summary": summary, "repeats": repeats}


async def _warm_up(target: Target, model: str, seed: str) -> None:
    async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
        await client.stream_chat([{"role": "user", "content": f"Warm-up {seed}: name three colors."}], 4)


# ---- tables and plot -----------------------------------------------------------------------------------


def _tables(result: dict[str, Any]) -> list[dict[str, Any]]:
    cfg = result["config"]
    rows, ratios = [], []
    notes = [f"{cfg['sessions']} sessions x {cfg['turns']} turns, {cfg['concurrency']} concurrent clients, "
             f"user messages {cfg['user_tokens']} tokens, replies <= {cfg['reply_tokens']} tokens; "
             f"median (min–max) over {cfg['repeats']} repeat(s), each with its own seed",
             "TTFT/e2e in ms, percentiles over the requests of a pass; cached = usage cached_tokens / prompt_tokens; "
             "RAM/SSD = share of prompt tokens served by each tier (kvcellar /health deltas)"]
    for name, res in result["targets"].items():
        reps = res["repeats"]
        shared = sorted({r["shared_prefix_tokens"] for r in reps})
        notes.append(f"{name}: shared system+tools prefix {shared} tokens (tokenizer-exact)")
        restart = reps[0]["restart"] if reps else None
        if not res["restarted"]:
            notes.append(f"{name}: a running server at a URL, not restarted: pass 2 shows only its in-memory cache")
        elif restart:
            notes.append(f"{name}: restarted before pass 2, page cache dropped by {restart['page_cache']}")
        if any(r["completion_tokens"] is None for rep in reps for p in rep["passes"] for r in p["records"]):
            notes.append(f"{name}: streams carry no usage; output tokens counted from streamed text chunks")
        if not res["is_kvcellar"]:
            notes.append(f"{name}: tier split n/a (not kvcellar); cached ratio n/a unless the server reports "
                         "usage.prompt_tokens_details.cached_tokens")
        for n in ("1", "2"):
            s = res["summary"][n]
            label = "1 (fresh cache)" if n == "1" else ("2 (after restart)" if res["restarted"] else "2 (again)")
            tier = res["is_kvcellar"]
            rows.append([name, label, str(cfg["sessions"] * cfg["turns"]), report.ms(s["ttft_p50_s"]),
                         report.ms(s["ttft_p95_s"]), report.ms(s["e2e_p50_s"]), report.ms(s["e2e_p95_s"]),
                         report.num(s["output_tok_s"]), _pct(s["cached_ratio"]),
                         _pct(s["ram_ratio"]) if tier else "n/a", _pct(s["ssd_ratio"]) if tier else "n/a",
                         str(s["errors"])])
        s1, s2 = res["summary"]["1"], res["summary"]["2"]
        ratios.append([name] + [report.x(ratio(s2[k], s1[k])) for k in
                                ("ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s", "output_tok_s")])
    return [
        report.table("Agent workload by pass", ["target", "pass", "requests", "TTFT p50", "TTFT p95", "e2e p50",
                                                "e2e p95", "output tok/s", "cached", "from RAM", "from SSD",
                                                "errors"], rows, notes),
        report.table("Pass 2 / pass 1 (medians)", ["target", "TTFT p50", "TTFT p95", "e2e p50", "e2e p95",
                                                   "output tok/s"], ratios),
    ]


def _pct(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "n/a"
    scaled = {k: (v * 100 if k in ("median", "min", "max") else v) for k, v in summary.items()}
    return report.num(scaled, 1) + "%"


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = report.pyplot()

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5))
    labels, p50, p95, ram, ssd, other, unknown = [], [], [], [], [], [], []
    for name, res in result["targets"].items():
        for n in ("1", "2"):
            s = res["summary"][n]
            labels.append(f"{name}\npass {n}")
            p50.append((s["ttft_p50_s"] or {}).get("median", 0) * 1000)
            p95.append((s["ttft_p95_s"] or {}).get("median", 0) * 1000)
            r = (s["ram_ratio"] or {}).get("median", 0) * 100
            d = (s["ssd_ratio"] or {}).get("median", 0) * 100
            c = (s["cached_ratio"] or {}).get("median", 0) * 100
            ram.append(r)
            ssd.append(d)
            other.append(max(0.0, c - r - d))
            unknown.append(s["cached_ratio"] is None)
            turns = s["ttft_p50_by_turn_s"]
            xs = sorted(turns, key=int)
            ax2.plot([int(t) + 1 for t in xs], [(turns[t] or {}).get("median", 0) * 1000 for t in xs], "o-",
                     label=f"{name} pass {n}")
    idx = range(len(labels))
    ax1.bar([i - 0.2 for i in idx], p50, 0.4, label="p50")
    ax1.bar([i + 0.2 for i in idx], p95, 0.4, label="p95")
    ax1.set_xticks(list(idx), labels, fontsize=8)
    ax1.set_ylabel("TTFT, ms")
    ax1.set_title("TTFT by pass (pass 2 after a restart)")
    ax1.legend()
    all_turns = sorted({int(t) + 1 for res in result["targets"].values() for n in ("1", "2")
                        for t in res["summary"][n]["ttft_p50_by_turn_s"]})
    ax2.set_xticks(all_turns)
    ax2.set_xlabel("turn")
    ax2.set_ylabel("TTFT p50, ms")
    ax2.set_title("TTFT by turn (history grows)")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    ax3.bar(idx, ram, label="from RAM")
    ax3.bar(idx, ssd, bottom=ram, label="from SSD")
    ax3.bar(idx, other, bottom=[a + b for a, b in zip(ram, ssd, strict=False)], label="cached (tier n/a)")
    for i in idx:
        if unknown[i]:
            ax3.text(i, 3, "n/a\n(not reported)", ha="center", fontsize=8)
    ax3.set_xticks(list(idx), labels, fontsize=8)
    ax3.set_ylabel("% of prompt tokens")
    ax3.set_ylim(0, 100)
    ax3.set_title("Cached prompt tokens by tier")
    ax3.legend(fontsize=8)
    return report.save_figure(fig, out_dir, "agent.png")
