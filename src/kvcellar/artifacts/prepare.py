"""Turning a source into a HF-format directory the loader can mmap: the cache's builders.

Today one source needs preparing: a ``.gguf`` file. Its weights are converted one tensor at
a time (``gguf_convert``: transformers' own name map and tensor processors, the ``gguf``
package's dequantization), so preparing never holds the whole model, and stored as what
``from_pretrained`` loads fastest: safetensors in the serving dtype (``model.safetensors``,
or ``model-0000k-of-0000n`` shards and their index), ``config.json`` (GGUF quantization
settings removed), ``generation_config.json``, and the tokenizer saved with
``save_pretrained`` (``tokenizer.json``, its config and the chat template), which reloads in
~0.2 s. ``--weights int8|int4`` has an entry of its own, the linears quantized
(``quantize_gguf``; a GGUF's 4-bit blocks taken as they are; those kvcellar's kernels keep as
panels packed in this CPU's layout, ``artifacts/panels.py``).

HF-format directories and hub snapshots are not prepared: they are in that form already
and stay where they are (the HF cache stores hub models; we don't copy them).
``runtime.prepare_and_load`` calls ``prepare_gguf`` and hands the entry to the loader.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvcellar.artifacts.descriptor import ArtifactDescriptor, ArtifactLease, Builder
from kvcellar.artifacts.directory import ArtifactStoreError
from kvcellar.artifacts.gguf_convert import (
    SHARD_BYTES,
    GgufFile,
    NotStreamable,
    gguf_config,
    iter_quantized,
    quantize_streamed,
    transformers_reads_gguf,
    write_dense,
    write_quantized,
)
from kvcellar.artifacts.panels import PanelLayout, read_panels
from kvcellar.artifacts.store import ArtifactCache
from kvcellar.errors import ModelLoadError
from kvcellar.identity import tokenizer_identity
from kvcellar.model_source import ModelSource
from kvcellar.quantization import SCHEMES, QuantizedWeight, from_tensors, quantize_linears

log = logging.getLogger(__name__)

QUANTIZATION_NONE = "none"
# An entry of every weight but the linears' (``--weights int8|int4``: those are in the
# quantized entry), so a quantized model never has its dense linears written or read.
QUANTIZATION_LINEARS_APART = "none-linears-apart"
# Names how entries are written (``gguf_convert``): change it when what they hold may change.
STREAM_CONVERTER = "kvcellar-stream-2"
# What quantized entries hold beyond that: "embedding-1", an input embedding stored as int4
# blocks is kept as it is (``gguf_convert.EXACT_EMBEDDING_TYPES``).
QUANTIZED_CONVERTER = "embedding-1"


def converter_id() -> str:
    """Who converts: a different transformers may dequantize or map names differently."""
    import transformers

    return f"transformers=={transformers.__version__}+{STREAM_CONVERTER}"


def gguf_descriptor(*, weights_id: str, dtype: torch.dtype, name: str, path: Path,
                    linears_apart: bool = False) -> ArtifactDescriptor:
    """The descriptor of a GGUF dequantized to ``dtype``; ``weights_id`` is its content hash."""
    return ArtifactDescriptor(
        source=weights_id,
        dtype=str(dtype).removeprefix("torch."),
        quantization=QUANTIZATION_LINEARS_APART if linears_apart else QUANTIZATION_NONE,
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


def _load_gguf(gguf_path: Path, dtype: torch.dtype) -> Any:
    """The whole model, as transformers loads it: for architectures ``gguf_convert`` leaves to
    transformers' conversion mappings (``NotStreamable``)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    try:
        with transformers_reads_gguf(gguf_path):
            return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype,
                                                        config=gguf_config(gguf_path),
                                                        quantization_config=GgufConfig(dequantize=True))
    except Exception as exc:
        raise ModelLoadError(f"Could not read the weights of {gguf_path}: {exc}") from exc


