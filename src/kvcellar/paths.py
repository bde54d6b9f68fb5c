"""Where kvcellar keeps its files: one cache root, with KV blocks under ``kv/`` (the SSD
tier) and prepared models under ``models/`` (the artifact cache)."""

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
