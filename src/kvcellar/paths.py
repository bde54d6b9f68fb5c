"""Where kvcellar keeps its files: one cache root, with KV blocks under ``kv/`` (the SSD
tier), prepared models under ``models/`` (the artifact cache) and the outputs ``suffix``
drafts from under ``spec/``."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/kvcellar")


def resolve_cache_dir(arg: str | os.PathLike[str] | None = None) -> Path:
    """``--cache-dir``, else ``KVCELLAR_CACHE_DIR``, else ``~/.cache/kvcellar``."""
    raw = arg or os.environ.get("KVCELLAR_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(raw).expanduser().resolve()


def draft_outputs_path(cache_dir: Path, namespace: str) -> Path:
    """The file of recent outputs ``--speculative suffix`` keeps for a KV namespace (its token
    ids are that model's)."""
    return cache_dir / "spec" / f"{namespace[:32]}.outputs"


def clear_draft_outputs(cache_dir: Path, namespaces: list[str] | None = None) -> list[Path]:
    """Delete the drafts' outputs files of ``namespaces`` (all when None): what clearing the cache
    must not leave behind of what was generated. Returns those deleted."""
    spec = cache_dir / "spec"
    if namespaces is None:
        paths = sorted(spec.glob("*.outputs")) if spec.is_dir() else []
    else:
        paths = sorted({draft_outputs_path(cache_dir, ns) for ns in namespaces})
    deleted = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        deleted.append(path)
    return deleted


def full_fsync(fd: int) -> None:
    """``fsync``, through to the medium: on macOS ``fsync`` only hands the data to the drive,
    whose cache a power cut empties, and ``F_FULLFSYNC`` is what flushes it (where the
    filesystem does not take it, ``fsync`` is all there is)."""
    full = getattr(fcntl, "F_FULLFSYNC", None) if sys.platform == "darwin" else None
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    os.fsync(fd)
