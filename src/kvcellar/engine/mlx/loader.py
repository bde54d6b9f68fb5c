"""Loading an mlx-lm model for the MLX engine.

The weights come from the folder the torch engine loads: a GGUF's prepared entry in the
artifact cache (full precision; the same preparation, so the same tensors) or the model's own
HF folder. Tokenizer, chat template, identities and EOS ids are the torch engine's, so both
engines render and tokenize a request alike; their KV differs (other arithmetic), which the
namespace fingerprint says (``engine/build.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from kvcellar.artifacts import ArtifactCache
from kvcellar.artifacts.prepare import load_tokenizer, prepare_gguf
from kvcellar.engine.loader import LoadedModel, eos_ids
from kvcellar.engine.mlx import require_mlx
from kvcellar.errors import ModelLoadError
from kvcellar.identity import file_sha256, tokenizer_identity, weights_identity
from kvcellar.model_source import check_architecture, resolve_source

# The compute dtypes the MLX engine serves, by ``--dtype``; ``auto`` is float32 on a CPU
# (MLX's CPU backend has no fast half-precision matmul) and bfloat16 on a GPU.
# ``--weights int8|int4`` under MLX: its own affine quantization (``mlx.nn.quantize``: a scale
# and a bias per group of this many weights), of the linears and the embedding.
QUANT_GROUP = 64
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class MLXModel:
    """What the engine holds as ``LoadedModel.model`` under ``--engine mlx``: the mlx-lm module
    and the transformers config every other part reads (KV layout, vocabulary)."""

    def __init__(self, module: Any, config: Any) -> None:
        self.module = module
        self.config = config
        self.generation_config: Any = None


def resolve_mlx_dtype(dtype: str) -> torch.dtype:
    mx, _ = require_mlx()
    if dtype == "auto":
        return torch.float32 if mx.default_device() == mx.cpu else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"--engine mlx serves dtype auto, {', '.join(DTYPES)}; not {dtype!r}")
    return DTYPES[dtype]


def mlx_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """What mlx-lm reads from ``config.json`` where transformers 5 writes it otherwise:
    ``rope_parameters`` instead of ``rope_theta``/``rope_scaling`` (mlx-lm would take its
    default theta: other positions, other outputs), ``layer_types`` instead of Gemma 3's
    ``sliding_window_pattern``."""
    over: dict[str, Any] = {}
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in config:
        params = {}
    if "rope_theta" in params:
        over["rope_theta"] = params["rope_theta"]
    if params.get("rope_type", "default") != "default":
        over["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    if "sliding_attention" in params:  # Gemma 3: per attention kind
        full, local = params.get("full_attention", {}), params["sliding_attention"]
        over["rope_theta"] = full.get("rope_theta", over.get("rope_theta"))
        over["rope_local_base_freq"] = local.get("rope_theta")
        if full.get("rope_type", "default") != "default":
            over["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    types = config.get("layer_types")
    if (isinstance(types, list) and "sliding_window_pattern" not in config and "full_attention" in types
            and "sliding_attention" in types):
        # Gemma 3: mlx-lm places global layers by a period; transformers 5 lists each layer's kind
        period = types.index("full_attention") + 1
        if all((t == "full_attention") == (i % period == period - 1) for i, t in enumerate(types)):
            over["sliding_window_pattern"] = period
    return {k: v for k, v in over.items() if v is not None}


def quantize_module(module: Any, bits: int) -> None:
    """Quantize ``module``'s linears and embedding in place to ``bits`` (MLX's affine format,
    ``QUANT_GROUP`` weights a group); layers whose rows do not split into groups stay as they are."""
    import mlx.nn as nn

    quantize = nn.quantize  # type: ignore[attr-defined]  # in mlx, not in its type stubs
    quantize(module, group_size=QUANT_GROUP, bits=bits,
             class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % QUANT_GROUP == 0)


def load_mlx(model: str | None, *, dtype: str = "auto", weights: str = "auto", artifacts: ArtifactCache | None = None,
             progress: bool | None = None) -> LoadedModel:
    """Resolve ``model`` and load it as an mlx-lm model (``LoadedModel.model`` an ``MLXModel``).
    ``weights``: ``full`` (or ``auto``) in ``dtype``; ``int8``/``int4`` quantized by MLX
    (``quantize_module``), which makes them other weights (their identity says so)."""
    import json

    from mlx_lm.utils import load_model
    from transformers import AutoConfig, AutoTokenizer

    mx, _ = require_mlx()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    source = resolve_source(model)
    check_architecture(source, engine="mlx")
    torch_dtype = resolve_mlx_dtype(dtype)
    if weights not in ("auto", "full", "int8", "int4"):
        raise ModelLoadError(f"--engine mlx serves weights auto, full, int8 or int4; not {weights!r}")
    bits = {"int8": 8, "int4": 4}.get(weights, 0)
    weights_id = weights_identity(source, artifacts.file_digest if artifacts is not None else file_sha256)
    if bits:
        weights_id += f"+mlx-int{bits}-g{QUANT_GROUP}"  # other weights, other KV
    timings["source_identity"] = time.perf_counter() - t0
    lease = None
    if source.kind == "gguf":
        if artifacts is None:
            raise ModelLoadError("--engine mlx loads a GGUF through the model artifact cache, which is off "
                                 "([artifacts] enabled = false)")
        t0 = time.perf_counter()
        # float32 whatever the compute dtype: the cast below rounds once, as the torch engine does
        lease = prepare_gguf(artifacts, source, weights_id, torch.float32, progress=progress)
        if lease is None:
            raise ModelLoadError(f"--engine mlx could not prepare {source.name} in the artifact cache")
        timings["artifact"] = time.perf_counter() - t0
        folder: Path = lease.path
    else:
        folder = source.path
    try:
        t0 = time.perf_counter()
        tokenizer = load_tokenizer(folder) if lease is not None else AutoTokenizer.from_pretrained(str(folder))
        config = AutoConfig.from_pretrained(str(folder))
        timings["tokenizer"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        module, _ = load_model(folder, model_config=mlx_model_config(raw))
        module.set_dtype({torch.float32: mx.float32, torch.bfloat16: mx.bfloat16,
                          torch.float16: mx.float16}[torch_dtype])
        if bits:
            quantize_module(module, bits)
        mx.eval(module.parameters())
        timings["weights"] = time.perf_counter() - t0
    except Exception as exc:
        if lease is not None:
            lease.release()
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"--engine mlx could not load {source.name} from {folder}: {exc}") from exc
    wrapped = MLXModel(module, config)
    try:
        from transformers import GenerationConfig

        wrapped.generation_config = GenerationConfig.from_pretrained(str(folder))
    except OSError:  # none: the tokenizer's and config's EOS ids serve
        pass
    text = config.get_text_config()
    loaded = LoadedModel(
        model=wrapped, tokenizer=tokenizer, source=source, name=source.name, dtype=torch_dtype,
        device=torch.device("cpu"),  # the block pool's: host memory
        weights_id=weights_id, tokenizer_id=tokenizer_identity(tokenizer),
        eos_token_ids=eos_ids(wrapped, tokenizer),
        max_context=int(getattr(text, "max_position_embeddings", 0) or 4096),
        load_seconds=timings, weights=weights if bits else "full", engine="mlx",
    )
    loaded.artifact = lease
    return loaded
