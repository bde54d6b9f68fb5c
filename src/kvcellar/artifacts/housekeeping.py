"""Housekeeping of the artifact cache: the start-up scan, LRU eviction, listing and removal.

Each function works on a ``CacheDirectory`` (directory.py) and never removes an entry a
process holds: removal takes the key's use lock exclusive and non-blocking and skips the
entry when it can't (locks.py). ``ArtifactCache`` (store.py) exposes them as its verbs:
``scan`` at open, ``evict_to_fit`` after a build, ``entries``/``prune``/``clear``/
``verify_all`` for the ``kvcellar models`` CLI or an operator thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcellar.artifacts.descriptor import ArtifactDescriptor
from kvcellar.artifacts.directory import CacheDirectory
from kvcellar.artifacts.index import EntryRow
from kvcellar.artifacts.manifest import CorruptEntryError, Manifest, check_full, check_structure, stat_signature

log = logging.getLogger("kvcellar.artifacts.store")

EVICT_TO_FRACTION = 0.8


@dataclass
class EntryInfo:
    key: str
    path: Path
    descriptor: dict[str, Any]
    size_bytes: int
    created: float
    last_access: float
    access_count: int
    in_use: bool


# ---- start-up scan ----------------------------------------------------------------------------

def scan(d: CacheDirectory) -> dict[str, int]:
    """Reconcile the index with the disk: drop leftovers of dead builds and trash, remove
    damaged entries (no manifest, missing or resized files), register entries the index
    lacks, forget rows whose entry is gone. Cheap: a stat per file, no hashing."""
    report = {"tmp_removed": 0, "damaged_removed": 0, "registered": 0, "rows_dropped": 0}
    for p in d.tmp_dir.iterdir():
        if p.name.startswith("trash-"):
            d.remove_trash(p)
            report["tmp_removed"] += 1
            continue
        key = p.name.split(".", 1)[0]
        lock = d.build_lock(key)
        if lock.acquire(exclusive=True, blocking=False):  # no live builder owns it
            try:
                d.remove_trash(p)
                report["tmp_removed"] += 1
            finally:
                lock.release()
    on_disk = set()
    for entry in d.entries_dir.iterdir():
        key = entry.name
        on_disk.add(key)
        try:
            manifest = d.read_structure(key, entry)
            if d.index.get(key) is None:
                d.register(key, entry, manifest)
                report["registered"] += 1
        except CorruptEntryError as exc:
            if _discard_damaged(d, key, entry, str(exc)):
                report["damaged_removed"] += 1
                on_disk.discard(key)
        except FileNotFoundError:  # removed by another process meanwhile
            on_disk.discard(key)
    for row in d.index.entries():
        if row.key not in on_disk and not (d.entries_dir / row.key).is_dir():
            d.index.delete(row.key)
            report["rows_dropped"] += 1
    if any(report.values()):
        log.info("artifact cache scan of %s: %s", d.root, report)
    return report


def _discard_damaged(d: CacheDirectory, key: str, entry: Path, reason: str) -> bool:
    lock = d.build_lock(key)
    if not lock.acquire(exclusive=True, blocking=False):
        return False  # someone is rebuilding it right now
    try:
        try:
            d.read_structure(key, entry)
            return False  # replaced by a good one meanwhile
        except CorruptEntryError:
            pass
        log.warning("artifact entry removed at start-up: %s", reason)
        d.count("corrupt")
        d.discard(key, entry)
        return True
    finally:
        lock.release()


# ---- eviction and removal ---------------------------------------------------------------------

def remove_if_unused(d: CacheDirectory, key: str) -> bool:
    """Remove an entry unless some process holds it. True if it is gone."""
    use = d.use_lock(key)
    if not use.acquire(exclusive=True, blocking=False):
        return False
    try:
        trash = d.move_to_trash(d.entries_dir / key)
        d.index.delete(key)
    finally:
        use.release()
    d.remove_trash(trash)
    return True


def evict_to_fit(d: CacheDirectory, protect: set[str] | frozenset[str] = frozenset(),
                 max_bytes: int | None = None) -> list[str]:
    """Past the limit, evict least recently used entries no process holds, down to 80 % of it."""
    limit = d.max_bytes if max_bytes is None else max_bytes
    rows = d.index.entries()
    total = sum(r.size_bytes for r in rows)
    if total <= limit:
        return []
    target = int(limit * EVICT_TO_FRACTION)
    evicted: list[str] = []
    for row in rows:
        if total <= target:
            break
        if row.key in protect:
            continue
        if remove_if_unused(d, row.key):
            total -= row.size_bytes
            evicted.append(row.key)
            d.count("evictions")
            d.note_eviction(row.key, _label(row))
            log.info("artifact %s evicted (LRU, %d bytes)", _label(row), row.size_bytes)
        else:
            d.count("evict_skipped_in_use", lifetime=False)
    if total > limit:
        log.warning("artifact cache holds %d bytes, over its %d-byte limit; the rest is in use", total, limit)
    return evicted


def _label(row: EntryRow) -> str:
    try:
        return ArtifactDescriptor.from_dict(row.descriptor).label
    except TypeError:
        return row.key


# ---- listing and operator verbs ---------------------------------------------------------------

def list_entries(d: CacheDirectory) -> list[EntryInfo]:
    """Every entry, least recently used first, with whether a process holds it now."""
    out = []
    for row in d.index.entries():
        probe = d.use_lock(row.key)
        free = probe.acquire(exclusive=True, blocking=False)
        probe.release()
        out.append(EntryInfo(row.key, d.entries_dir / row.key, row.descriptor, row.size_bytes, row.created,
                             row.last_access, row.access_count, in_use=not free))
    return out


def prune(d: CacheDirectory, *, max_bytes: int | None = None, older_than_s: float | None = None) -> dict[str, Any]:
    """Scan, drop entries unused for ``older_than_s``, then enforce the size limit."""
    report: dict[str, Any] = dict(scan(d))
    removed: list[str] = []
    in_use: list[str] = []
    if older_than_s is not None:
        cutoff = time.time() - older_than_s
        for row in d.index.entries():
            if row.last_access < cutoff:
                (removed if remove_if_unused(d, row.key) else in_use).append(row.key)
    evicted = evict_to_fit(d, max_bytes=max_bytes)
    for path in d.index.digest_paths():
        if not Path(path).exists():
            d.index.digest_delete(path)
    report.update(expired=removed, evicted=evicted, skipped_in_use=in_use)
    return report


def clear(d: CacheDirectory) -> dict[str, list[str]]:
    """Remove every entry no process holds."""
    scan(d)
    removed: list[str] = []
    in_use: list[str] = []
    for row in d.index.entries():
        (removed if remove_if_unused(d, row.key) else in_use).append(row.key)
    for path in d.index.digest_paths():
        d.index.digest_delete(path)
    return {"removed": removed, "skipped_in_use": in_use}


def verify_all(d: CacheDirectory) -> dict[str, list[str]]:
    """Full sha256 of every entry; corrupt ones are removed (rebuilt on next use)."""
    ok, corrupt = [], []
    for row in d.index.entries():
        entry = d.entries_dir / row.key
        with _held(d, row.key) as present:
            if not present:
                continue
            created = None
            try:
                manifest = Manifest.read(entry)
                created = manifest.created
                check_structure(entry, manifest)
                check_full(entry, manifest)
            except CorruptEntryError as exc:
                corrupt.append(row.key)
                d.drop_if_same(row.key, created, str(exc))
                continue
            d.index.set_verified(row.key, {n: stat_signature(entry / n) for n in manifest.files})
            ok.append(row.key)
    return {"ok": ok, "corrupt": corrupt}


@contextlib.contextmanager
def _held(d: CacheDirectory, key: str) -> Iterator[bool]:
    lock = d.use_lock(key)
    lock.acquire(exclusive=False)
    try:
        yield (d.entries_dir / key).is_dir()
    finally:
        lock.release()
