"""Turning a source into a HF-format directory the loader can mmap: the cache's builders.

Today one source needs preparing: a ``.gguf`` file. transformers parses its metadata with
the pure-Python ``gguf`` reader (three times: config, tokenizer, weights) and dequantizes
every tensor, ~20 s for the embedded 98 MB SmolLM2 on this machine. Done once, the result
is stored as what ``from_pretrained`` loads fastest: ``model.safetensors`` in the serving
dtype, ``config.json`` (GGUF quantization settings removed), ``generation_config.json``,
and the tokenizer saved with ``save_pretrained`` (``tokenizer.json``, its config and the
chat template), which reloads in ~0.2 s.

HF-format directories and hub snapshots are not prepared: they are in that form already
and stay where they are (the HF cache stores hub models; we don't copy them).
``runtime.prepare_and_load`` calls ``prepare_gguf`` and hands the entry to the loader.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvcellar.artifacts.descriptor import ArtifactDescriptor, ArtifactLease, Builder
from kvcellar.artifacts.directory import ArtifactStoreError
from kvcellar.artifacts.store import ArtifactCache
from kvcellar.errors import ModelLoadError
from kvcellar.identity import tokenizer_identity
from kvcellar.model_source import ModelSource

log = logging.getLogger(__name__)

QUANTIZATION_NONE = "none"


def converter_id() -> str:
    """Who converts: a different transformers may dequantize or map names differently."""
    import transformers

    return f"transformers=={transformers.__version__}"


def gguf_descriptor(*, weights_id: str, dtype: torch.dtype, name: str, path: Path) -> ArtifactDescriptor:
    """The descriptor of a GGUF dequantized to ``dtype``; ``weights_id`` is its content hash."""
    return ArtifactDescriptor(
        source=weights_id,
        dtype=str(dtype).removeprefix("torch."),
        quantization=QUANTIZATION_NONE,
        modality="text",
        converter=converter_id(),
        name=name,
        source_path=str(path),
    )


def _strip_gguf_quantization(model: Any) -> None:
    """The weights are dense now; nothing of the GGUF loader may reach the saved config."""
    model.hf_quantizer = None
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config


def gguf_builder(gguf_path: Path, dtype: torch.dtype, *, name: str, progress: bool | None = None) -> Builder:
    """A builder (see ``ArtifactCache.acquire``) writing the dequantized GGUF as HF files."""

    def build(out_dir: Path) -> dict[str, Any]:
        from tqdm.auto import tqdm
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        folder, fname = str(gguf_path.parent), gguf_path.name
        seconds: dict[str, float] = {}
        show = sys.stderr.isatty() if progress is None else progress
        with tqdm(total=3, desc=f"Preparing {name} (GGUF -> {str(dtype).removeprefix('torch.')} safetensors)",
                  unit="step", disable=not show) as bar:
            bar.set_postfix_str("tokenizer")
            t0 = time.perf_counter()
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
            except Exception as exc:
                raise ModelLoadError(f"Could not read the tokenizer of {gguf_path}: {exc}") from exc
            seconds["tokenizer"] = time.perf_counter() - t0
            bar.update()

            bar.set_postfix_str("dequantizing weights")
            t0 = time.perf_counter()
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=fname, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
                )
            except Exception as exc:
                raise ModelLoadError(f"Could not read the weights of {gguf_path}: {exc}") from exc
            seconds["weights"] = time.perf_counter() - t0
            bar.update()

            bar.set_postfix_str("writing safetensors")
            t0 = time.perf_counter()
            _strip_gguf_quantization(model)
            model.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
            seconds["save"] = time.perf_counter() - t0
            bar.update()
        return {
            "source_kind": "gguf",
            # The identity of the tokenizer read straight from the GGUF: loading from the entry
            # must give the same one, or the KV namespace would change with the cache state.
            "source_tokenizer_id": tokenizer_identity(tokenizer),
            "architecture": list(getattr(model.config, "architectures", None) or [type(model).__name__]),
            "num_parameters": int(sum(p.numel() for p in model.parameters())),
            "prepare_seconds": {k: round(v, 3) for k, v in seconds.items()},
        }

    return build


def prepare_gguf(cache: ArtifactCache, source: ModelSource, weights_id: str, dtype: torch.dtype, *,
                 progress: bool | None = None) -> ArtifactLease | None:
    """The cache entry of a GGUF source in ``dtype``, prepared now if needed; None if the
    cache dir fails (the caller then loads the GGUF directly)."""
    desc = gguf_descriptor(weights_id=weights_id, dtype=dtype, name=source.name, path=source.path)
    try:
        return cache.acquire(desc, gguf_builder(source.path, dtype, name=source.name, progress=progress),
                             progress=progress)
    except ArtifactStoreError as exc:
        log.warning("model artifact cache unusable, loading %s without it: %s", source.name, exc)
        return None
