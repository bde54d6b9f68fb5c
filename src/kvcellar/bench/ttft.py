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
from pathlib import Path
from typing import Any

from kvcellar.bench import report
from kvcellar.bench.client import ChatClient, StreamResult
from kvcellar.bench.pagecache import drop_page_cache, method_name
from kvcellar.bench.prompts import ChatPrompt, PromptMaker, find_tokenizer_dir, resolve_tokenizer, shared_prefix_len
from kvcellar.bench.stats import ratio, summarize
from kvcellar.bench.targets import (
    ProcessTarget,
    Target,
    TierSplit,
    add_target_arguments,
    cleanup_cache,
    default_models_dir,
    targets_from_args,
)

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


def _config(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(
        FAST_LENGTHS if args.fast else FULL_LENGTHS)
    return {
        "lengths": lengths,
        "repeats": args.repeats or (1 if args.fast else 3),
        "partial_tail": args.partial_tail,
        "decode_tokens": args.decode_tokens or (8 if args.fast else 32),
        "bandwidth_bytes": (args.bandwidth_mib or (16 if args.fast else 512)) << 20,
        "seed": str(args.seed),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    out: Path = args.out
    targets = targets_from_args(args, out)
    prompts: dict[int, list[tuple[ChatPrompt, ChatPrompt]]] | None = None
    tok_dir: Path | None = None
    results: dict[str, Any] = {}
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
    result = {"config": cfg, "floor": floor, "targets": results,
              "servers": [t.describe() for t in targets]}
    result["tables"] = _tables(result)
    return result


# ---- prompts -------------------------------------------------------------------------------------


def _build_prompts(maker: PromptMaker, cfg: dict[str, Any], tok_dir: Path | None,
                   context: int | None) -> dict[int, list[tuple[ChatPrompt, ChatPrompt]]]:
    if context is None:
        context = 8192  # unless the tokenizer folder's config.json says
        if tok_dir is not None:
            try:
                context = int(json.loads((tok_dir / "config.json").read_text())["max_position_embeddings"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
    limit = context - cfg["decode_tokens"] - 1
    cfg["context"] = context
    cfg["lengths"] = sorted({min(n, limit) for n in cfg["lengths"]})
    out: dict[int, list[tuple[ChatPrompt, ChatPrompt]]] = {}
    for n in cfg["lengths"]:
        tail = min(cfg["partial_tail"], n // 2)
        out[n] = [maker.partial_pair(n, f"{cfg['seed']}:ttft:{n}:{r}", tail) for r in range(cfg["repeats"])]
    cfg["prompt_tokens"] = {str(n): [a.n_tokens for a, _ in out[n]] for n in out}
    cfg["partial_unshared_tokens"] = {
        str(n): [a.n_tokens - shared_prefix_len(a.token_ids, b.token_ids) for a, b in out[n]] for n in out}
    return out


# ---- measuring one target --------------------------------------------------------------------------


async def _measure(target: Target, prompts: dict[int, list[tuple[ChatPrompt, ChatPrompt]]],
                   cfg: dict[str, Any]) -> dict[str, Any]:
    kvcellar = target.is_kvcellar
    res: dict[str, Any] = {"kind": target.kind, "is_kvcellar": kvcellar, "lengths": {}, "errors": []}
    raw: dict[int, dict[str, list[dict[str, Any]]]] = {n: {"cold": [], "ram": [], "partial": [], "disk": []}
                                                        for n in prompts}
    model = target.served_model()
    async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
        await _warm_up(client, f"{cfg['seed']}:warm:{target.name}:{target.starts}")
        for n, pairs in prompts.items():
            for a, b in pairs:
                raw[n]["cold"].append(await _timed(client, target, a, 1, kvcellar))
                raw[n]["ram"].append(await _timed(client, target, a, cfg["decode_tokens"], kvcellar,
                                                  ignore_eos=True))
                raw[n]["partial"].append(await _timed(client, target, b, 1, kvcellar))
    res["restart"] = None
    if target.can_restart:
        method = target.restart(drop_cache=True)
        res["restart"] = {"page_cache": method, "stop_s": getattr(target, "last_stop_s", None),
                          "start_s": getattr(target, "last_start_s", None),
                          "exit_code": getattr(target, "last_exit_code", None)}
        drops: list[str] = []
        async with ChatClient(target.base_url, model, api_key=target.api_key) as client:
            await _warm_up(client, f"{cfg['seed']}:warm:{target.name}:{target.starts}")
            for n, pairs in prompts.items():
                for a, _b in pairs:
                    drops.append(drop_page_cache([target.cache_dir] if target.cache_dir else []))
                    raw[n]["disk"].append(await _timed(client, target, a, 1, kvcellar))
        res["restart"]["page_cache_before_each"] = sorted({method_name(d) for d in drops})
    for n in prompts:
        phases = raw[n]
        for phase, rows in phases.items():
            res["errors"] += [f"{n} {phase}: {r['error']}" for r in rows if not r["ok"]]
        res["lengths"][str(n)] = {
            "prompt_tokens": [a.n_tokens for a, _ in prompts[n]],
            "server_prompt_tokens": [r["prompt_tokens"] for r in phases["cold"]],
            "cold_s": summarize(r["ttft_s"] for r in phases["cold"] if r["ok"]),
            "ram_hit_s": summarize(r["ttft_s"] for r in phases["ram"] if r["ok"]),
            "partial_s": summarize(r["ttft_s"] for r in phases["partial"] if r["ok"]),
            "disk_hit_s": summarize(r["ttft_s"] for r in phases["disk"] if r["ok"]),
            "decode_step_s": summarize(r["decode_step_s"] for r in phases["ram"] if r["ok"]),
            "requests": phases,
        }
    return res


async def _warm_up(client: ChatClient, seed: str) -> None:
    """Two short unrelated requests, so first-request costs of a fresh process are not timed."""
    for i in range(2):
        messages = [{"role": "user", "content": f"Warm-up {seed} {i}: name three colors."}]
        await client.stream_chat(messages, 4)


async def _timed(client: ChatClient, target: Target, prompt: ChatPrompt, max_tokens: int, kvcellar: bool,
                 ignore_eos: bool = False) -> dict[str, Any]:
    before = target.counters() if kvcellar else {}
    r: StreamResult = await client.stream_chat(prompt.messages, max_tokens, ignore_eos=ignore_eos)
    row = r.as_dict()
    row.pop("text", None)
    if kvcellar:
        row["tiers"] = dataclasses.asdict(TierSplit.between(before, target.counters()))
    return row


# ---- the floor --------------------------------------------------------------------------------------


def _floor_inputs(cfg: dict[str, Any], kv_spec: dict[str, Any] | None, tok_dir: Path | None,
                  bandwidth_dir: Path) -> dict[str, Any]:
    from kvcellar.storage.disk.bandwidth import measure_read_bandwidth_detailed

    floor: dict[str, Any] = {"kv_bytes_per_token": None, "kv_bytes_source": None}
    if kv_spec and kv_spec.get("block_nbytes") and kv_spec.get("block_size"):
        floor["kv_bytes_per_token"] = kv_spec["block_nbytes"] / kv_spec["block_size"]
        floor["kv_bytes_source"] = f"SSD tier namespace.json (block_nbytes {kv_spec['block_nbytes']} / " \
                                   f"block_size {kv_spec['block_size']}, dtype {kv_spec.get('dtype')})"
        if kv_spec.get("file_nbytes"):
            floor["file_bytes_per_token"] = kv_spec["file_nbytes"] / kv_spec["block_size"]
    elif tok_dir is not None:
        floor.update(_kv_bytes_from_config(tok_dir))
    runs = [measure_read_bandwidth_detailed(bandwidth_dir, cfg["bandwidth_bytes"]) for _ in range(cfg["repeats"])]
    floor["read_bandwidth_bytes_per_s"] = summarize(b.bytes_per_s for b in runs)
    floor["read_bandwidth_method"] = sorted({b.method for b in runs})
    floor["read_bandwidth_bytes"] = cfg["bandwidth_bytes"]
    floor["read_bandwidth_dir"] = str(bandwidth_dir)
    return floor


def _kv_bytes_from_config(tok_dir: Path) -> dict[str, Any]:
    try:
        c = json.loads((tok_dir / "config.json").read_text())
        heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        dtype = str(c.get("dtype") or c.get("torch_dtype") or "bfloat16")
        size = 4 if "32" in dtype else 2
        per_token = c["num_hidden_layers"] * 2 * heads * head_dim * size
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {"kv_bytes_per_token": float(per_token),
            "kv_bytes_source": f"model config: {c['num_hidden_layers']} layers x 2 x {heads} kv heads x "
                               f"{head_dim} head dim x {size} bytes ({dtype})"}


def _derive(res: dict[str, Any], floor: dict[str, Any]) -> None:
    bw = floor.get("read_bandwidth_bytes_per_s")
    per_token = floor.get("kv_bytes_per_token")
    for n, row in res["lengths"].items():
        step = row["decode_step_s"]
        floor_s = None
        if bw and per_token and step:
            read_s = int(n) * per_token / bw["median"]
            floor_s = read_s + step["median"]
            row["floor_read_s"] = read_s
        row["floor_s"] = floor_s
        row["ratios"] = {
            "ram_over_cold": ratio(row["ram_hit_s"], row["cold_s"]),
            "disk_over_cold": ratio(row["disk_hit_s"], row["cold_s"]),
            "partial_over_cold": ratio(row["partial_s"], row["cold_s"]),
            "disk_over_floor": ratio(row["disk_hit_s"], floor_s),
            "ram_over_decode_step": ratio(row["ram_hit_s"], step),
        }


# ---- tables and plot ------------------------------------------------------------------------------------


def _cached(rows: list[dict[str, Any]]) -> str:
    vals: list[Any] = [r.get("cached_tokens") for r in rows if r.get("ok")]
    if not vals or any(v is None for v in vals):
        return "n/a"
    return "/".join(str(v) for v in sorted(set(vals)))


def _tables(result: dict[str, Any]) -> list[dict[str, Any]]:
    cfg, floor = result["config"], result["floor"]
    reps = cfg["repeats"]
    t1, t2, t3 = [], [], []
    for name, res in result["targets"].items():
        for n, row in res["lengths"].items():
            disk = report.ms(row["disk_hit_s"]) if res["restart"] else "n/a (no restart)"
            t1.append([name, n, report.ms(row["cold_s"]), report.ms(row["ram_hit_s"]), disk,
                       report.ms(row["partial_s"]), report.ms(row["decode_step_s"], 1), report.ms(row["floor_s"])])
            r = row["ratios"]
            t2.append([name, n, report.x(r["ram_over_cold"], 3), report.x(r["disk_over_cold"], 3),
                       report.x(r["partial_over_cold"], 3), report.x(r["disk_over_floor"]),
                       report.x(r["ram_over_decode_step"])])
            q = row["requests"]
            if res["is_kvcellar"]:
                disk_rows = [d for d in q["disk"] if d.get("ok")]
                ssd = "/".join(str(int(d["tiers"]["ssd_tokens"])) for d in disk_rows) or "-"
                ram = "/".join(str(int(d["tiers"]["ram_tokens"])) for d in disk_rows) or "-"
                mib = "/".join(f"{d['tiers']['ssd_bytes_loaded'] / (1 << 20):.1f}" for d in disk_rows) or "-"
            else:
                ssd = ram = mib = "n/a (peer)"
            t3.append([name, n, _cached(q["cold"]), _cached(q["ram"]), _cached(q["partial"]), _cached(q["disk"]),
                       ssd, ram, mib])
    bw = floor.get("read_bandwidth_bytes_per_s")
    restarts = {name: res["restart"] for name, res in result["targets"].items()}
    drops = sorted({d for r in restarts.values() if r for d in r.get("page_cache_before_each", [])})
    notes = [f"median (min–max) of {reps} repeat(s); a fresh prompt per repeat; prompt lengths are "
             f"tokenizer-exact ({cfg['prompt_tokens']})",
             f"partial: the last {sorted({u for v in cfg['partial_unshared_tokens'].values() for u in v})} tokens "
             "differ from a prompt answered just before (RAM)",
             "decode step: mean gap between streamed tokens of the RAM-hit reply at that context",
             "floor = prompt KV bytes / sequential O_DIRECT read bandwidth + one decode step"]
    for name, r in restarts.items():
        if r is None:
            notes.append(f"{name}: a running server at a URL; the bench cannot restart it, so no disk hit")
        elif not result["targets"][name]["is_kvcellar"]:
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
            ["O_DIRECT sequential read, MiB/s",
             report.num(None if bw is None else {k: (v / (1 << 20) if k in ("median", "min", "max") else v)
                                                  for k, v in bw.items()}, 0)],
            ["read method", ", ".join(floor.get("read_bandwidth_method", []))],
            ["bytes read per measurement", f"{floor.get('read_bandwidth_bytes', 0) >> 20} MiB"],
            ["KV bytes per token", f"{floor.get('kv_bytes_per_token') or '-'}"],
            ["KV bytes from", str(floor.get("kv_bytes_source"))],
            ["page cache before each disk hit", ", ".join(drops) or "n/a"],
        ]),
    ]
    return tables


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = report.pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    # colour = phase, line style and marker = target
    phases = {"cold_s": ("cold", "tab:blue"), "ram_hit_s": ("RAM hit", "tab:orange"),
              "disk_hit_s": ("disk hit", "tab:green"), "partial_s": ("partial", "tab:red"),
              "floor_s": ("floor", "dimgray")}
    looks = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "d")]
    for t_index, (name, res) in enumerate(result["targets"].items()):
        line, marker = looks[t_index % len(looks)]
        lengths = [int(n) for n in res["lengths"]]
        for key, (label, colour) in phases.items():
            rows = [res["lengths"][str(n)][key] for n in lengths]
            pts = [(n, r) for n, r in zip(lengths, rows, strict=False) if r is not None]
            if not pts:
                continue
            xs = [n for n, _ in pts]
            if isinstance(pts[0][1], dict):
                ys = [r["median"] * 1000 for _, r in pts]
                err = [[(r["median"] - r["min"]) * 1000 for _, r in pts], [(r["max"] - r["median"]) * 1000
                                                                          for _, r in pts]]
            else:
                ys, err = [r * 1000 for _, r in pts], None
            ax.errorbar(xs, ys, yerr=err, color=colour, linestyle=line, marker=marker, capsize=3,
                        label=f"{name}: {label}", alpha=0.6 if key == "floor_s" else 1.0)
    all_lengths = sorted({int(n) for res in result["targets"].values() for n in res["lengths"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_lengths, [str(n) for n in all_lengths])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, ms (median, min–max)")
    ax.set_title("Time to first token")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    names = list(result["targets"])
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        res = result["targets"][name]
        vals = [(res["lengths"].get(str(n)) or {}).get("ratios", {}).get("disk_over_floor") for n in all_lengths]
        ax2.bar([j + i * width for j in range(len(all_lengths))], [v or 0 for v in vals], width, label=name)
    ax2.axhline(1.5, color="red", linestyle="--", label="target 1.5x")
    ratios = [v for res in result["targets"].values() for row in res["lengths"].values()
              for v in [row.get("ratios", {}).get("disk_over_floor")] if v]
    if ratios and max(ratios) > 10:
        ax2.set_yscale("log")
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(all_lengths))], [str(n) for n in all_lengths])
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("disk-hit TTFT / floor")
    ax2.set_title("Disk hit against the physical floor")
    ax2.legend(fontsize=8)
    return report.save_figure(fig, out_dir, "ttft.png")
