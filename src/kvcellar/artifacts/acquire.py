"""Acquiring an entry: validate what is there, else build it once, and lease it.

``acquire_entry`` is ``ArtifactCache.acquire`` (store.py, which documents the verb). Lock order
(locks.py): the key's use lock (shared) for the whole call, then its build lock
(exclusive) around a rebuild, so concurrent callers build once and the others find the
entry. Validation only reports damage; it is removed under the build lock.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from kvcellar.artifacts.descriptor import ARTIFACT_FORMAT_VERSION, ArtifactDescriptor, ArtifactLease, Builder
from kvcellar.artifacts.directory import ArtifactStoreError, CacheDirectory
from kvcellar.artifacts.housekeeping import evict_to_fit
from kvcellar.artifacts.locks import FileLock
from kvcellar.artifacts.manifest import (
    MANIFEST_NAME,
    CorruptEntryError,
    Manifest,
    check_full,
    check_samples,
    describe_files,
    stat_signature,
)
from kvcellar.paths import full_fsync

log = logging.getLogger("kvcellar.artifacts.store")


def acquire_entry(d: CacheDirectory, descriptor: ArtifactDescriptor, build: Builder,
                  progress: bool | None = None) -> ArtifactLease:
    key = descriptor.key
    entry = d.entries_dir / key
    seconds: dict[str, float] = {}
    use = d.use_lock(key)
    try:
        t0 = time.perf_counter()
        use.acquire(exclusive=False)
        seconds["lock"] = time.perf_counter() - t0
        try:
            manifest, _ = _validate(d, key, entry, seconds)
            if manifest is not None:
                return _lease(d, descriptor, entry, manifest, use, seconds, built=False)
            build_lock = d.build_lock(key)
            t0 = time.perf_counter()
            if not build_lock.acquire(exclusive=True, blocking=False):
                log.info("another process is preparing %s; waiting for it", descriptor.label)
                build_lock.acquire(exclusive=True)
            seconds["build_wait"] = time.perf_counter() - t0
            with build_lock:
                manifest, corrupt = _validate(d, key, entry, seconds)  # built meanwhile?
                if manifest is not None:
                    return _lease(d, descriptor, entry, manifest, use, seconds, built=False)
                if corrupt is not None:
                    log.warning("artifact entry is corrupt and will be rebuilt: %s", corrupt)
                    d.count("corrupt")
                    d.discard(key, entry)
                d.count("misses")
                manifest = _build(d, descriptor, entry, build, progress, seconds)
            lease = _lease(d, descriptor, entry, manifest, use, seconds, built=True)
            try:
                evict_to_fit(d, protect={key})
            except (OSError, sqlite3.Error) as exc:  # the new entry is fine; only the limit isn't kept
                log.warning("artifact cache eviction failed: %s", exc)
            return lease
        except BaseException:
            use.release()
            raise
    except (OSError, sqlite3.Error) as exc:
        raise ArtifactStoreError(f"artifact cache at {d.root} failed: {exc}") from exc


def _lease(d: CacheDirectory, descriptor: ArtifactDescriptor, entry: Path, manifest: Manifest, use: FileLock,
           seconds: dict[str, float], *, built: bool) -> ArtifactLease:
    key = descriptor.key
    if not built:
        d.count("hits")
    d.index.touch(key)
    return ArtifactLease(key, entry, descriptor, manifest, hit=not built, built=built, seconds=seconds,
                         _lock=use, _store=d)


def _validate(d: CacheDirectory, key: str, entry: Path,
              seconds: dict[str, float]) -> tuple[Manifest | None, str | None]:
    """(manifest, None) when valid; (None, None) when absent; (None, why) when corrupt.

    Caller holds the key's use lock (shared). Damage is only reported here; it is removed
    under the build lock (``CacheDirectory.discard``), so one process replaces it, once.
    """
    t0 = time.perf_counter()
    try:
        if not entry.is_dir():
            if d.index.get(key) is not None:
                d.index.delete(key)
            return None, None
        manifest = d.read_structure(key, entry)
        if manifest.format != ARTIFACT_FORMAT_VERSION:  # the key covers the format: tampered
            raise CorruptEntryError(f"{key}: format {manifest.format}, expected {ARTIFACT_FORMAT_VERSION}")
        check_samples(entry, manifest)
        row = d.index.get(key)
        if row is None:
            d.register(key, entry, manifest)
            row = d.index.get(key)
        recorded = (row.verified if row else None) or {}
        sigs = {n: stat_signature(entry / n) for n in manifest.files}
        if d.verify == "full":
            changed = list(manifest.files)
        else:
            changed = [n for n in manifest.files if recorded.get(n) != sigs[n]]
        if changed:
            log.info("artifact %s: full check of %d file(s) changed since their last check", key, len(changed))
            check_full(entry, manifest, changed)
            d.index.set_verified(key, sigs)
        return manifest, None
    except CorruptEntryError as exc:
        return None, str(exc)
    finally:
        dt = time.perf_counter() - t0
        seconds["validate"] = seconds.get("validate", 0.0) + dt
        d.count("validate_seconds", dt, lifetime=False)


def _build(d: CacheDirectory, descriptor: ArtifactDescriptor, entry: Path, build: Builder, progress: bool | None,
           seconds: dict[str, float]) -> Manifest:
    """Caller holds the build lock and the use lock (shared) of the key."""
    key = descriptor.key
    tmp = d.tmp_dir / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    t_all = time.perf_counter()
    try:
        t0 = time.perf_counter()
        info = dict(build(tmp) or {})
        seconds["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        files = _describe(tmp, progress)
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
        _fsync_path(d.entries_dir, directory=True)
        seconds["commit"] = time.perf_counter() - t0
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    d.register(key, entry, manifest)
    d.index.set_verified(key, {n: stat_signature(entry / n) for n in manifest.files})
    d.count("builds")
    d.count("build_seconds", time.perf_counter() - t_all, lifetime=False)
    log.info("artifact %s built in %.1f s (%d bytes)", descriptor.label, time.perf_counter() - t_all,
             manifest.total_bytes)
    return manifest


def _describe(tmp: Path, progress: bool | None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    total = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
    with tqdm(total=total, unit="B", unit_scale=True, desc="Checksumming prepared files",
              disable=not _progress_enabled(progress), leave=False) as bar:
        return describe_files(tmp, bar.update)


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def _progress_enabled(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress
