"""spec: speculative decoding on the work coding agents send, beside llama-server's n-gram drafts.

kvcellar is started once per ``--modes`` entry (``--speculative off``, ``ngram``, ``suffix``);
with ``--llama-server BIN`` llama.cpp's server on the same GGUF once per ``--peer-spec-types``
entry (``none``, ``ngram-simple``, ``ngram-mod``; 8 slots). All stay up for the whole run and
are measured in turn, in a rotated order per repeat. The work (``spec_work.py``): code edits
(a ~110-line file rewritten whole with a small change, a described edit, an edit tool call
echoing a method), a JSON document repeated with one change, an agent replay of five turns on
one file (each turn carries the server's own earlier replies), and natural chat. Greedy,
``--max-tokens`` a turn.

Each repeat works on its own variant of the file (names differ), so ``suffix`` drafts from
what earlier repeats wrote, as from an agent's earlier edits of the same code, and asks other
chat questions (no answer is drafted from the same question's earlier answer); a last agent
replay on yet another variant runs after ``suffix``'s server restarted (its outputs read back
from the cache dir), beside ``ngram``.

Figures per kind: decode tok/s of one stream (tokens after the first / the time from the first
to the last), the ratio to the same server without drafts, and for kvcellar the acceptance
(``/health`` ``speculative``: drafted, accepted, tokens per verification). ``--streams 8``
also runs the code-edit and chat conversations as 8 concurrent streams (aggregate tok/s).
Figures only, no asserts.

    kvcellar bench spec --llama-server /work/llama-server/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcellar.bench import report
from kvcellar.bench.client import ChatClient
from kvcellar.bench.spec_work import Conversation, conversations
from kvcellar.bench.targets import (
    CommandTarget,
    Target,
    add_target_arguments,
    cleanup_cache,
    peer_targets,
    variant_targets,
)

NAME = "spec"
KINDS = ("code-edit", "json", "agent", "chat")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    g = p.add_argument_group("spec")
    g.add_argument("--modes", default="off,ngram,suffix", help="kvcellar --speculative variants (default %(default)s)")
    g.add_argument("--llama-server", default=None, help="also measure this llama-server binary on the same GGUF")
    g.add_argument("--peer-spec-types", default="none,ngram-simple,ngram-mod",
                   help="llama-server --spec-type variants (default %(default)s)")
    g.add_argument("--kinds", default=",".join(KINDS), help="work kinds (default %(default)s)")
    g.add_argument("--max-tokens", type=int, default=None, help="tokens a turn may generate (default 320; --fast 64)")
    g.add_argument("--streams", type=int, default=8, help="concurrent streams of the batch measurement (0: none)")


@dataclass
class SpecConfig:
    modes: list[str]
    peer_spec_types: list[str]
    kinds: list[str]
    max_tokens: int
    streams: int
    repeats: int
    seed: str


@dataclass
class KindRow:
    tokens: list[int] = field(default_factory=list)  # per repeat, all turns of the kind
    decode_s: list[float] = field(default_factory=list)
    tok_s: float | None = None  # median over repeats
    # over the same server without drafts: the median of the repeats' own ratios (``paired``), each
    # on one work; the ratio of the two medians paired one repeat's file with another's
    over_plain: float | None = None
    # per repeat, over the same server without drafts on the same work (each repeat edits its own
    # file, whose drafts differ: the median of the rates above mixes works), and all repeats summed
    paired: list[float] = field(default_factory=list)
    summed_over_plain: float | None = None


@dataclass
class SpecTarget:
    kind: str
    rows: dict[str, KindRow]
    batch_tok_s: list[float]
    batch_over_plain: float | None
    speculative: dict[str, Any] | None  # /health's section at the end (kvcellar)
    accepted_by_kind: dict[str, dict[str, int]]
    # a last agent replay on new code: suffix after a restart (its outputs from the cache dir), ngram as is
    after_restart: dict[str, float] | None = None


@dataclass(frozen=True)
class SpecResult:
    config: SpecConfig
    targets: dict[str, SpecTarget]
    servers: list[dict[str, Any]]
    tables: list[dict[str, Any]]


def _peer(args: argparse.Namespace, spec_type: str, out: Path) -> Target:
    extra = f"-np 8 --spec-type {spec_type}" if spec_type != "none" else "-np 8"
    here = Path(__file__).resolve().parents[3] / "benchmarks" / "peer" / "run_llama_server.sh"
    command = (f"LLAMA_SERVER_BIN={args.llama_server} PEER_CTX=32768 PEER_EXTRA_ARGS='{extra}' "
               f"{here} {{port}}")
    return CommandTarget(f"llama-{spec_type}", out / "servers" / f"llama-{spec_type}", command,
                         ready_timeout=args.ready_timeout)


def run(args: argparse.Namespace) -> SpecResult:
    cfg = SpecConfig(modes=[m for m in args.modes.split(",") if m],
                     peer_spec_types=[t for t in args.peer_spec_types.split(",") if t] if args.llama_server else [],
                     kinds=[k for k in args.kinds.split(",") if k],
                     max_tokens=args.max_tokens or (64 if args.fast else 320),
                     streams=args.streams, repeats=args.repeats or (1 if args.fast else 2), seed=str(args.seed))
    out: Path = args.out
    targets = variant_targets(args, out, "--speculative", cfg.modes)
    if args.base_url:
        cfg.modes = []
    targets += [_peer(args, t, out) for t in cfg.peer_spec_types]
    targets += peer_targets(args, out)
    rows: dict[str, dict[str, KindRow]] = {t.name: {k: KindRow() for k in cfg.kinds} for t in targets}
    batch: dict[str, list[float]] = {t.name: [] for t in targets}
    accepted: dict[str, dict[str, dict[str, int]]] = {t.name: {} for t in targets}
    health: dict[str, dict[str, Any] | None] = {}
    restart: dict[str, dict[str, float]] = {}
    try:
        for t in targets:
            t.start()
        models = {t.name: t.served_model() for t in targets}
        for t in targets:  # the first request pays one-off costs on every server
            asyncio.run(_conversation(t, models[t.name], Conversation("warm", "warm", "", ("Hi",)), 8))
        for rep in range(cfg.repeats):
            # each repeat its own file (names vary): suffix drafts from earlier repeats' outputs, as
            # from an agent's earlier edits of the same code
            work = conversations(f"{cfg.seed}:{rep}", tuple(cfg.kinds), round_=rep)
            order = targets[rep % len(targets):] + targets[:rep % len(targets)]
            for t in order:
                for kind in cfg.kinds:
                    before = _spec_counts(t)
                    tokens, seconds = 0, 0.0
                    for conv in (c for c in work if c.kind == kind):
                        n, s = asyncio.run(_conversation(t, models[t.name], conv, cfg.max_tokens, rep))
                        tokens, seconds = tokens + n, seconds + s
                    rows[t.name][kind].tokens.append(tokens)
                    rows[t.name][kind].decode_s.append(seconds)
                    after = _spec_counts(t)
                    if before is not None and after is not None:
                        acc = accepted[t.name].setdefault(kind, {"drafted": 0, "accepted": 0, "verifies": 0})
                        for key in acc:
                            acc[key] += after[key] - before[key]
                if cfg.streams > 0:
                    batch[t.name].append(asyncio.run(_batch(t, models[t.name], work, cfg, rep)))
        for t in targets:
            h = t.health() if t.is_kvcellar else None
            health[t.name] = (h or {}).get("speculative")
        if "agent" in cfg.kinds:  # suffix's outputs after a restart, beside ngram on the same new turns
            work = conversations(f"{cfg.seed}:restart", ("agent",))
            for t in targets:
                if not t.is_kvcellar or (health.get(t.name) or {}).get("mode") not in ("ngram", "suffix"):
                    continue
                if health[t.name]["mode"] == "suffix" and t.can_restart:  # type: ignore[index]
                    t.restart(drop_cache=False)
                before = _spec_counts(t)
                n, seconds = asyncio.run(_conversation(t, models[t.name], work[0], cfg.max_tokens))
                after = _spec_counts(t)
                assert before is not None and after is not None
                restart[t.name] = {"tok_s": n / seconds if seconds else 0.0,
                                   **{k: after[k] - before[k] for k in after}}
    finally:
        for t in targets:
            t.stop()
            cleanup_cache(t, getattr(args, "keep_cache", False))
    results = {t.name: SpecTarget(t.kind, rows[t.name], batch[t.name], None, health.get(t.name), accepted[t.name],
                                  restart.get(t.name))
               for t in targets}
    _ratios(results, cfg)
    return SpecResult(cfg, results, [t.describe() for t in targets], _tables(cfg, results))


def _spec_counts(t: Target) -> dict[str, int] | None:
    health = t.health()  # None: not kvcellar
    if health is None:
        return None
    section = health.get("speculative") or {}
    return {"drafted": int(section.get("drafted_tokens") or 0), "accepted": int(section.get("accepted_tokens") or 0),
            "verifies": int(section.get("verifies") or 0)}


async def _conversation(t: Target, model: str, conv: Conversation, max_tokens: int, rep: int = 0) -> tuple[int, float]:
    """Tokens after each turn's first and the seconds they took, over the conversation's turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system else []
    tokens, seconds = 0, 0.0
    async with ChatClient(t.base_url, model, api_key=t.api_key) as client:
        for turn in conv.turns:
            messages.append({"role": "user", "content": turn})
            r = await client.stream_chat(messages, max_tokens)
            if not r.ok:
                raise RuntimeError(f"{t.name}: {conv.name}: {r.error}")
            messages.append({"role": "assistant", "content": r.text})
            if r.ttft_s is not None and r.last_token_s is not None and r.output_tokens > 1:
                tokens += r.output_tokens - 1
                seconds += r.last_token_s - r.ttft_s
    return tokens, seconds


