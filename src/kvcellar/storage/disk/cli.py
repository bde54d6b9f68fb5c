"""``kvcellar cache {stats,verify,prune,clear}``: registered on the top-level
parser by ``add_cache_commands(subparsers)``; each sub-command sets
``args.func`` to ``run_cache_command``, which returns the exit status.

Exit status: 0 on success; ``verify`` returns 1 when it found bad blocks
(deleted unless ``--keep``); 2 for a cache directory that does not exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvcellar.paths import clear_draft_outputs, resolve_cache_dir
from kvcellar.storage.disk import maintenance
from kvcellar.storage.secret import resolve_cache_secret
from kvcellar.units import format_bytes

__all__ = ["add_cache_commands", "kv_root", "run_cache_command"]

GIB = 1 << 30


def kv_root(cache_dir: Path) -> Path:
    """Where KV blocks live inside a cache directory (artifacts live beside it)."""
    return cache_dir / "kv"


def add_cache_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cache`` and its sub-commands on an argparse subparsers object."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $KVCELLAR_CACHE_DIR, else ~/.cache/kvcellar)")
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")

    cache: argparse.ArgumentParser = subparsers.add_parser("cache", help="inspect and maintain the persistent KV cache")
    sub = cache.add_subparsers(dest="cache_command", required=True, metavar="{stats,verify,prune,clear}")
    sub.add_parser("stats", parents=[common], help="blocks, bytes and ages per namespace")
    v = sub.add_parser("verify", parents=[common], help="read and check every block; delete bad ones")
    v.add_argument("--keep", action="store_true", help="report bad blocks without deleting them")
    v.add_argument("--cache-secret-file", default=None,
                   help="the servers' secret: seals are checked too, and unsealed or forged blocks are bad (also "
                        "KVCELLAR_CACHE_SECRET_FILE, or the secret itself in KVCELLAR_CACHE_SECRET)")
    v.add_argument("--cache-previous-secrets-file", default=None,
                   help="during a rotation, the secrets before it, one a line: their seals count as good, and "
                        "how many blocks still carry them is reported (also KVCELLAR_CACHE_PREVIOUS_SECRETS_FILE)")
    p = sub.add_parser("prune", parents=[common],
                       help="delete expired blocks, then LRU blocks over a size (the tier's order: leaves first)")
    p.add_argument("--ttl-days", type=float, default=7.0, help="delete blocks not used for this long (default 7)")
    p.add_argument("--max-gb", type=float, default=None,
                   help="then keep at most this many GiB over all namespaces, least recently used leaves first")
    c = sub.add_parser("clear", parents=[common], help="delete every cached block (lists what it deletes)")
    c.add_argument("--namespace", action="append", default=None,
                   help="only this namespace (repeatable); default: all")
    cache.set_defaults(func=run_cache_command)
    for s in sub.choices.values():
        s.set_defaults(func=run_cache_command)
    return cache


def run_cache_command(args: argparse.Namespace) -> int:
    cache_dir = resolve_cache_dir(args.cache_dir)
    root = kv_root(cache_dir)
    progress = not args.no_progress and not args.json and sys.stderr.isatty()
    cmd = args.cache_command
    if cmd != "stats" and not cache_dir.exists():
        print(f"kvcellar: no cache directory at {cache_dir}", file=sys.stderr)
        return 2
    if cmd == "stats":
        stats = maintenance.cache_stats(root, progress=progress)
        if args.json:
            _dump({"kv_root": str(root), "namespaces": [s.as_dict() for s in stats]})
            return 0
        print(f"KV cache at {root}")
        if not stats:
            print("  (empty)")
        for s in stats:
            d = s.as_dict()
            flag = "" if s.info.current else f"  [old format v{s.info.version}]"
            print(f"  {s.info.namespace}{flag}")
            desc = d["descriptor"] or {}
            if desc:
                print("    " + ", ".join(f"{k}={v}" for k, v in desc.items() if v not in (None, "")))
            print(f"    blocks {s.blocks}, {format_bytes(s.bytes)}; unreachable {s.unreachable_blocks}; "
                  f"temp files {s.tmp_files}; sessions live {s.live_sessions}, unclean {s.unclean_sessions}")
            if s.blocks:
                print(f"    last access {d['oldest_access']} .. {d['newest_access']}; "
                      f"written {d['oldest_write']} .. {d['newest_write']}")
        total = sum(s.bytes for s in stats)
        print(f"  total: {sum(s.blocks for s in stats)} blocks, {format_bytes(total)}")
        return 0
    if cmd == "verify":
        try:
            _, secret = resolve_cache_secret(args.cache_secret_file, args.cache_previous_secrets_file)
        except ValueError as exc:
            print(f"kvcellar: {exc}", file=sys.stderr)
            return 2
        reports = maintenance.verify_cache(root, delete=not args.keep, progress=progress, secret=secret)
        bad = sum(sum(r.bad.values()) for r in reports)
        if args.json:
            _dump({"kv_root": str(root), "namespaces": [r.as_dict() for r in reports]})
        else:
            for r in reports:
                if r.skipped:
                    print(f"  {r.info.namespace}: skipped ({r.skipped})")
                    continue
                detail = ", ".join(f"{k}: {n}" for k, n in sorted(r.bad.items())) or "none"
                previous = f" ({r.previous_secret} sealed by a previous secret)" if r.previous_secret else ""
                print(f"  {r.info.namespace}: {r.checked} checked, {r.ok} ok{previous}, bad: {detail}, "
                      f"deleted {r.deleted}, unreadable {r.unreadable}")
            print(f"verify: {bad} bad block(s)" + (" deleted" if bad and not args.keep else "")
                  + ("" if secret is not None else "; seals not checked (no --cache-secret-file)"))
        return 1 if bad else 0
    if cmd == "prune":
        cap = None if args.max_gb is None else int(args.max_gb * GIB)
        rep = maintenance.prune_cache(root, ttl_s=args.ttl_days * 86400, capacity_bytes=cap, progress=progress)
        if args.json:
            _dump(rep.as_dict())
        else:
            print(f"prune: {rep.ttl_removed} expired block(s) ({format_bytes(rep.ttl_bytes)}), "
                  f"{rep.capacity_removed} over the size limit ({format_bytes(rep.capacity_bytes)}), "
                  f"{rep.unreachable_removed} unreachable ({format_bytes(rep.unreachable_bytes)}), "
                  f"{rep.orphan_tmp_removed} orphan temp file(s) removed; "
                  f"{rep.remaining_blocks} block(s), {format_bytes(rep.remaining_bytes)} remain")
            for name in rep.namespaces_removed:
                print(f"  removed empty old-format namespace {name}")
        return 0
    if cmd == "clear":
        cleared = maintenance.clear_cache(root, args.namespace, progress=progress)
        # what --speculative suffix kept of the outputs goes with the blocks
        outputs = clear_draft_outputs(cache_dir, None if args.namespace is None
                                      else [n["namespace"] for n in cleared.namespaces])
        if args.json:
            _dump({**cleared.as_dict(), "draft_outputs": [str(p) for p in outputs]})
        else:
            if not cleared.namespaces and not outputs:
                print("clear: nothing to delete")
            for n in cleared.namespaces:
                live = f" (was open by {n['live_sessions']} running server(s))" if n["live_sessions"] else ""
                print(f"  deleted {n['dir']}: {n['blocks']} block(s), {format_bytes(n['bytes'])}{live}")
            for path in outputs:
                print(f"  deleted {path} (recent outputs drafts are taken from)")
        return 0
    raise AssertionError(cmd)


def _dump(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
