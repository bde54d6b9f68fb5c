"""``kvcellar models {list,prune,clear,verify} [--cache-dir DIR]``: the prepared-model cache."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvcellar.artifacts import ArtifactCache
from kvcellar.settings import load_settings
from kvcellar.units import format_bytes


def add_models_commands(subparsers: Any) -> Any:
    """Register ``models`` under the top-level sub-command parsers; returns its verbs' parsers
    (the top level adds ``plan``, which needs the engine's view of a model)."""
    p = subparsers.add_parser("models", help="list, prune, clear or verify prepared model artifacts")
    verbs = p.add_subparsers(dest="models_command", required=True)

    def common(v: argparse.ArgumentParser) -> None:
        v.add_argument("--cache-dir", default=None,
                       help="cache root (default: KVCELLAR_CACHE_DIR, else ~/.cache/kvcellar); models live in "
                            "<cache-dir>/models")
        v.add_argument("--json", action="store_true", help="machine-readable output")

    v = verbs.add_parser("list", help="entries, least recently used first, with sizes and use counts")
    common(v)
    v.set_defaults(func=cmd_models_list)

    v = verbs.add_parser("prune", help="drop leftovers and damaged entries, then enforce the size limit "
                                       "(LRU down to 80 %%); entries in use are kept")
    common(v)
    v.add_argument("--max-gb", type=float, default=None, help="size limit to enforce (default: the configured one)")
    v.add_argument("--older-than-days", type=float, default=None, help="also drop entries unused for this long")
    v.set_defaults(func=cmd_models_prune)

    v = verbs.add_parser("clear", help="remove every entry no running process holds")
    common(v)
    v.set_defaults(func=cmd_models_clear)

    v = verbs.add_parser("verify", help="full sha256 of every entry; corrupt ones are removed")
    common(v)
    v.set_defaults(func=cmd_models_verify)
    return verbs


def _open(args: argparse.Namespace) -> ArtifactCache:
    settings = load_settings(getattr(args, "config", None), cache_dir=args.cache_dir,
                             flags={"artifacts": {"max_gb": getattr(args, "max_gb", None)}})
    return ArtifactCache.open(settings.cache_dir, settings.artifacts)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _rate(stats: dict[str, float]) -> str:
    looked_up = stats["artifact_lifetime_hits"] + stats["artifact_lifetime_misses"]
    return f"{stats['artifact_lifetime_hits'] / looked_up:.0%}" if looked_up else "-"


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    sys.stdout.write(json.dumps(payload, indent=1, default=str) + "\n" if args.json else text)


def cmd_models_list(args: argparse.Namespace) -> int:
    cache = _open(args)
    entries = cache.entries()
    stats = cache.stats()
    lines = [f"{cache.root}: {len(entries)} entries, {format_bytes(stats['artifact_bytes_used'])} of "
             f"{format_bytes(stats['artifact_bytes_limit'])}; lifetime hits {stats['artifact_lifetime_hits']:.0f}, "
             f"misses {stats['artifact_lifetime_misses']:.0f}, builds {stats['artifact_lifetime_builds']:.0f}, "
             f"evictions {stats['artifact_lifetime_evictions']:.0f}, corrupt {stats['artifact_lifetime_corrupt']:.0f}"
             f"; hit rate {_rate(stats)}"]
    if entries:
        lines.append(f"{'KEY':10} {'NAME':28} {'DTYPE':9} {'SIZE':>10} {'CREATED':16} {'LAST USE':16} "
                     f"{'USES':>5} IN USE  SOURCE")
    for e in entries:
        d = e.descriptor
        lines.append(f"{e.key[:10]:10} {str(d.get('name', '?'))[:28]:28} {d.get('dtype', '?')!s:9} "
                     f"{format_bytes(e.size_bytes):>10} {_when(e.created):16} {_when(e.last_access):16} "
                     f"{e.access_count:>5} {'yes' if e.in_use else 'no':6}  {d.get('source', '?')}")
    payload = {"root": str(cache.root), "stats": stats,
               "entries": [{**vars(e), "path": str(e.path)} for e in entries]}
    _emit(args, payload, "\n".join(lines) + "\n")
    return 0


def cmd_models_prune(args: argparse.Namespace) -> int:
    cache = _open(args)
    older = None if args.older_than_days is None else args.older_than_days * 86400.0
    report = cache.prune(older_than_s=older)
    text = (f"expired {len(report['expired'])}, evicted {len(report['evicted'])}, kept in use "
            f"{len(report['skipped_in_use'])}, damaged removed {report['damaged_removed']}, leftovers removed "
            f"{report['tmp_removed']}; now {format_bytes(cache.stats()['artifact_bytes_used'])}\n")
    _emit(args, report, text)
    return 0


def cmd_models_clear(args: argparse.Namespace) -> int:
    cache = _open(args)
    report = cache.clear()
    text = f"removed {len(report['removed'])} entries"
    if report["skipped_in_use"]:
        text += f"; kept {len(report['skipped_in_use'])} in use by a running process"
    _emit(args, report, text + "\n")
    return 0


def cmd_models_verify(args: argparse.Namespace) -> int:
    cache = _open(args)
    report = cache.verify_all()
    _emit(args, report, f"ok {len(report['ok'])}, corrupt (removed) {len(report['corrupt'])}\n")
    return 1 if report["corrupt"] else 0