async def _batch(t: Target, model: str, work: list[Conversation], cfg: SpecConfig, rep: int) -> float:
    """Aggregate tok/s of ``cfg.streams`` single-turn conversations at once (code edits and chat,
    each under its own system line so that none shares another's cache)."""
    singles = [c for c in work if len(c.turns) == 1 and c.kind in ("code-edit", "chat")]
    async with ChatClient(t.base_url, model, api_key=t.api_key) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            client.stream_chat([{"role": "system", "content": f"{c.system} Session {rep}.{i}."},
                                {"role": "user", "content": c.turns[0]}], cfg.max_tokens)
            for i, c in enumerate(singles[i % len(singles)] for i in range(cfg.streams))))
        wall = time.perf_counter() - t0
    return sum(r.output_tokens for r in results if r.ok) / wall


def _ratios(results: dict[str, SpecTarget], cfg: SpecConfig) -> None:
    for res in results.values():
        for row in res.rows.values():
            rates = [n / s for n, s in zip(row.tokens, row.decode_s, strict=True) if s > 0]
            row.tok_s = statistics.median(rates) if rates else None
    plain = {"kvcellar": "kvcellar-off", "command": "llama-none"}
    for res in results.values():
        base = results.get(plain.get(res.kind, ""))
        if base is None:
            continue
        for kind, row in res.rows.items():
            ref = base.rows[kind]
            row.paired = [(n / s) / (bn / bs) for n, s, bn, bs in zip(row.tokens, row.decode_s, ref.tokens,
                                                                     ref.decode_s, strict=False) if s > 0 and bs > 0]
            row.over_plain = statistics.median(row.paired) if row.paired else None
            if sum(row.decode_s) > 0 and sum(ref.decode_s) > 0:
                row.summed_over_plain = ((sum(row.tokens) / sum(row.decode_s))
                                         / (sum(ref.tokens) / sum(ref.decode_s)))
        if res.batch_tok_s and base.batch_tok_s:
            res.batch_over_plain = statistics.median(res.batch_tok_s) / statistics.median(base.batch_tok_s)


