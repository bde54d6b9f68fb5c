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
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcellar.bench import report
from kvcellar.bench.client import ChatClient, RequestRecord
from kvcellar.bench.prompts import PromptMaker, find_tokenizer_dir, resolve_tokenizer, sentences, words
from kvcellar.bench.stats import Summary, percentile, ratio, summarize
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


# ---- the result (field names are result.json's keys) ------------------------------------------


@dataclass(frozen=True)
class AgentConfig:
    sessions: int
    turns: int
    concurrency: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    repeats: int
    seed: str


@dataclass(frozen=True)
class AgentRequest(RequestRecord):
    session: int
    turn: int


@dataclass(frozen=True)
class PassRun:
    """What ``run_pass`` measured: every request, and the pass's wall time."""

    wall_s: float
    records: list[AgentRequest]


@dataclass(frozen=True)
class AgentPass:
    """One pass over all sessions: its figures, then its requests."""

    pass_no: int = field(metadata={report.JSON_KEY: "pass"})
    requests: int
    errors: list[str | None]
    wall_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    output_tokens: int
    output_tok_s: float | None
    prompt_tokens: int | None  # None where the server does not report usage
    cached_tokens: int | None
    cached_ratio: float | None
    ttft_p50_by_turn_s: dict[int, float | None]
    tiers: TierSplit | None  # kvcellar's /health deltas; a peer has none
    ram_ratio: float | None
    ssd_ratio: float | None
    records: list[AgentRequest]


@dataclass(frozen=True)
class AgentRestart:
    page_cache: str
    start_s: float | None


@dataclass(frozen=True)
class AgentRepeat:
    seed: str
    shared_prefix_tokens: int
    restart: AgentRestart | None  # before pass 2; None where the server cannot be restarted
    passes: list[AgentPass]


@dataclass(frozen=True)
class PassSummary:
    """One pass's figures over the repeats: median (min–max) each."""

    ttft_p50_s: Summary | None
    ttft_p95_s: Summary | None
    e2e_p50_s: Summary | None
    e2e_p95_s: Summary | None
    output_tok_s: Summary | None
    cached_ratio: Summary | None
    ram_ratio: Summary | None
    ssd_ratio: Summary | None
    prompt_tokens: Summary | None
    wall_s: Summary | None
    ttft_p50_by_turn_s: dict[int, Summary | None]
    errors: int  # all repeats' together

    @classmethod
    def of(cls, passes: list[AgentPass]) -> PassSummary:
        turns = sorted({t for p in passes for t in p.ttft_p50_by_turn_s})
        return cls(
            ttft_p50_s=summarize(p.ttft_p50_s for p in passes),
            ttft_p95_s=summarize(p.ttft_p95_s for p in passes),
            e2e_p50_s=summarize(p.e2e_p50_s for p in passes),
            e2e_p95_s=summarize(p.e2e_p95_s for p in passes),
            output_tok_s=summarize(p.output_tok_s for p in passes),
            cached_ratio=summarize(p.cached_ratio for p in passes),
            ram_ratio=summarize(p.ram_ratio for p in passes),
            ssd_ratio=summarize(p.ssd_ratio for p in passes),
            prompt_tokens=summarize(p.prompt_tokens for p in passes),
            wall_s=summarize(p.wall_s for p in passes),
            ttft_p50_by_turn_s={t: summarize(p.ttft_p50_by_turn_s.get(t) for p in passes) for t in turns},
            errors=sum(len(p.errors) for p in passes),
        )


@dataclass(frozen=True)
class AgentTarget:
    kind: str
    is_kvcellar: bool
    restarted: bool
    summary: dict[int, PassSummary]  # by pass: 1, 2
    repeats: list[AgentRepeat]


@dataclass(frozen=True)
class AgentResult:
    config: AgentConfig
    targets: dict[str, AgentTarget]
    servers: list[dict[str, Any]]
    tables: list[dict[str, Any]]


def _config(args: argparse.Namespace) -> AgentConfig:
    fast = args.fast
    return AgentConfig(
        sessions=args.sessions or (2 if fast else 8),
        turns=args.turns or (2 if fast else 4),
        concurrency=args.concurrency or (2 if fast else 4),
        system_tokens=args.system_tokens or (64 if fast else 1536),
        user_tokens=args.user_tokens or (16 if fast else 64),
        reply_tokens=args.reply_tokens or (8 if fast else 64),
        repeats=args.repeats or (1 if fast else 3),
        seed=str(args.seed),
    )


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


def make_sessions(maker: PromptMaker, cfg: AgentConfig, seed: str) -> list[Session]:
    system = {"role": "system", "content": system_prompt(maker, seed, cfg.system_tokens)}
    return [Session(s, system, [" ".join(maker.fill(f"{seed}:user:{s}:{t}", cfg.user_tokens))
                                for t in range(cfg.turns)])
            for s in range(cfg.sessions)]


