"""ttft: TTFT of one long prompt: cold, RAM hit, disk hit after restart, partial prefix, vs the floor.

For each prompt length (tokenizer-exact; default 512/2048/4096/8192, the longest clipped to
the model's context minus the streamed reply) and each repeat, one fresh prompt is sent:

  cold      never seen before (max_tokens 1)
  RAM hit   the same prompt again; the reply streams --decode-tokens tokens with ignore_eos,
            and the mean gap between them is one decode step at that context
  partial   a prompt sharing all but its last --partial-tail (96) tokens with it

then the server is stopped, the page cache dropped, the server started again, and each
prompt is sent once more (page cache dropped right before each): the disk hit.

The floor is what a disk hit cannot beat: the prompt's KV bytes over the sequential
O_DIRECT read bandwidth of the cache's filesystem (measured in this run) plus one decode
step at that context. Targets: a disk hit within 1.5x the floor, a RAM hit within 1.2x one
decode step. Against a peer the same requests are sent; tier splits and cached-token
counts are kvcellar's /health and usage fields and show as n/a where a server lacks them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcellar.bench import report
from kvcellar.bench.client import ChatClient, RequestRecord
from kvcellar.bench.pagecache import drop_page_cache, method_name
from kvcellar.bench.prompts import ChatPrompt, PromptMaker, find_tokenizer_dir, resolve_tokenizer
from kvcellar.bench.stats import Summary, ratio, summarize
from kvcellar.bench.targets import (
    ProcessTarget,
    Target,
    TierSplit,
    add_target_arguments,
    cleanup_cache,
    default_models_dir,
    targets_from_args,
)
from kvcellar.engine.tokenization import shared_prefix_len

NAME = "ttft"
FULL_LENGTHS = (512, 2048, 4096, 8192)
FAST_LENGTHS = (64, 128)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    g = p.add_argument_group("ttft")
    g.add_argument("--lengths", default=None,
                   help="prompt lengths in tokens, comma-separated (default 512,2048,4096,8192; --fast 64,128)")
    g.add_argument("--partial-tail", type=int, default=96,
                   help="tokens at the end of the partial-prefix prompt that differ (default 96)")
    g.add_argument("--decode-tokens", type=int, default=None,
                   help="tokens streamed after the RAM hit to time a decode step (default 32; --fast 8)")
    g.add_argument("--context", type=int, default=None,
                   help="the model's context in tokens (default: from its config); lengths are clipped to "
                        "context - decode tokens")
    g.add_argument("--bandwidth-mib", type=int, default=None,
                   help="MiB read per O_DIRECT bandwidth measurement (default 512; --fast 16)")
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="folder with the model's tokenizer (default: the prepared model in --models-dir)")


# ---- the result (field names are result.json's keys) ------------------------------------------


@dataclass
class TtftConfig:
    """The run's sizes; ``_build_prompts`` clips the lengths to the model's context and fills in the rest."""

    lengths: list[int]
    repeats: int
    partial_tail: int
    decode_tokens: int
    bandwidth_bytes: int
    seed: str
    context: int | None = None
    # keyed by str(length): a table note prints these dicts as they are
    prompt_tokens: dict[str, list[int]] = field(default_factory=dict)
    partial_unshared_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class TtftRequest(RequestRecord):
    # kvcellar's /health deltas; left out for a server without them (a peer)
    tiers: TierSplit | None = field(default=None, metadata={report.OMIT_IF_NONE: True})


@dataclass
class Phases:
    """One prompt length's requests, one per repeat in each phase."""

    cold: list[TtftRequest] = field(default_factory=list)
    ram: list[TtftRequest] = field(default_factory=list)
    partial: list[TtftRequest] = field(default_factory=list)
    disk: list[TtftRequest] = field(default_factory=list)

    def items(self) -> list[tuple[str, list[TtftRequest]]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


@dataclass(frozen=True)
class Ratios:
    ram_over_cold: float | None
    disk_over_cold: float | None
    partial_over_cold: float | None
    disk_over_floor: float | None
    ram_over_decode_step: float | None


@dataclass
class LengthRow:
    """One prompt length's figures on one target; ``_derive`` adds the floor and the ratios."""

    prompt_tokens: list[int]
    server_prompt_tokens: list[int | None]
    cold_s: Summary | None
    ram_hit_s: Summary | None
    partial_s: Summary | None
    disk_hit_s: Summary | None
    decode_step_s: Summary | None
    requests: Phases
    # left out where the floor cannot be computed
    floor_read_s: float | None = field(default=None, metadata={report.OMIT_IF_NONE: True})
    floor_s: float | None = None
    ratios: Ratios | None = None


@dataclass(frozen=True)
class Restart:
    page_cache: str
    stop_s: float | None
    start_s: float | None
    exit_code: int | None
    page_cache_before_each: list[str]


@dataclass(frozen=True)
class TtftTarget:
    kind: str
    is_kvcellar: bool
    lengths: dict[int, LengthRow]
    errors: list[str]
    restart: Restart | None  # None: a server at a URL, not restarted, so no disk hit


@dataclass(frozen=True, kw_only=True)  # keyword-only: a field with a default sits among the others
class Floor:
    """What the floor is computed from, measured in this run."""

    kv_bytes_per_token: float | None
    kv_bytes_source: str | None
    # only with the SSD tier's own spec (namespace.json)
    file_bytes_per_token: float | None = field(default=None, metadata={report.OMIT_IF_NONE: True})
    read_bandwidth_bytes_per_s: Summary | None
    read_bandwidth_method: list[str]
    read_bandwidth_bytes: int
    read_bandwidth_dir: str


@dataclass(frozen=True)
class TtftResult:
    config: TtftConfig
    floor: Floor
    targets: dict[str, TtftTarget]
    servers: list[dict[str, Any]]
    tables: list[dict[str, Any]]


def _config(args: argparse.Namespace) -> TtftConfig:
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(
        FAST_LENGTHS if args.fast else FULL_LENGTHS)
    return TtftConfig(
        lengths=lengths,
        repeats=args.repeats or (1 if args.fast else 3),
        partial_tail=args.partial_tail,
        decode_tokens=args.decode_tokens or (8 if args.fast else 32),
        bandwidth_bytes=(args.bandwidth_mib or (16 if args.fast else 512)) << 20,
        seed=str(args.seed),
    )


def run(args: argparse.Namespace) -> TtftResult:
    cfg = _config(args)
    out: Path = args.out
    targets = targets_from_args(args, out)
    prompts: dict[int, list[tuple[ChatPrompt, ChatPrompt]]] | None = None
    tok_dir: Path | None = None
    results: dict[str, TtftTarget] = {}
    kv_spec: dict[str, Any] | None = None
    bandwidth_dir = out
    try:
        for target in targets:
            target.start()
            try:
                if prompts is None:
                    tok_dir = args.tokenizer or find_tokenizer_dir(args.models_dir or default_models_dir(),
                                                                   target.served_model())
                    maker = PromptMaker(resolve_tokenizer(tok_dir))
                    prompts = _build_prompts(maker, cfg, tok_dir, args.context)
                if kv_spec is None and target.is_kvcellar:
                    kv_spec = target.kv_spec()
                if isinstance(target, ProcessTarget) and target.kind == "kvcellar":
                    bandwidth_dir = target.cache_dir or out
                results[target.name] = asyncio.run(_measure(target, prompts, cfg))
            finally:
                target.stop()
        floor = _floor_inputs(cfg, kv_spec, tok_dir, bandwidth_dir)
    finally:
        for target in targets:
            target.stop()
            cleanup_cache(target, getattr(args, "keep_cache", False))
    for res in results.values():
        _derive(res, floor)
    return TtftResult(config=cfg, floor=floor, targets=results, servers=[t.describe() for t in targets],
                      tables=_tables(cfg, floor, results))


# ---- prompts -------------------------------------------------------------------------------------


def _build_prompts(maker: PromptMaker, cfg: TtftConfig, tok_dir: Path | None,
                   context: int | None) -> dict[int, list[tuple[ChatPrompt, ChatPrompt]]]:
    if context is None:
        context = 8192  # unless the tokenizer folder's config.json says
        if tok_dir is not None:
            try:
                context = int(json.loads((tok_dir / "config.json").read_text())["max_position_embeddings"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
    limit = context - cfg.decode_tokens - 1
    cfg.context = context
    cfg.lengths = sorted({min(n, limit) for n in cfg.lengths})
    out: dict[int, list[tuple[ChatPrompt, ChatPrompt]]] = {}
    for n in cfg.lengths:
        tail = min(cfg.partial_tail, n // 2)
        out[n] = [maker.partial_pair(n, f"{cfg.seed}:ttft:{n}:{r}", tail) for r in range(cfg.repeats)]
    cfg.prompt_tokens = {str(n): [a.n_tokens for a, _ in out[n]] for n in out}
    cfg.partial_unshared_tokens = {
        str(n): [a.n_tokens - shared_prefix_len(a.token_ids, b.token_ids) for a, b in out[n]] for n in out}
    return out


# ---- measuring one target --------------------------------------------------------------------------


async def _measure(target: Target, prompts: dict[int, list[tuple[ChatPrompt, ChatPrompt]]],
                   cfg: TtftConfig) -> TtftTarget:
    kvcellar = target.is_kvcellar
    raw = {n: Phases() for n in prompts}
    model = target.served_model()
    async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
        await _warm_up(client, f"{cfg.seed}:warm:{target.name}:{target.starts}")
        for n, pairs in prompts.items():
            for a, b in pairs:
                raw[n].cold.append(await _timed(client, target, a, 1, kvcellar))
                raw[n].ram.append(await _timed(client, target, a, cfg.decode_tokens, kvcellar, ignore_eos=True))
                raw[n].partial.append(await _timed(client, target, b, 1, kvcellar))
    restart = None
    if target.can_restart:
        method = target.restart(drop_cache=True)
        drops: list[str] = []
        async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
            await _warm_up(client, f"{cfg.seed}:warm:{target.name}:{target.starts}")
            for n, pairs in prompts.items():
                for a, _b in pairs:
                    drops.append(drop_page_cache([target.cache_dir] if target.cache_dir else []))
                    raw[n].disk.append(await _timed(client, target, a, 1, kvcellar))
        # the disk phase neither stops nor starts the server: these are still the restart's figures
        restart = Restart(page_cache=method, stop_s=getattr(target, "last_stop_s", None),
                          start_s=getattr(target, "last_start_s", None),
                          exit_code=getattr(target, "last_exit_code", None),
                          page_cache_before_each=sorted({method_name(d) for d in drops}))
    lengths: dict[int, LengthRow] = {}
    errors: list[str] = []
    for n, phases in raw.items():
        for phase, rows in phases.items():
            errors += [f"{n} {phase}: {r.error}" for r in rows if not r.ok]
        lengths[n] = LengthRow(
            prompt_tokens=[a.n_tokens for a, _ in prompts[n]],
            server_prompt_tokens=[r.prompt_tokens for r in phases.cold],
            cold_s=summarize(r.ttft_s for r in phases.cold if r.ok),
            ram_hit_s=summarize(r.ttft_s for r in phases.ram if r.ok),
            partial_s=summarize(r.ttft_s for r in phases.partial if r.ok),
            disk_hit_s=summarize(r.ttft_s for r in phases.disk if r.ok),
            decode_step_s=summarize(r.decode_step_s for r in phases.ram if r.ok),
            requests=phases,
        )
    return TtftTarget(kind=target.kind, is_kvcellar=kvcellar, lengths=lengths, errors=errors, restart=restart)


async def _warm_up(client: ChatClient, seed: str) -> None:
    """Two short unrelated requests, so first-request costs of a fresh process are not timed."""
    for i in range(2):
        messages = [{"role": "user", "content": f"Warm-up {seed} {i}: name three colors."}]
        await client.stream_chat(messages, 4)


async def _timed(client: ChatClient, target: Target, prompt: ChatPrompt, max_tokens: int, kvcellar: bool,
                 ignore_eos: bool = False) -> TtftRequest:
    before = target.counters() if kvcellar else {}
    r = await client.stream_chat(prompt.messages, max_tokens, ignore_eos=ignore_eos)
    return TtftRequest.of(r, tiers=TierSplit.between(before, target.counters()) if kvcellar else None)


# ---- the floor --------------------------------------------------------------------------------------


def _floor_inputs(cfg: TtftConfig, kv_spec: dict[str, Any] | None, tok_dir: Path | None,
                  bandwidth_dir: Path) -> Floor:
    from kvcellar.storage.disk.bandwidth import measure_read_bandwidth_detailed

    per_token: float | None = None
    source: str | None = None
    file_per_token: float | None = None
    if kv_spec and kv_spec.get("block_nbytes") and kv_spec.get("block_size"):
        # kv_spec is the SSD tier's namespace.json
        per_token = kv_spec["block_nbytes"] / kv_spec["block_size"]
        source = f"SSD tier namespace.json (block_nbytes {kv_spec['block_nbytes']} / " \
                 f"block_size {kv_spec['block_size']}, dtype {kv_spec.get('dtype')})"
        if kv_spec.get("file_nbytes"):
            file_per_token = kv_spec["file_nbytes"] / kv_spec["block_size"]
    elif tok_dir is not None:
        per_token, source = _kv_bytes_from_config(tok_dir)
    runs = [measure_read_bandwidth_detailed(bandwidth_dir, cfg.bandwidth_bytes) for _ in range(cfg.repeats)]
    return Floor(kv_bytes_per_token=per_token, kv_bytes_source=source, file_bytes_per_token=file_per_token,
                 read_bandwidth_bytes_per_s=summarize(b.bytes_per_s for b in runs),
                 read_bandwidth_method=sorted({b.method for b in runs}),
                 read_bandwidth_bytes=cfg.bandwidth_bytes, read_bandwidth_dir=str(bandwidth_dir))


def _kv_bytes_from_config(tok_dir: Path) -> tuple[float | None, str | None]:
    """KV bytes per token and how they were counted, from the model's config.json; Nones if it cannot say."""
    try:
        c = json.loads((tok_dir / "config.json").read_text())
        heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        dtype = str(c.get("dtype") or c.get("torch_dtype") or "bfloat16")
        size = 4 if "32" in dtype else 2
        per_token = c["num_hidden_layers"] * 2 * heads * head_dim * size
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    return (float(per_token), f"model config: {c['num_hidden_layers']} layers x 2 x {heads} kv heads x "
                              f"{head_dim} head dim x {size} bytes ({dtype})")


def _derive(res: TtftTarget, floor: Floor) -> None:
    bw = floor.read_bandwidth_bytes_per_s
    per_token = floor.kv_bytes_per_token
    for n, row in res.lengths.items():
        step = row.decode_step_s
        floor_s = None
        if bw and per_token and step:
            read_s = n * per_token / bw.median
            floor_s = read_s + step.median
            row.floor_read_s = read_s
        row.floor_s = floor_s
        row.ratios = Ratios(
            ram_over_cold=ratio(row.ram_hit_s, row.cold_s),
            disk_over_cold=ratio(row.disk_hit_s, row.cold_s),
            partial_over_cold=ratio(row.partial_s, row.cold_s),
            disk_over_floor=ratio(row.disk_hit_s, floor_s),
            ram_over_decode_step=ratio(row.ram_hit_s, step),
        )


# ---- tables and plot ------------------------------------------------------------------------------------


def _cached(rows: list[TtftRequest]) -> str:
    vals: list[Any] = [r.cached_tokens for r in rows if r.ok]
    if not vals or any(v is None for v in vals):
        return "n/a"
    return "/".join(str(v) for v in sorted(set(vals)))


def _tables(cfg: TtftConfig, floor: Floor, targets: dict[str, TtftTarget]) -> list[dict[str, Any]]:
    reps = cfg.repeats
    t1, t2, t3 = [], [], []
    for name, res in targets.items():
        for n, row in res.lengths.items():
            disk = report.ms(row.disk_hit_s) if res.restart else "n/a (no restart)"
            t1.append([name, n, report.ms(row.cold_s), report.ms(row.ram_hit_s), disk,
                       report.ms(row.partial_s), report.ms(row.decode_step_s, 1), report.ms(row.floor_s)])
            r = row.ratios
            assert r is not None  # _derive ran
            t2.append([name, n, report.x(r.ram_over_cold, 3), report.x(r.disk_over_cold, 3),
                       report.x(r.partial_over_cold, 3), report.x(r.disk_over_floor),
                       report.x(r.ram_over_decode_step)])
            q = row.requests
            if res.is_kvcellar:
                disk_tiers = [d.tiers for d in q.disk if d.ok and d.tiers is not None]
                ssd = "/".join(str(int(t.ssd_tokens)) for t in disk_tiers) or "-"
                ram = "/".join(str(int(t.ram_tokens)) for t in disk_tiers) or "-"
                mib = "/".join(f"{t.ssd_bytes_loaded / (1 << 20):.1f}" for t in disk_tiers) or "-"
            else:
                ssd = ram = mib = "n/a (peer)"
            t3.append([name, n, _cached(q.cold), _cached(q.ram), _cached(q.partial), _cached(q.disk),
                       ssd, ram, mib])
    bw = floor.read_bandwidth_bytes_per_s
    restarts = {name: res.restart for name, res in targets.items()}
    drops = sorted({d for r in restarts.values() if r for d in r.page_cache_before_each})
    notes = [f"median (min–max) of {reps} repeat(s); a fresh prompt per repeat; prompt lengths are "
             f"tokenizer-exact ({cfg.prompt_tokens})",
             f"partial: the last {sorted({u for v in cfg.partial_unshared_tokens.values() for u in v})} tokens "
             "differ from a prompt answered just before (RAM)",
             "decode step: mean gap between streamed tokens of the RAM-hit reply at that context",
             "floor = prompt KV bytes / sequential O_DIRECT read bandwidth + one decode step"]
    for name, restart in restarts.items():
        if restart is None:
            notes.append(f"{name}: a running server at a URL; the bench cannot restart it, so no disk hit")
        elif not targets[name].is_kvcellar:
            notes.append(f"{name}: disk hit = what the peer's own cache serves after a restart "
                         "(for llama-cpp-python: --cache true --cache_type disk)")
    tables = [
        report.table("TTFT by prompt length (ms)",
                     ["target", "tokens", "cold", "RAM hit", "disk hit (restart)", "partial", "decode step",
                      "floor"], t1, notes),
        report.table("TTFT ratios",
                     ["target", "tokens", "RAM/cold", "disk/cold", "partial/cold", "disk/floor (<=1.5)",
                      "RAM/decode step (<=1.2)"], t2),
        report.table("Cached prompt tokens (usage) and disk-hit tier split (/health deltas)",
                     ["target", "tokens", "cached cold", "cached RAM", "cached partial", "cached disk",
                      "disk hit: from SSD", "disk hit: from RAM", "disk hit: MiB read"], t3,
                     ["per repeat, '/'-separated where they differ; n/a: the server does not report it"]),
        report.table("Floor inputs (measured in this run)", ["figure", "value"], [
            ["O_DIRECT sequential read, MiB/s", report.num(None if bw is None else bw.scaled(1 / (1 << 20)), 0)],
            ["read method", ", ".join(floor.read_bandwidth_method)],
            ["bytes read per measurement", f"{floor.read_bandwidth_bytes >> 20} MiB"],
            ["KV bytes per token", f"{floor.kv_bytes_per_token or '-'}"],
            ["KV bytes from", str(floor.kv_bytes_source)],
            ["page cache before each disk hit", ", ".join(drops) or "n/a"],
        ]),
    ]
    return tables


def _disk_over_floor(row: LengthRow | None) -> float | None:
    return row.ratios.disk_over_floor if row is not None and row.ratios is not None else None


def plot(result: TtftResult, out_dir: Path) -> list[Path]:
    plt = report.pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    # colour = phase, line style and marker = target; keys are LengthRow's fields
    phases = {"cold_s": ("cold", "tab:blue"), "ram_hit_s": ("RAM hit", "tab:orange"),
              "disk_hit_s": ("disk hit", "tab:green"), "partial_s": ("partial", "tab:red"),
              "floor_s": ("floor", "dimgray")}
    looks = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "d")]
    for t_index, (name, res) in enumerate(result.targets.items()):
        line, marker = looks[t_index % len(looks)]
        lengths = list(res.lengths)
        for key, (label, colour) in phases.items():
            rows = [getattr(res.lengths[n], key) for n in lengths]
            pts = [(n, r) for n, r in zip(lengths, rows, strict=False) if r is not None]
            if not pts:
                continue
            xs = [n for n, _ in pts]
            if isinstance(pts[0][1], Summary):
                ys = [r.median * 1000 for _, r in pts]
                err = [[(r.median - r.min) * 1000 for _, r in pts], [(r.max - r.median) * 1000 for _, r in pts]]
            else:
                ys, err = [r * 1000 for _, r in pts], None
            ax.errorbar(xs, ys, yerr=err, color=colour, linestyle=line, marker=marker, capsize=3,
                        label=f"{name}: {label}", alpha=0.6 if key == "floor_s" else 1.0)
    all_lengths = sorted({n for res in result.targets.values() for n in res.lengths})
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_lengths, [str(n) for n in all_lengths])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, ms (median, min–max)")
    ax.set_title("Time to first token")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    names = list(result.targets)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        res = result.targets[name]
        vals = [_disk_over_floor(res.lengths.get(n)) for n in all_lengths]
        ax2.bar([j + i * width for j in range(len(all_lengths))], [v or 0 for v in vals], width, label=name)
    ax2.axhline(1.5, color="red", linestyle="--", label="target 1.5x")
    ratios = [v for res in result.targets.values() for row in res.lengths.values()
              for v in [_disk_over_floor(row)] if v]
    if ratios and max(ratios) > 10:
        ax2.set_yscale("log")
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(all_lengths))], [str(n) for n in all_lengths])
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("disk-hit TTFT / floor")
    ax2.set_title("Disk hit against the physical floor")
    ax2.legend(fontsize=8)
    return report.save_figure(fig, out_dir, "ttft.png")