def _tables(cfg: SpecConfig, results: dict[str, SpecTarget]) -> list[dict[str, Any]]:
    head = ["target", *[f"{k} tok/s" for k in cfg.kinds], *[f"{k} vs plain" for k in cfg.kinds]]
    rows = []
    for name, res in results.items():
        rows.append([name, *[f"{res.rows[k].tok_s:.1f}" if res.rows[k].tok_s else "" for k in cfg.kinds],
                     *[report.x(res.rows[k].over_plain, 2) for k in cfg.kinds]])
    paired_rows = [[name, *[" / ".join(f"{r:.2f}" for r in res.rows[k].paired) for k in cfg.kinds],
                    *[report.x(res.rows[k].summed_over_plain, 2) for k in cfg.kinds]]
                   for name, res in results.items() if any(res.rows[k].paired for k in cfg.kinds)]
    acc_rows = []
    for name, res in results.items():
        for kind, a in res.accepted_by_kind.items():
            if a["verifies"]:
                acc_rows.append([name, kind, str(a["drafted"]), str(a["accepted"]),
                                 f"{a['accepted'] / max(1, a['drafted']):.2f}",
                                 f"{(a['accepted'] + a['verifies']) / a['verifies']:.2f}"])
    batch_rows = [[name, f"{statistics.median(res.batch_tok_s):.1f}", report.x(res.batch_over_plain, 2)]
                  for name, res in results.items() if res.batch_tok_s]
    restart_rows = [[name, f"{r['tok_s']:.1f}", str(int(r["drafted"])), str(int(r["accepted"])),
                     f"{r['accepted'] / max(1, r['drafted']):.2f}"]
                    for name, res in results.items() if (r := res.after_restart) is not None]
    notes = [f"greedy, {cfg.max_tokens} tokens a turn at most; decode tok/s = tokens after each turn's first / the "
             f"time from the first to the last, over the kind's turns; median of {cfg.repeats} repeat(s), servers "
             "interleaved; vs plain: the median of each repeat's ratio over the same server without drafts "
             "(kvcellar-off, llama-none) on the same work"]
    return [
        report.table("Decode speed of one stream, by kind of work", head, rows, notes),
        report.table("Over plain on the same work: each repeat, and every repeat's turns summed",
                     ["target", *[f"{k} by repeat" for k in cfg.kinds], *[f"{k} summed" for k in cfg.kinds]],
                     paired_rows, ["each repeat edits its own variant of the file (other drafts): a repeat's ratio "
                                   "compares one work; the tok/s medians above mix them"]),
        report.table("kvcellar's drafts (/health deltas)", ["target", "kind", "drafted", "accepted", "acceptance",
                                                            "tokens / verification"], acc_rows),
        report.table(f"{cfg.streams} concurrent streams (code edits and chat), aggregate",
                     ["target", "tok/s", "vs plain"], batch_rows),
        report.table("An agent replay on new code at the end: suffix restarted first (its outputs read back "
                     "from the cache dir)", ["target", "tok/s", "drafted", "accepted", "acceptance"], restart_rows),
    ]


def plot(result: SpecResult, out_dir: Path) -> list[Path]:
    plt = report.pyplot()
    names = list(result.targets)
    kinds = result.config.kinds
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.5 * len(names)), 4.5))
    report.grouped_bars(ax, names, [(kind, [result.targets[n].rows[kind].tok_s or 0 for n in names], None)
                                    for kind in kinds])
    ax.set_ylabel("decode tok/s, one stream")
    ax.set_title("Speculative decoding by kind of work")
    return report.save_figure(fig, out_dir, "spec.png")
