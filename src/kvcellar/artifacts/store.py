"""ArtifactCache: the model artifact cache, content-addressed, validated,
size-bounded prepared models under ``<cache_dir>/models``.

``<key>`` is a hash of the descriptor's identity fields (source content identity, target
dtype and quantization, modality, converter, format version); the readable descriptor is
kept in the manifest and the index. Only prepared artifacts live here: HF-format
directories and hub snapshots load from where they are.

This file is the facade; the parts behind it:
  directory.py     layout, invariants, index and counters; the steps on one entry
  descriptor.py    what an entry is (descriptor), what builds one, the lease that holds one
  acquire.py       validate, else build once, and lease
  housekeeping.py  start-up scan, LRU eviction, listing, prune/clear/verify
  index.py, manifest.py, locks.py  the sqlite index, manifests and checks, flock locks

Who calls what: ``acquire`` from the process that loads a model (any thread, one call at a
time per key); ``stats``/``entries`` from any thread; ``prune``/``clear``/``verify_all`` from
the CLI or an operator thread.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import kvcellar.artifacts.housekeeping as housekeeping  # the module, not the package: no import cycle
from kvcellar.artifacts.acquire import acquire_entry
from kvcellar.artifacts.config import ArtifactConfig
from kvcellar.artifacts.descriptor import ArtifactDescriptor, ArtifactLease, Builder
from kvcellar.artifacts.directory import CacheDirectory
from kvcellar.artifacts.housekeeping import EntryInfo
from kvcellar.artifacts.manifest import full_digest, stat_signature
from kvcellar.paths import resolve_cache_dir

MODELS_SUBDIR = "models"


class ArtifactCache(CacheDirectory):
    """The artifact cache rooted at ``<cache_dir>/models``. See the module docstring."""

    def __init__(self, root: Path, *, max_bytes: int | None = None, verify: str = "fast") -> None:
        super().__init__(root, max_bytes=max_bytes, verify=verify)
        try:
            self.scan()
        except (OSError, sqlite3.Error) as exc:
            raise self.unusable(exc) from exc

    @classmethod
    def open(cls, cache_dir: str | os.PathLike[str] | None = None,
             config: ArtifactConfig | None = None) -> ArtifactCache:
        """The cache under ``resolve_cache_dir(cache_dir) / "models"``."""
        cfg = config or ArtifactConfig()
        return cls(resolve_cache_dir(cache_dir) / MODELS_SUBDIR, max_bytes=cfg.max_bytes, verify=cfg.verify)

    def acquire(self, descriptor: ArtifactDescriptor, build: Builder, *, progress: bool | None = None) -> ArtifactLease:
        """A validated entry for ``descriptor``, built with ``build(dir)`` if missing or corrupt.

        ``build`` writes the entry's files (flat) into the directory it is given and may return
        a dict kept as ``manifest.info``. Concurrent callers for one key build it once: the
        others wait on the build lock and then find it. The returned lease holds the entry
        (shared use lock) until released. Raises ``ArtifactStoreError`` when the cache dir
        fails (the caller may load without caching); errors of ``build`` itself propagate.
        """
        return acquire_entry(self, descriptor, build, progress)

    def file_digest(self, path: Path) -> str:
        """sha256 of ``path``, memoized in the index while its size/mtime/ctime/inode stay the same."""
        p = Path(path).resolve()
        sig = stat_signature(p)
        try:
            cached = self.index.digest_get(str(p), sig)
        except sqlite3.Error:
            cached = None
        if cached is not None:
            self.count("digest_hits", lifetime=False)
            return cached
        self.count("digest_misses", lifetime=False)
        digest = full_digest(p)
        if stat_signature(p) == sig:  # unchanged while we read it
            with contextlib.suppress(sqlite3.Error):
                self.index.digest_put(str(p), sig, digest)
        return digest

    # ---- housekeeping (housekeeping.py) -------------------------------------------------------

    def scan(self) -> dict[str, int]:
        """Reconcile the index with the disk (run at open); see ``housekeeping.scan``."""
        return housekeeping.scan(self)

    def evict_to_fit(self, protect: set[str] | frozenset[str] = frozenset(), max_bytes: int | None = None) -> list[str]:
        """Past the limit, evict least recently used entries no process holds, down to 80 % of it."""
        return housekeeping.evict_to_fit(self, protect, max_bytes)

    def entries(self) -> list[EntryInfo]:
        """Every entry, least recently used first, with whether a process holds it now."""
        return housekeeping.list_entries(self)

    def prune(self, *, max_bytes: int | None = None, older_than_s: float | None = None) -> dict[str, Any]:
        """Scan, drop entries unused for ``older_than_s``, then enforce the size limit."""
        return housekeeping.prune(self, max_bytes=max_bytes, older_than_s=older_than_s)

    def clear(self) -> dict[str, list[str]]:
        """Remove every entry no process holds."""
        return housekeeping.clear(self)

    def verify_all(self) -> dict[str, list[str]]:
        """Full sha256 of every entry; corrupt ones are removed (rebuilt on next use)."""
        return housekeeping.verify_all(self)
