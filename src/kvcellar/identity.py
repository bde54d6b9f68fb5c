"""What a model is, as hashes: the content of its weights and the definition of its
tokenizer with its chat template.

The artifact cache keys prepared entries by the weights identity, the loader stamps both
on ``LoadedModel``, and the KV namespace fingerprint (``cache/namespace.py``) is built from
them: equal identities, shared KV blocks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcellar.model_source import ModelSource


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_identity(source: ModelSource, digest: Callable[[Path], str] = file_sha256) -> str:
    """A stable id of the weights: content hash of a GGUF file or of a directory's weight
    files; the commit hash for hub snapshots (content-addressed already). ``digest`` may be
    a memoizing sha256 (``ArtifactCache.file_digest``) so a restart doesn't re-hash GBs."""
    if source.kind == "gguf":
        return "gguf-sha256:" + digest(source.path)
    if source.kind == "hub" and source.revision:
        return f"hub:{source.name}@{source.revision}"
    h = hashlib.sha256()
    weight_files = sorted(
        p for p in source.path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") or p.name.endswith(".json")
    )
    for p in weight_files:
        h.update(p.name.encode() + b"\0" + digest(p).encode() + b"\0")
    return "dir-sha256:" + h.hexdigest()


def tokenizer_identity(tokenizer: Any) -> str:
    """Hash of a transformers tokenizer's full definition, its chat template and special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(b"\0template\0" + (getattr(tokenizer, "chat_template", None) or "").encode())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(b"\0special\0" + json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()