def gguf_builder(gguf_path: Path, dtype: torch.dtype, *, name: str, progress: bool | None = None,
                 shard_bytes: int = SHARD_BYTES, linears_apart: bool = False) -> Builder:
    """A builder (see ``ArtifactCache.acquire``) writing the dequantized GGUF as HF files,
    converted a tensor at a time (``gguf_convert.write_dense``; shards of ``shard_bytes``).
    ``linears_apart``: leave out the weights only linears use (``GgufFile.linear_weights``);
    the entry's info says whether it did (``linears_apart``): a GGUF converted whole keeps them."""

    def build(out_dir: Path) -> dict[str, Any]:
        from tqdm.auto import tqdm

        seconds: dict[str, float] = {}
        show = sys.stderr.isatty() if progress is None else progress
        t0 = time.perf_counter()
        try:
            tokenizer = gguf_tokenizer(gguf_path)
        except Exception as exc:
            raise ModelLoadError(f"Could not read the tokenizer of {gguf_path}: {exc}") from exc
        seconds["tokenizer"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            desc = f"Preparing {name} (GGUF -> {str(dtype).removeprefix('torch.')} safetensors)"
            with GgufFile(gguf_path, dtype) as source:
                skip = frozenset(source.linear_weights()) if linears_apart else frozenset()
                with tqdm(total=len(source.stored) - len(skip), desc=desc, unit="tensor", disable=not show) as bar:
                    write_dense(source, out_dir, dtype, shard_bytes=shard_bytes, on_tensor=bar.update, skip=skip)
            model = source.model
            _save_configs(model, out_dir)
            apart = bool(skip)
        except NotStreamable as exc:
            log.warning("%s converted whole, not a tensor at a time (more memory): %s", gguf_path.name, exc)
            apart = False
            model = _load_gguf(gguf_path, dtype)
            _strip_gguf_quantization(model)
            model.save_pretrained(out_dir)
        seconds["weights"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        _save_tokenizer(tokenizer, out_dir)
        seconds["save"] = time.perf_counter() - t0
        return {
            "source_kind": "gguf",
            "linears_apart": apart,
            # The identity of the tokenizer read straight from the GGUF: loading from the entry
            # must give the same one, or the KV namespace would change with the cache state.
            "source_tokenizer_id": tokenizer_identity(tokenizer),
            "architecture": list(getattr(model.config, "architectures", None) or [type(model).__name__]),
            "num_parameters": int(sum(p.numel() for p in model.parameters())),
            "prepare_seconds": {k: round(v, 3) for k, v in seconds.items()},
        }

    return build


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer transformers reads from the GGUF at ``path``, kept for the process per
    file version (the last one): reading it parses the whole metadata again (seconds for a
    large vocabulary), and a process that prepares several entries
    of one GGUF (another dtype; a quantized mode's dense part) needs it for each. It is
    saved and hashed, never changed."""
    stat = path.stat()
    return _gguf_tokenizer(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _gguf_tokenizer(path: str, _mtime_ns: int, _size: int) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    with transformers_reads_gguf(p):
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


# Saved as this class, an entry's tokenizer is read back from ``tokenizer.json`` as it is.
GENERIC_TOKENIZER = "TokenizersBackend"


def _save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Save the tokenizer so that it loads back (``load_tokenizer``) as the GGUF's own: a
    model-specific class (e.g. ``Qwen2Tokenizer``) rebuilds its pipeline from the vocabulary
    with a normalizer the one converted from the GGUF lacks, so where that changes it the
    entry records the generic class, which takes the saved ``tokenizer.json`` as it is."""
    import json

    tokenizer.save_pretrained(out_dir)
    want = tokenizer_identity(tokenizer)
    if tokenizer_identity(load_tokenizer(out_dir)) == want:
        return
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = GENERIC_TOKENIZER
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if tokenizer_identity(load_tokenizer(out_dir)) != want:
        log.warning("the tokenizer of this GGUF does not load back as it was saved; KV blocks cached by a run "
                    "without the artifact cache won't be reused")


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer of a prepared entry. ``AutoTokenizer`` would pick the class by the
    model type of ``config.json`` even where the entry records the generic one."""
    import json

    from transformers import AutoTokenizer, TokenizersBackend

    config_file = folder / "tokenizer_config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("tokenizer_class") == GENERIC_TOKENIZER:
        return TokenizersBackend.from_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def _save_configs(model: Any, out_dir: Path) -> None:
    """``config.json`` and ``generation_config.json`` as ``save_pretrained`` writes them."""
    _strip_gguf_quantization(model)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


def prepare_gguf(cache: ArtifactCache, source: ModelSource, weights_id: str, dtype: torch.dtype, *,
                 progress: bool | None = None, linears_apart: bool = False) -> ArtifactLease | None:
    """The cache entry of a GGUF source in ``dtype`` (``linears_apart``: without the
    linears' weights), prepared now if needed; None if the cache dir fails (the caller then
    loads the GGUF directly)."""
    desc = gguf_descriptor(weights_id=weights_id, dtype=dtype, name=source.name, path=source.path,
                           linears_apart=linears_apart)
    build = gguf_builder(source.path, dtype, name=source.name, progress=progress, linears_apart=linears_apart)
    return _acquire(cache, desc, build, progress, f"loading {source.name} without it")


def _acquire(cache: ArtifactCache, desc: ArtifactDescriptor, build: Builder, progress: bool | None,
             fallback: str) -> ArtifactLease | None:
    try:
        return cache.acquire(desc, build, progress=progress)
    except ArtifactStoreError as exc:
        log.warning("model artifact cache unusable, %s: %s", fallback, exc)
        return None


def quantize_gguf(gguf_path: Path, mode: str) -> dict[str, QuantizedWeight]:
    """The quantized linears of a GGUF under ``mode``, by module name, converted a tensor at
    a time (``gguf_convert.quantize_streamed``): int4 linears stored as Q4_0, Q4_1 or Q4_K are
    their own blocks, the others are quantized from their float32 dequantization, whatever
    dtype the model is then served in. Used with and without the artifact cache, so both give
    the same weights."""
    try:
        with GgufFile(gguf_path) as source:
            return quantize_streamed(source, mode)
    except NotStreamable as exc:
        log.warning("%s quantized whole, not a tensor at a time (more memory): %s", gguf_path.name, exc)
        return quantize_linears(_load_gguf(gguf_path, torch.float32), mode)


def quantized_descriptor(*, weights_id: str, mode: str, name: str, path: Path,
                         layout: str | None = None) -> ArtifactDescriptor:
    """The descriptor of a GGUF's quantized linears (scales in float32, any serving dtype), those
    kept as panels in ``layout`` (``artifacts.panels``) where given."""
    scheme = SCHEMES[mode] if layout is None else f"{SCHEMES[mode]}+{layout}"
    return ArtifactDescriptor(source=weights_id, dtype="float32", quantization=scheme, modality="text",
                              converter=f"{converter_id()}+{QUANTIZED_CONVERTER}", name=name, source_path=str(path))


def quantized_gguf_builder(gguf_path: Path, mode: str, *, name: str, progress: bool | None = None,
                           layout: PanelLayout | None = None) -> Builder:
    """A builder writing the GGUF's linears quantized under ``mode`` (``quantize_gguf``) a
    linear at a time as they are converted: as safetensors shards, or packed in ``layout``
    where it keeps them as panels; the rest of the model comes from the dense entry."""

    def build(out_dir: Path) -> dict[str, Any]:
        from tqdm.auto import tqdm

        show = sys.stderr.isatty() if progress is None else progress
        t0 = time.perf_counter()
        desc = f"Preparing {name} ({SCHEMES[mode]})"
        embedding = False
        try:
            with GgufFile(gguf_path) as source:
                embedding = source.exact_embedding()
                found = source.embedding()
                with tqdm(total=len(source.linears(mode)) + embedding, desc=desc, unit="tensor",
                          disable=not show) as bar:
                    count, nbytes = write_quantized(iter_quantized(source, mode), out_dir, on_tensor=bar.update,
                                                    layout=layout, keep_rows=() if found is None else (found[1],))
        except NotStreamable as exc:
            log.warning("%s quantized whole, not a tensor at a time (more memory): %s", gguf_path.name, exc)
            count, nbytes = write_quantized(quantize_linears(_load_gguf(gguf_path, torch.float32), mode).items(),
                                            out_dir, layout=layout)
        return {
            "layout": "rows" if layout is None else layout.name,
            "source_kind": "gguf",
            "scheme": SCHEMES[mode],
            "linears": count - embedding,
            "embedding": "int4" if embedding else "dense",
            "bytes": nbytes,
            "prepare_seconds": {"quantize": round(time.perf_counter() - t0, 3)},
        }

    return build


def prepare_quantized_gguf(cache: ArtifactCache, source: ModelSource, weights_id: str, mode: str, *,
                           progress: bool | None = None, layout: PanelLayout | None = None) -> ArtifactLease | None:
    """The cache entry of a GGUF's quantized linears (those ``layout`` keeps as panels packed
    so), prepared now if needed; None if the cache dir fails."""
    desc = quantized_descriptor(weights_id=weights_id, mode=mode, name=source.name, path=source.path,
                                layout=None if layout is None else layout.name)
    builder = quantized_gguf_builder(source.path, mode, name=source.name, progress=progress, layout=layout)
    return _acquire(cache, desc, builder, progress, f"quantizing {source.name} without it")


def read_quantized(lease: ArtifactLease) -> dict[str, QuantizedWeight]:
    """The quantized linears of an entry, by mmap (safetensors shards and panels)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(lease.path.glob("*.safetensors")):
            tensors.update(load_file(shard))
        weights = from_tensors(tensors)
        panels = read_panels(lease.path)
        if not weights and not panels:
            raise OSError("no quantized weight")
        if panels.keys() & weights.keys():
            raise ValueError(f"stored twice: {sorted(panels.keys() & weights.keys())[:3]}")
        return weights | panels
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"Could not read the quantized weights in {lease.path}: {exc}") from exc
