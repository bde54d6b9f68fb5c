"""What an artifact-cache entry is, what builds one, and what holds one while it is served.

``ArtifactDescriptor``: the identity of a prepared model; its identity fields make the
entry's key. ``Builder``: writes an entry's files into the directory it is given (see
``ArtifactCache.acquire``). ``ArtifactLease``: a validated entry, held (shared use lock,
locks.py) until released, so no process evicts it meanwhile.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcellar.artifacts.directory import CacheDirectory
from kvcellar.artifacts.locks import FileLock
from kvcellar.artifacts.manifest import Manifest

# Bump when what an entry holds, or how it is laid out, changes: older entries become misses.
ARTIFACT_FORMAT_VERSION = 1

Builder = Callable[[Path], dict[str, Any] | None]


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
    _store: CacheDirectory | None = field(default=None, repr=False)

    @property
    def held(self) -> bool:
        return self._lock is not None and self._lock.held

    @property
    def cache(self) -> CacheDirectory | None:
        """The cache this entry came from (for ``stats()`` in /health and /metrics)."""
        return self._store

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def invalidate(self, reason: str) -> None:
        """The entry failed to load although it validated: drop it (so the next acquire
        rebuilds it) and release the lease."""
        if self._store is not None:
            self._store.drop_if_same(self.key, self.manifest.created, reason)
        self.release()

    def __enter__(self) -> ArtifactLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
