"""The model artifact cache: content-addressed, validated, size-bounded prepared models.

Layout of ``<cache_dir>/models/`` (KV blocks live beside it in ``<cache_dir>/kv``)::

    entries/<key>/     one prepared model: safetensors + config + tokenizer files + manifest.json
    locks/<key>.use    flock: shared while an entry is validated or served (see locks.py)
    locks/<key>.build  flock: exclusive while an entry is built
    tmp/               build dirs (<key>.<pid>.<rand>) and entries on their way out (trash-*)
    index.sqlite       bookkeeping and counters (see index.py); rebuildable from the manifests

``<key>`` is a hash of the descriptor's identity fields (source content identity, target
dtype and quantization, modality, converter, format version); the readable descriptor is
kept in the manifest and the index. Only prepared artifacts live here: HF-format
directories and hub snapshots load from where they are.

Invariants:

* An entry appears atomically: built in ``tmp/``, files and dirs fsynced, renamed into
  ``entries/``. An entry dir without a readable manifest is damaged, never half-built.
* Every change of ``entries/<key>`` (create, replace a corrupt one, drop a failed one)
  happens under the key's build lock; eviction and removal happen under its exclusive use
  lock, which no one can hold while the entry is used. Hence no entry in use is evicted, and
  a corrupt entry seen by one process is replaced once, not by every process that sees it.
* An entry is served only after validation (``verify`` level, see config.py and
  manifest.py); a corrupt one is counted, moved out and rebuilt, never loaded.

Who calls what: ``acquire`` from the process that loads a model (any thread, one call at a
time per key); ``stats``/``entries`` from any thread; ``prune``/``clear``/``verify`` from
the CLI or an operator thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcellar.artifacts.config import ArtifactConfig
from kvcellar.artifacts.index import ArtifactIndex, EntryRow
from kvcellar.artifacts.locks import FileLock
from kvcellar.artifacts.manifest import (
    MANIFEST_NAME,
    CorruptEntryError,
    Manifest,
    check_full,
    check_samples,
    check_structure,
    describe_files,
    full_digest,
    stat_signature,
)
from kvcellar.errors import KvcellarError
from kvcellar.paths import resolve_cache_dir

log = logging.getLogger(__name__)

# Bump when what an entry holds, or how it is laid out, changes: older entries become misses.
ARTIFACT_FORMAT_VERSION = 1
EVICT_TO_FRACTION = 0.8
MODELS_SUBDIR = "models"

Builder = Callable[[Path], dict[str, Any] | None]


class ArtifactStoreError(KvcellarError):
    """The cache directory can't be used (permissions, disk full, I/O error). Callers may fall
    back to preparing the model in memory without caching it."""


@dataclass(frozen=True)
class ArtifactDescriptor:
    """What a prepared entry is. The identity fields make the key; the rest is for people."""

    source: str  # content identity of the source: "gguf-sha256:<hex>", "hub:<id>@<commit>"
    dtype: str  # dtype of the stored weights ("bfloat16", "float32", ...)
    quantization: str = "none"  # target quantization; "none" = dense weights in ``dtype``
    modality: str = "text"
    converter: str = ""  # what turns the source into the entry, e.g. "transformers==5.23.0"
    format: int = ARTIFACT_FORMAT_VERSION
    name: str = ""  # informational: the model name clients use
    source_path: str = ""  # informational: where the source was found

    IDENTITY = ("source", "dtype", "quantization", "modality", "converter", "format")

    @property
    def key(self) -> str:
        identity = {k: getattr(self, k) for k in self.IDENTITY}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def label(self) -> str:
        """``name:source:dtype:quantization:modality@key8``, as shown by ``models list``."""
        src = self.source if len(self.source) <= 40 else self.source[:40] + "…"
        return f"{self.name or '?'}:{src}:{self.dtype}:{self.quantization}:{self.modality}@{self.key[:8]}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArtifactDescriptor:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class ArtifactLease:
    """A validated entry, held (shared use lock) until ``release``: it won't be evicted."""

    key: str
    path: Path
    descriptor: ArtifactDescriptor
    manifest: Manifest
    hit: bool  # found valid, nothing built by this process
    built: bool  # built by this process
    seconds: dict[str, float] = field(default_factory=dict)
    _lock: FileLock | None = field(default=None, repr=False)
    _store: ArtifactCache | None = field(default=None, repr=False)

    @property
    def held(self) -> bool:
        return self._lock is not None and self._lock.held

    @property
    def cache(self) -> ArtifactCache | None:
        """The cache this entry came from (for ``stats()`` in /health and /metrics)."""
        return self._store

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def invalidate(self, reason: str) -> None:
        """The entry failed to load although it validated: drop it (so the next acquire
        rebuilds it) and release the lease."""
        if self._store is not None:
            self._store._drop_if_same(self.key, self.manifest.created, reason)
        self.release()

    def __enter__(self) -> ArtifactLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _progress_enabled(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


class ArtifactCache:
    """The artifact cache rooted at ``<cache_dir>/models``. See the module docstring."""

    # Levels among the ``stats()`` keys (exported as gauges); the others are counts.
    GAUGES = frozenset({"artifact_entries", "artifact_bytes_used", "artifact_bytes_limit"})

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
            self.scan()
        except (OSError, sqlite3.Error) as exc:
            raise ArtifactStoreError(f"artifact cache at {self.root} is not usable: {exc}") from exc

    @classmethod
    def open(cls, cache_dir: str | os.PathLike[str] | None = None,
             config: ArtifactConfig | None = None) -> ArtifactCache:
        """The cache under ``resolve_cache_dir(cache_dir) / "models"``."""
        cfg = config or ArtifactConfig()
        return cls(resolve_cache_dir(cache_dir) / MODELS_SUBDIR, max_bytes=cfg.max_bytes, verify=cfg.verify)

    def close(self) -> None:
        self.index.close()

    # ---- counters ---------------------------------------------------------------------------

    def _count(self, name: str, n: float = 1, *, lifetime: bool = True) -> None:
        with self._stats_lock:
            self._counters[name] += n
        if lifetime:
            try:
                self.index.bump(name, int(n))
            except sqlite3.Error as exc:
                log.warning("artifact index: could not update counter %s: %s", name, exc)

    def stats(self) -> dict[str, float]:
        """``artifact_*`` figures for /health and /metrics: this process's counters, the
        cache's lifetime counters (``artifact_lifetime_*``, all processes, persisted in the
        index) and the gauges ``artifact_entries``, ``artifact_bytes_used``, ``artifact_bytes_limit``."""
        with self._stats_lock:
            out: dict[str, float] = {f"artifact_{k}": v for k, v in self._counters.items()}
        try:
            rows = self.index.entries()
            lifetime = self.index.counters()
        except sqlite3.Error as exc:
            log.warning("artifact index unreadable for stats: %s", exc)
            rows, lifetime = [], {}
        for name in ("hits", "misses", "builds", "evictions", "corrupt"):
            out[f"artifact_lifetime_{name}"] = float(lifetime.get(name, 0))
        out["artifact_entries"] = float(len(rows))
        out["artifact_bytes_used"] = float(sum(r.size_bytes for r in rows))
        out["artifact_bytes_limit"] = float(self.max_bytes)
        return out

    # ---- source digests -----------------------------------------------------------------------

    def file_digest(self, path: Path) -> str:
        """sha256 of ``path``, memoized in the index while its size/mtime/ctime/inode stay the same."""
        p = Path(path).resolve()
        sig = stat_signature(p)
        try:
            cached = self.index.digest_get(str(p), sig)
        except sqlite3.Error:
            cached = None
        if cached is not None:
            self._count("digest_hits", lifetime=False)
            return cached
        self._count("digest_misses", lifetime=False)
        digest = full_digest(p)
        if stat_signature(p) == sig:  # unchanged while we read it
            with contextlib.suppress(sqlite3.Error):
                self.index.digest_put(str(p), sig, digest)
        return digest

    # ---- the main verb ------------------------------------------------------------------------

    def acquire(self, descriptor: ArtifactDescriptor, build: Builder, *, progress: bool | None = None) -> ArtifactLease:
        """A validated entry for ``descriptor``, built with ``build(dir)`` if missing or corrupt.

        ``build`` writes the entry's files (flat) into the directory it is given and may return
        a dict kept as ``manifest.info``. Concurrent callers for one key build it once: the
        others wait on the build lock and then find it. The returned lease holds the entry
        (shared use lock) until released. Raises ``ArtifactStoreError`` when the cache dir
        fails (the caller may load without caching); errors of ``build`` itself propagate.
        """
        key = descriptor.key
        entry = self.entries_dir / key
        seconds: dict[str, float] = {}
        use = FileLock(self.locks_dir / f"{key}.use")
        try:
            t0 = time.perf_counter()
            use.acquire(exclusive=False)
            seconds["lock"] = time.perf_counter() - t0
            try:
                manifest, _ = self._validate(key, entry, seconds)
                if manifest is not None:
                    return self._lease(descriptor, entry, manifest, use, seconds, built=False)
                build_lock = FileLock(self.locks_dir / f"{key}.build")
                t0 = time.perf_counter()
                if not build_lock.acquire(exclusive=True, blocking=False):
                    log.info("another process is preparing %s; waiting for it", descriptor.label)
                    build_lock.acquire(exclusive=True)
                seconds["build_wait"] = time.perf_counter() - t0
                with build_lock:
                    manifest, corrupt = self._validate(key, entry, seconds)  # built meanwhile?
                    if manifest is not None:
                        return self._lease(descriptor, entry, manifest, use, seconds, built=False)
                    if corrupt is not None:
                        log.warning("artifact entry is corrupt and will be rebuilt: %s", corrupt)
                        self._count("corrupt")
                        self._discard(key, entry)
                    self._count("misses")
                    manifest = self._build(descriptor, entry, build, progress, seconds)
                lease = self._lease(descriptor, entry, manifest, use, seconds, built=True)
                try:
                    self.evict_to_fit(protect={key})
                except (OSError, sqlite3.Error) as exc:  # the new entry is fine; only the limit isn't kept
                    log.warning("artifact cache eviction failed: %s", exc)
                return lease
            except BaseException:
                use.release()
                raise
        except (OSError, sqlite3.Error) as exc:
            raise ArtifactStoreError(f"artifact cache at {self.root} failed: {exc}") from exc

    def _lease(self, descriptor: ArtifactDescriptor, entry: Path, manifest: Manifest, use: FileLock,
               seconds: dict[str, float], *, built: bool) -> ArtifactLease:
        key = descriptor.key
        if not built:
            self._count("hits")
        self.index.touch(key)
        return ArtifactLease(key, entry, descriptor, manifest, hit=not built, built=built, seconds=seconds,
                             _lock=use, _store=self)

    def _validate(self, key: str, entry: Path, seconds: dict[str, float]) -> tuple[Manifest | None, str | None]:
        """(manifest, None) when valid; (None, None) when absent; (None, why) when corrupt.

        Caller holds the key's use lock (shared). Damage is only reported here; it is removed
        under the build lock (``_discard``), so one process replaces it, once.
        """
        t0 = time.perf_counter()
        try:
            if not entry.is_dir():
                if self.index.get(key) is not None:
                    self.index.delete(key)
                return None, None
            manifest = self._read_structure(key, entry)
            if manifest.format != ARTIFACT_FORMAT_VERSION:  # the key covers the format: tampered
                raise CorruptEntryError(f"{key}: format {manifest.format}, expected {ARTIFACT_FORMAT_VERSION}")
            check_samples(entry, manifest)
            row = self.index.get(key)
            if row is None:
                self._register(key, entry, manifest)
                row = self.index.get(key)
            recorded = (row.verified if row else None) or {}
            sigs = {n: stat_signature(entry / n) for n in manifest.files}
            if self.verify == "full":
                changed = list(manifest.files)
            else:
                changed = [n for n in manifest.files if recorded.get(n) != sigs[n]]
            if changed:
                log.info("artifact %s: full check of %d file(s) changed since their last check", key, len(changed))
                check_full(entry, manifest, changed)
                self.index.set_verified(key, sigs)
            return manifest, None
        except CorruptEntryError as exc:
            return None, str(exc)
        finally:
            dt = time.perf_counter() - t0
            seconds["validate"] = seconds.get("validate", 0.0) + dt
            self._count("validate_seconds", dt, lifetime=False)

    def _build(self, descriptor: ArtifactDescriptor, entry: Path, build: Builder, progress: bool | None,
               seconds: dict[str, float]) -> Manifest:
        """Caller holds the build lock and the use lock (shared) of the key."""
        key = descriptor.key
        tmp = self.tmp_dir / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o700)
        t_all = time.perf_counter()
        try:
            t0 = time.perf_counter()
            info = dict(build(tmp) or {})
            seconds["build"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            files = self._describe(tmp, progress)
            seconds["checksum"] = time.perf_counter() - t0
            info.setdefault("build_seconds", round(time.perf_counter() - t_all, 3))
            manifest = Manifest(ARTIFACT_FORMAT_VERSION, key, descriptor.to_dict(), time.time(), files, info)
            (tmp / MANIFEST_NAME).write_text(manifest.to_json())
            t0 = time.perf_counter()
            for p in tmp.iterdir():
                os.chmod(p, 0o600)
                _fsync_path(p)
            _fsync_path(tmp, directory=True)
            os.rename(tmp, entry)
            _fsync_path(self.entries_dir, directory=True)
            seconds["commit"] = time.perf_counter() - t0
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._register(key, entry, manifest)
        self.index.set_verified(key, {n: stat_signature(entry / n) for n in manifest.files})
        self._count("builds")
        self._count("build_seconds", time.perf_counter() - t_all, lifetime=False)
        log.info("artifact %s built in %.1f s (%d bytes)", descriptor.label, time.perf_counter() - t_all,
                 manifest.total_bytes)
        return manifest

    @staticmethod
    def _describe(tmp: Path, progress: bool | None) -> dict[str, Any]:
        from tqdm.auto import tqdm

        total = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
        with tqdm(total=total, unit="B", unit_scale=True, desc="Checksumming prepared files",
                  disable=not _progress_enabled(progress), leave=False) as bar:
            return describe_files(tmp, bar.update)

    def _register(self, key: str, entry: Path, manifest: Manifest) -> None:
        size = sum(p.stat().st_size for p in entry.iterdir())
        self.index.insert(key, manifest.descriptor, size, manifest.created)

    # ---- removal ------------------------------------------------------------------------------

    def _move_to_trash(self, entry: Path) -> Path | None:
        trash = self.tmp_dir / f"trash-{entry.name}-{secrets.token_hex(4)}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return None
        return trash

    def _discard(self, key: str, entry: Path) -> None:
        """Remove a damaged entry. Caller holds the key's build lock. Processes that still map
        its files keep them (POSIX unlink semantics); nobody new can open it."""
        trash = self._move_to_trash(entry)
        self.index.delete(key)
        self._remove_trash(trash)

    @staticmethod
    def _remove_trash(trash: Path | None) -> None:
        if trash is None:
            return
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)

    def _drop_if_same(self, key: str, created: float | None, reason: str) -> None:
        """Drop the entry if it is still the one that failed (same manifest ``created``, or
        an unreadable manifest), not one another process has rebuilt meanwhile."""
        entry = self.entries_dir / key
        if not entry.is_dir():
            return
        with FileLock(self.locks_dir / f"{key}.build") as lock:
            lock.acquire(exclusive=True)
            try:
                current: float | None = Manifest.read(entry).created
            except CorruptEntryError:
                current = None
            if current is None or current == created:
                log.warning("artifact %s dropped: %s", key, reason)
                self._count("corrupt")
                self._discard(key, entry)

    def _remove_if_unused(self, key: str) -> bool:
        """Remove an entry unless some process holds it. True if it is gone."""
        use = FileLock(self.locks_dir / f"{key}.use")
        if not use.acquire(exclusive=True, blocking=False):
            return False
        try:
            trash = self._move_to_trash(self.entries_dir / key)
            self.index.delete(key)
        finally:
            use.release()
        self._remove_trash(trash)
        return True

    def evict_to_fit(self, protect: set[str] | frozenset[str] = frozenset(), max_bytes: int | None = None) -> list[str]:
        """Past the limit, evict least recently used entries no process holds, down to 80 % of it."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        rows = self.index.entries()
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
            if self._remove_if_unused(row.key):
                total -= row.size_bytes
                evicted.append(row.key)
                self._count("evictions")
                log.info("artifact %s evicted (LRU, %d bytes)", self._label(row), row.size_bytes)
            else:
                self._count("evict_skipped_in_use", lifetime=False)
        if total > limit:
            log.warning("artifact cache holds %d bytes, over its %d-byte limit; the rest is in use", total, limit)
        return evicted

    @staticmethod
    def _label(row: EntryRow) -> str:
        try:
            return ArtifactDescriptor.from_dict(row.descriptor).label
        except TypeError:
            return row.key

    # ---- start-up scan, maintenance ----------------------------------------------------------

    def scan(self) -> dict[str, int]:
        """Reconcile the index with the disk: drop leftovers of dead builds and trash, remove
        damaged entries (no manifest, missing or resized files), register entries the index
        lacks, forget rows whose entry is gone. Cheap: a stat per file, no hashing."""
        report = {"tmp_removed": 0, "damaged_removed": 0, "registered": 0, "rows_dropped": 0}
        for p in self.tmp_dir.iterdir():
            if p.name.startswith("trash-"):
                self._remove_trash(p)
                report["tmp_removed"] += 1
                continue
            key = p.name.split(".", 1)[0]
            lock = FileLock(self.locks_dir / f"{key}.build")
            if lock.acquire(exclusive=True, blocking=False):  # no live builder owns it
                try:
                    self._remove_trash(p)
                    report["tmp_removed"] += 1
                finally:
                    lock.release()
        on_disk = set()
        for entry in self.entries_dir.iterdir():
            key = entry.name
            on_disk.add(key)
            try:
                manifest = self._read_structure(key, entry)
                if self.index.get(key) is None:
                    self._register(key, entry, manifest)
                    report["registered"] += 1
            except CorruptEntryError as exc:
                if self._discard_damaged(key, entry, str(exc)):
                    report["damaged_removed"] += 1
                    on_disk.discard(key)
            except FileNotFoundError:  # removed by another process meanwhile
                on_disk.discard(key)
        for row in self.index.entries():
            if row.key not in on_disk and not (self.entries_dir / row.key).is_dir():
                self.index.delete(row.key)
                report["rows_dropped"] += 1
        if any(report.values()):
            log.info("artifact cache scan of %s: %s", self.root, report)
        return report

    @staticmethod
    def _read_structure(key: str, entry: Path) -> Manifest:
        """The manifest, if it is this key's and every file has its size. Entries of another
        format version (another kvcellar sharing the dir) are kept: their key differs from any
        this version asks for, and LRU eviction removes them once unused."""
        manifest = Manifest.read(entry)
        if manifest.key != key:
            raise CorruptEntryError(f"{key}: manifest is for {manifest.key}")
        check_structure(entry, manifest)
        return manifest

    def _discard_damaged(self, key: str, entry: Path, reason: str) -> bool:
        lock = FileLock(self.locks_dir / f"{key}.build")
        if not lock.acquire(exclusive=True, blocking=False):
            return False  # someone is rebuilding it right now
        try:
            try:
                self._read_structure(key, entry)
                return False  # replaced by a good one meanwhile
            except CorruptEntryError:
                pass
            log.warning("artifact entry removed at start-up: %s", reason)
            self._count("corrupt")
            self._discard(key, entry)
            return True
        finally:
            lock.release()

    def entries(self) -> list[EntryInfo]:
        """Every entry, least recently used first, with whether a process holds it now."""
        out = []
        for row in self.index.entries():
            probe = FileLock(self.locks_dir / f"{row.key}.use")
            free = probe.acquire(exclusive=True, blocking=False)
            probe.release()
            out.append(EntryInfo(row.key, self.entries_dir / row.key, row.descriptor, row.size_bytes, row.created,
                                 row.last_access, row.access_count, in_use=not free))
        return out

    def prune(self, *, max_bytes: int | None = None, older_than_s: float | None = None) -> dict[str, Any]:
        """Scan, drop entries unused for ``older_than_s``, then enforce the size limit."""
        report: dict[str, Any] = dict(self.scan())
        removed, in_use = [], []
        if older_than_s is not None:
            cutoff = time.time() - older_than_s
            for row in self.index.entries():
                if row.last_access < cutoff:
                    (removed if self._remove_if_unused(row.key) else in_use).append(row.key)
        evicted = self.evict_to_fit(max_bytes=max_bytes)
        for path in self.index.digest_paths():
            if not Path(path).exists():
                self.index.digest_delete(path)
        report.update(expired=removed, evicted=evicted, skipped_in_use=in_use)
        return report

    def clear(self) -> dict[str, list[str]]:
        """Remove every entry no process holds."""
        self.scan()
        removed, in_use = [], []
        for row in self.index.entries():
            (removed if self._remove_if_unused(row.key) else in_use).append(row.key)
        for path in self.index.digest_paths():
            self.index.digest_delete(path)
        return {"removed": removed, "skipped_in_use": in_use}

    def verify_all(self) -> dict[str, list[str]]:
        """Full sha256 of every entry; corrupt ones are removed (rebuilt on next use)."""
        ok, corrupt = [], []
        for row in self.index.entries():
            entry = self.entries_dir / row.key
            with self._held(row.key) as present:
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
                    self._drop_if_same(row.key, created, str(exc))
                    continue
                self.index.set_verified(row.key, {n: stat_signature(entry / n) for n in manifest.files})
                ok.append(row.key)
        return {"ok": ok, "corrupt": corrupt}

    @contextlib.contextmanager
    def _held(self, key: str) -> Iterator[bool]:
        lock = FileLock(self.locks_dir / f"{key}.use")
        lock.acquire(exclusive=False)
        try:
            yield (self.entries_dir / key).is_dir()
        finally:
            lock.release()