async def run_pass(client: ChatClient, sessions: list[Session], cfg: AgentConfig) -> PassRun:
    """All turns of all sessions, C at a time; returns per-request records and the wall time."""
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        s.history, s.turn = [], 0
        queue.put_nowait(s)
    records: list[AgentRequest] = []

    async def worker() -> None:
        while True:
            s = await queue.get()
            try:
                user = {"role": "user", "content": s.users[s.turn]}
                res = await client.stream_chat([s.system, *s.history, user], cfg.reply_tokens)
                records.append(AgentRequest.of(res, session=s.index, turn=s.turn))
                s.history += [user, {"role": "assistant", "content": res.text}]
                s.turn += 1
                if s.turn < len(s.users):
                    queue.put_nowait(s)
            finally:
                queue.task_done()

    t0 = time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
    try:
        await queue.join()
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return PassRun(wall_s=time.perf_counter() - t0, records=records)


def _total(values: list[int | None]) -> int | None:
    """The sum; None if there are none or a server left one out (no usage)."""
    return sum(v for v in values if v is not None) if values and None not in values else None


def pass_figures(pass_no: int, p: PassRun, before: dict[str, float], after: dict[str, float]) -> AgentPass:
    ok = [r for r in p.records if r.ok]
    ttft = [(r.turn, r.ttft_s) for r in ok if r.ttft_s is not None]  # an ok request has its TTFT
    e2e = [r.e2e_s for r in ok]
    prompt_tokens = _total([r.prompt_tokens for r in ok])
    cached_tokens = _total([r.cached_tokens for r in ok])
    out_tokens = sum(r.output_tokens for r in ok)
    turns = sorted({r.turn for r in ok})
    split = TierSplit.between(before, after) if before and after else None
    return AgentPass(
        pass_no=pass_no, requests=len(p.records), errors=[r.error for r in p.records if not r.ok],
        wall_s=p.wall_s,
        ttft_p50_s=percentile([s for _, s in ttft], 50), ttft_p95_s=percentile([s for _, s in ttft], 95),
        e2e_p50_s=percentile(e2e, 50), e2e_p95_s=percentile(e2e, 95),
        output_tokens=out_tokens, output_tok_s=out_tokens / p.wall_s if p.wall_s > 0 else None,
        prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        cached_ratio=ratio(cached_tokens, prompt_tokens),
        ttft_p50_by_turn_s={t: percentile([s for turn, s in ttft if turn == t], 50) for t in turns},
        tiers=split,
        ram_ratio=None if split is None else ratio(split.ram_tokens, prompt_tokens),
        ssd_ratio=None if split is None else ratio(split.ssd_tokens, prompt_tokens),
        records=p.records,
    )


# ---- run ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> AgentResult:
    cfg = _config(args)
    targets = targets_from_args(args, args.out)
    maker: PromptMaker | None = None
    results: dict[str, AgentTarget] = {}
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
    return AgentResult(config=cfg, targets=results, servers=[t.describe() for t in targets],
                       tables=_tables(cfg, results))


def _measure(target: Target, maker: PromptMaker, cfg: AgentConfig) -> AgentTarget:
    kvcellar = target.is_kvcellar
    model = target.served_model()
    repeats: list[AgentRepeat] = []
    for rep in range(cfg.repeats):
        seed = f"{cfg.seed}:agent:{rep}"
        sessions = make_sessions(maker, cfg, seed)
        shared = len(maker.encode([sessions[0].system]))
        passes: list[AgentPass] = []
        restart: AgentRestart | None = None
        for pass_no in (1, 2):
            if pass_no == 2 and target.can_restart:
                restart = AgentRestart(page_cache=target.restart(drop_cache=True),
                                       start_s=getattr(target, "last_start_s", None))
            asyncio.run(_warm_up(target, model, f"{seed}:{pass_no}"))
            before = target.counters() if kvcellar else {}

            async def one_pass(sessions: list[Session] = sessions) -> PassRun:
                async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
                    return await run_pass(client, sessions, cfg)

            p = asyncio.run(one_pass())
            after = target.counters() if kvcellar else {}
            passes.append(pass_figures(pass_no, p, before, after))
        repeats.append(AgentRepeat(seed=seed, shared_prefix_tokens=shared, restart=restart, passes=passes))
    summary = {n: PassSummary.of([r.passes[n - 1] for r in repeats]) for n in (1, 2)}
    return AgentTarget(kind=target.kind, is_kvcellar=kvcellar, restarted=target.can_restart,
                       summary=summary, repeats=repeats)


async def _warm_up(target: Target, model: str, seed: str) -> None:
    async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
        await client.stream_chat([{"role": "user", "content": f"Warm-up {seed}: name three colors."}], 4)


# ---- tables and plot -----------------------------------------------------------------------------------


