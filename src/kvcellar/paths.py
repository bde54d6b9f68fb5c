"""Where kvcellar keeps its files: one cache root, with KV blocks under ``kv/`` (the SSD
tier) and prepared models under ``models/`` (the artifact cache)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/kvcellar")


def resolve_cache_dir(arg: str | os.PathLike[str] | None = None) -> Path:
    """``--cache-dir``, else ``KVCELLAR_CACHE_DIR``, else ``~/.cache/kvcellar``."""
    raw = arg or os.environ.get("KVCELLAR_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(raw).expanduser().resolve()
