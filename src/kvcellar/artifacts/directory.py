"""The artifact cache's directory: its layout, index and counters, and what may happen to one entry.

Layout of ``<cache_dir>/models/`` (KV blocks live beside it in ``<cache_dir>/kv``)::

    entries/<key>/     one prepared model: safetensors + config + tokenizer files + manifest.json
    locks/<key>.use    flock: shared while an entry is validated or served (see locks.py)
    locks/<key>.build  flock: exclusive while an entry is built
    tmp/               build dirs (<key>.<pid>.<rand>) and entries on their way out (trash-*)
    index.sqlite       bookkeeping and counters (see index.py); rebuildable from the manifests

Invariants:

* An entry appears atomically: built in ``tmp/``, files and dirs fsynced, renamed into
  ``entries/``. An entry dir without a readable manifest is damaged, never half-built.
* Every change of ``entries/<key>`` (create, replace a corrupt one, drop a failed one)
  happens under the key's build lock; eviction and removal happen under its exclusive use
  lock, which no one can hold while the entry is used. Hence no entry in use is evicted, and
  a corrupt entry seen by one process is replaced once, not by every process that sees it.
* An entry is served only after validation (``verify`` level, see config.py and
  manifest.py); a corrupt one is counted, moved out and rebuilt, never loaded.

``CacheDirectory`` holds these and the per-entry steps that acquire.py and housekeeping.py
share (read and check a manifest, register, move out and discard); ``ArtifactCache``
(store.py) builds on it. Its counters are thread-safe (``_stats_lock``); the per-entry
steps state which lock their caller holds.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
from pathlib import Path

from kvcellar.artifacts.config import ArtifactConfig
from kvcellar.artifacts.index import ArtifactIndex
from kvcellar.artifacts.locks import FileLock
from kvcellar.artifacts.manifest import CorruptEntryError, Manifest, check_structure
from kvcellar.errors import KvcellarError

log = logging.getLogger("kvcellar.artifacts.store")


class ArtifactStoreError(KvcellarError):
    """The cache directory can't be used (permissions, disk full, I/O error). Callers may fall
    back to preparing the model in memory without caching it."""


class CacheDirectory:
    """The directory ``root`` of an artifact cache. See the module docstring."""

    # Levels among the ``stats()`` keys (exported as gauges); the others are counts.
    GAUGES = frozenset({"artifact_entries", "artifact_bytes_used", "artifact_bytes_limit",
                        "artifact_last_eviction_time"})

    def __init__(self, root: Path, *, max_bytes: int | None = None, verify: str = "fast") -> None:
        cfg = ArtifactConfig()
        self.root = Path(root)
        self.max_bytes = cfg.max_bytes if max_bytes is None else int(max_bytes)
        if verify not in ("fast", "full"):
            raise ValueError(f"verify must be 'fast' or 'full', got {verify!r}")
        self.verify = verify
        self.entries_dir = self.root / "entries"
        self.locks_dir = self.root / "locks"
        self.tmp_dir = self.root / "tmp"
        self._stats_lock = threading.Lock()
        self._counters: dict[str, float] = dict.fromkeys(
            ("hits", "misses", "builds", "evictions", "evict_skipped_in_use", "corrupt",
             "build_seconds", "validate_seconds", "digest_hits", "digest_misses"), 0)
        try:
            for d in (self.root, self.entries_dir, self.locks_dir, self.tmp_dir):
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.index = ArtifactIndex(self.root / "index.sqlite")
        except (OSError, sqlite3.Error) as exc:
            raise self.unusable(exc) from exc

    def unusable(self, exc: BaseException) -> ArtifactStoreError:
        return ArtifactStoreError(f"artifact cache at {self.root} is not usable: {exc}")

    def close(self) -> None:
        self.index.close()

    def use_lock(self, key: str) -> FileLock:
        return FileLock(self.locks_dir / f"{key}.use")

    def build_lock(self, key: str) -> FileLock:
        return FileLock(self.locks_dir / f"{key}.build")

    # ---- counters ---------------------------------------------------------------------------

    def count(self, name: str, n: float = 1, *, lifetime: bool = True) -> None:
        with self._stats_lock:
            self._counters[name] += n
        if lifetime:
            try:
                self.index.bump(name, int(n))
            except sqlite3.Error as exc:
                log.warning("artifact index: could not update counter %s: %s", name, exc)

    def note_eviction(self, key: str, label: str) -> None:
        """Remember the last LRU eviction in the index, so every process sharing the cache
        (a server beside ``kvcellar models prune``) reports the same one."""
        try:
            self.index.set_last_eviction(key, label, time.time())
        except sqlite3.Error as exc:
            log.warning("artifact index: could not record the eviction of %s: %s", key, exc)

    def stats(self) -> dict[str, float]:
        """``artifact_*`` figures for /health and /metrics: this process's counters, the
        cache's lifetime counters (``artifact_lifetime_*``, all processes, persisted in the
        index; hits and misses give the hit rate) and the gauges ``artifact_entries``,
        ``artifact_bytes_used``, ``artifact_bytes_limit`` and ``artifact_last_eviction_time``
        (unix seconds of the last LRU eviction by any process, 0 when none)."""
        with self._stats_lock:
            out: dict[str, float] = {f"artifact_{k}": v for k, v in self._counters.items()}
        try:
            rows = self.index.entries()
            lifetime = self.index.counters()
            last = self.index.last_eviction()
        except sqlite3.Error as exc:
            log.warning("artifact index unreadable for stats: %s", exc)
            rows, lifetime, last = [], {}, None
        for name in ("hits", "misses", "builds", "evictions", "corrupt"):
            out[f"artifact_lifetime_{name}"] = float(lifetime.get(name, 0))
        out["artifact_entries"] = float(len(rows))
        out["artifact_bytes_used"] = float(sum(r.size_bytes for r in rows))
        out["artifact_bytes_limit"] = float(self.max_bytes)
        out["artifact_last_eviction_time"] = float(last["time"]) if last else 0.0
        return out

    def health(self) -> dict[str, object]:
        """What /health shows beside the counters: the lifetime hit rate (None before any
        lookup) and the last LRU eviction (``{"key", "label", "time"}``, None when none)."""
        try:
            lifetime = self.index.counters()
            last = self.index.last_eviction()
        except sqlite3.Error as exc:
            log.warning("artifact index unreadable for health: %s", exc)
            lifetime, last = {}, None
        hits, misses = lifetime.get("hits", 0), lifetime.get("misses", 0)
        return {"hit_rate": round(hits / (hits + misses), 4) if hits + misses else None, "last_eviction": last}

    # ---- one entry ----------------------------------------------------------------------------

    @staticmethod
    def read_structure(key: str, entry: Path) -> Manifest:
        """The manifest, if it is this key's and every file has its size. Entries of another
        format version (another kvcellar sharing the dir) are kept: their key differs from any
        this version asks for, and LRU eviction removes them once unused."""
        manifest = Manifest.read(entry)
        if manifest.key != key:
            raise CorruptEntryError(f"{key}: manifest is for {manifest.key}")
        check_structure(entry, manifest)
        return manifest

    def register(self, key: str, entry: Path, manifest: Manifest) -> None:
        size = sum(p.stat().st_size for p in entry.iterdir())
        self.index.insert(key, manifest.descriptor, size, manifest.created)

    def move_to_trash(self, entry: Path) -> Path | None:
        trash = self.tmp_dir / f"trash-{entry.name}-{secrets.token_hex(4)}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return None
        return trash

    @staticmethod
    def remove_trash(trash: Path | None) -> None:
        if trash is None:
            return
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)

    def discard(self, key: str, entry: Path) -> None:
        """Remove a damaged entry. Caller holds the key's build lock. Processes that still map
        its files keep them (POSIX unlink semantics); nobody new can open it."""
        trash = self.move_to_trash(entry)
        self.index.delete(key)
        self.remove_trash(trash)

    def drop_if_same(self, key: str, created: float | None, reason: str) -> None:
        """Drop the entry if it is still the one that failed (same manifest ``created``, or
        an unreadable manifest), not one another process has rebuilt meanwhile."""
        entry = self.entries_dir / key
        if not entry.is_dir():
            return
        with self.build_lock(key) as lock:
            lock.acquire(exclusive=True)
            try:
                current: float | None = Manifest.read(entry).created
            except CorruptEntryError:
                current = None
            if current is None or current == created:
                log.warning("artifact %s dropped: %s", key, reason)
                self.count("corrupt")
                self.discard(key, entry)