def _headline(s: PassSummary) -> tuple[Summary | None, ...]:
    """The figures the pass 2 / pass 1 table compares."""
    return s.ttft_p50_s, s.ttft_p95_s, s.e2e_p50_s, s.e2e_p95_s, s.output_tok_s


def _tables(cfg: AgentConfig, targets: dict[str, AgentTarget]) -> list[dict[str, Any]]:
    rows, ratios = [], []
    notes = [f"{cfg.sessions} sessions x {cfg.turns} turns, {cfg.concurrency} concurrent clients, "
             f"user messages {cfg.user_tokens} tokens, replies <= {cfg.reply_tokens} tokens; "
             f"median (min–max) over {cfg.repeats} repeat(s), each with its own seed",
             "TTFT/e2e in ms, percentiles over the requests of a pass; cached = usage cached_tokens / prompt_tokens; "
             "RAM/SSD = share of prompt tokens served by each tier (kvcellar /health deltas)"]
    for name, res in targets.items():
        reps = res.repeats
        shared = sorted({r.shared_prefix_tokens for r in reps})
        notes.append(f"{name}: shared system+tools prefix {shared} tokens (tokenizer-exact)")
        restart = reps[0].restart if reps else None
        if not res.restarted:
            notes.append(f"{name}: a running server at a URL, not restarted: pass 2 shows only its in-memory cache")
        elif restart:
            notes.append(f"{name}: restarted before pass 2, page cache dropped by {restart.page_cache}")
        if any(r.completion_tokens is None for rep in reps for p in rep.passes for r in p.records):
            notes.append(f"{name}: streams carry no usage; output tokens counted from streamed text chunks")
        if not res.is_kvcellar:
            notes.append(f"{name}: tier split n/a (not kvcellar); cached ratio n/a unless the server reports "
                         "usage.prompt_tokens_details.cached_tokens")
        for n in (1, 2):
            s = res.summary[n]
            label = "1 (fresh cache)" if n == 1 else ("2 (after restart)" if res.restarted else "2 (again)")
            tier = res.is_kvcellar
            rows.append([name, label, str(cfg.sessions * cfg.turns), report.ms(s.ttft_p50_s),
                         report.ms(s.ttft_p95_s), report.ms(s.e2e_p50_s), report.ms(s.e2e_p95_s),
                         report.num(s.output_tok_s), _pct(s.cached_ratio),
                         _pct(s.ram_ratio) if tier else "n/a", _pct(s.ssd_ratio) if tier else "n/a",
                         str(s.errors)])
        pass1, pass2 = _headline(res.summary[1]), _headline(res.summary[2])
        ratios.append([name] + [report.x(ratio(b, a)) for a, b in zip(pass1, pass2, strict=True)])
    return [
        report.table("Agent workload by pass", ["target", "pass", "requests", "TTFT p50", "TTFT p95", "e2e p50",
                                                "e2e p95", "output tok/s", "cached", "from RAM", "from SSD",
                                                "errors"], rows, notes),
        report.table("Pass 2 / pass 1 (medians)", ["target", "TTFT p50", "TTFT p95", "e2e p50", "e2e p95",
                                                   "output tok/s"], ratios),
    ]


def _pct(summary: Summary | None) -> str:
    return "n/a" if summary is None else report.num(summary.scaled(100), 1) + "%"


def _median(summary: Summary | None) -> float:
    """The median; 0 for a figure that is missing (an empty bar)."""
    return 0 if summary is None else summary.median


def plot(result: AgentResult, out_dir: Path) -> list[Path]:
    plt = report.pyplot()

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5))
    labels, p50, p95, ram, ssd, other, unknown = [], [], [], [], [], [], []
    for name, res in result.targets.items():
        for n in (1, 2):
            s = res.summary[n]
            labels.append(f"{name}\npass {n}")
            p50.append(_median(s.ttft_p50_s) * 1000)
            p95.append(_median(s.ttft_p95_s) * 1000)
            r = _median(s.ram_ratio) * 100
            d = _median(s.ssd_ratio) * 100
            c = _median(s.cached_ratio) * 100
            ram.append(r)
            ssd.append(d)
            other.append(max(0.0, c - r - d))
            unknown.append(s.cached_ratio is None)
            turns = s.ttft_p50_by_turn_s
            xs = sorted(turns)
            ax2.plot([t + 1 for t in xs], [_median(turns[t]) * 1000 for t in xs], "o-", label=f"{name} pass {n}")
    idx = range(len(labels))
    ax1.bar([i - 0.2 for i in idx], p50, 0.4, label="p50")
    ax1.bar([i + 0.2 for i in idx], p95, 0.4, label="p95")
    ax1.set_xticks(list(idx), labels, fontsize=8)
    ax1.set_ylabel("TTFT, ms")
    ax1.set_title("TTFT by pass (pass 2 after a restart)")
    ax1.legend()
    all_turns = sorted({t + 1 for res in result.targets.values() for n in (1, 2)
                        for t in res.summary[n].ttft_p50_by_turn_s})
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
