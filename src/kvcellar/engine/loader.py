"""Loading a causal LM and its tokenizer with transformers, from local files.

``load_model`` loads a model source (``kvcellar.model_source``) as it is: a HF-format
directory, a hub snapshot, or a GGUF read directly (transformers dequantizes it in memory,
~20 s for the embedded model). Given ``folder``, a prepared copy of the source (e.g. a
dequantized GGUF in the artifact cache), it loads that instead, while the identities still
name the source (``kvcellar.identity``). Where prepared copies come from is not the loader's
business: ``runtime.prepare_and_load`` brings a source through the artifact cache first.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcellar.errors import ModelLoadError
from kvcellar.identity import tokenizer_identity, weights_identity
from kvcellar.model_source import ModelSource, resolve_source

if TYPE_CHECKING:
    from kvcellar.artifacts import ArtifactLease
    from kvcellar.quantization import QuantizedWeight

log = logging.getLogger(__name__)


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
    weights: str = "full"  # the weights mode served (``auto`` resolved: ``resolve_weights``)
    # Quantized weights by linear name (``--weights int8|int4``; kvcellar/quantization.py): the
    # model's linears hold their dequantized weights, the engine runs these where faster.
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    # The artifact-cache entry this model was loaded from, held so that it isn't evicted while
    # the model is served (set by ``runtime.prepare_and_load``); None when loaded from the source.
    artifact: ArtifactLease | None = None
    # The entry of its quantized linears (``--weights int8|int4`` on a GGUF), held the same way.
    quantized_artifact: ArtifactLease | None = None

    @property
    def config(self) -> Any:
        return self.model.config


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


# GGUF types of 4-bit weights in groups of 32 with a scale (and a minimum): ``--weights auto``
# serves a GGUF whose decoder linears all have one of them in int4, the precision it ships in.
FOUR_BIT_GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
_LINEAR_GGUF_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_linears_are_4bit(path: Path) -> bool:
    """Whether every decoder linear of a GGUF file is stored in a 4-bit type."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception:  # unreadable: the loader reports it properly
        return False
    types = {t.tensor_type.name for t in reader.tensors
             if t.name.startswith("blk.") and t.name.split(".")[2] in _LINEAR_GGUF_TENSORS}
    return bool(types) and types <= FOUR_BIT_GGUF_TYPES


def resolve_weights(weights: str, source: ModelSource, dtype: torch.dtype, device: torch.device) -> str:
    """``auto``: int4 for a GGUF whose decoder linears are 4-bit (served at the precision it
    ships in; from Q4_1 blocks exactly) where torch's int4 kernel runs; else full weights."""
    from kvcellar.config import WEIGHT_MODES
    from kvcellar.engine.linears import quant_kernels_run

    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {weights!r}; use one of {', '.join(WEIGHT_MODES)}")
    if weights != "auto":
        return weights
    if source.kind == "gguf" and quant_kernels_run(dtype, device) and gguf_linears_are_4bit(source.path):
        return "int4"
    return "full"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    model: str | ModelSource | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    weights: str = "auto",
    folder: Path | None = None,
    weights_id: str | None = None,
    attn_implementation: str | None = None,
    quantized: dict[str, QuantizedWeight] | None = None,
) -> LoadedModel:
    """Load a model (a ``--model`` argument or a resolved source) and its tokenizer.

    ``folder``: a HF-format directory holding a prepared copy of the source; weights and
    tokenizer are loaded from it. ``weights_id``: the source's identity when the caller has
    it already (hashing a GGUF takes a while); computed here otherwise.

    ``weights``: ``full`` keeps the weights in ``dtype``; ``int8``/``int4`` quantize the
    linears (``kvcellar.quantization``; a GGUF's from its float32 dequantization) or take
    ``quantized`` (the same, read from the artifact cache); ``auto`` picks one
    (``resolve_weights``). The mode becomes part of the weights identity.
    """
    from kvcellar.engine.linears import quant_kernels_run
    from kvcellar.quantization import quantize_model

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    source = model if isinstance(model, ModelSource) else resolve_source(model)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    weights = resolve_weights(weights, source, torch_dtype, dev)
    timings["resolve"] = time.perf_counter() - t0
    if weights_id is None:
        t0 = time.perf_counter()
        weights_id = weights_identity(source)
        timings["source_identity"] = time.perf_counter() - t0

    tokenizer, hf_model = _load_weights_and_tokenizer(source, folder, torch_dtype, dev, attn_implementation, timings)

    quantized_weights: dict[str, QuantizedWeight] = {}
    if weights != "full":
        t0 = time.perf_counter()
        given = quantized is not None
        if quantized is None and source.kind == "gguf":
            from kvcellar.artifacts.prepare import quantize_gguf

            quantized = quantize_gguf(source.path, weights)  # as the artifact cache stores it
        try:
            quantized_weights = quantize_model(hf_model, weights, given=quantized)
        except (KeyError, ValueError) as exc:  # given weights of another shape or set of linears
            raise ModelLoadError(f"The quantized weights of {source.name} do not fit its model: {exc}") from exc
        if not quant_kernels_run(torch_dtype, dev):
            log.warning("--weights %s: torch has no fast %s kernel for %s activations on %s; the dequantized "
                        "weights run instead (same outputs, no speed-up)", weights, weights, torch_dtype, dev)
        weights_id += f"|weights={weights}"  # other weights, other KV
        timings["quantized_weights" if given else "quantize"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok_id = tokenizer_identity(tokenizer)
    timings["tokenizer_identity"] = time.perf_counter() - t0

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
        weights=weights,
        quantized=quantized_weights,
    )


def _load_weights_and_tokenizer(
    source: ModelSource, folder: Path | None, torch_dtype: torch.dtype, dev: torch.device,
    attn_implementation: str | None, timings: dict[str, float],
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcellar.engine.attention import ATTENTION_NAME

    kwargs: dict[str, Any] = {}
    if folder is not None:
        load_dir = str(folder)
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
