"""What serving a model will take in memory, known before anything heavy loads.

``plan_memory`` adds up what the engine will hold for a source under a weights mode: the
decoder linears at the bytes a weight their kind keeps (``engine/linears.py``: int4 0.5 plus a
16-bit scale and zero per 32 inputs, int8 one byte plus a scale per row, full the serving
dtype), the LM head (int8 in both quantized modes), every other tensor (embeddings, norms,
biases) in the serving dtype, the KV pool as configured, and a fixed allowance for the
interpreter, libraries and step buffers. A GGUF is read from its header (``gguf_info.py``);
an HF directory from its safetensors headers. ``serve`` refuses a model whose plan exceeds
the memory available (``MemAvailable``, and ``--max-memory-gb`` when set) with these figures,
instead of being killed half-way through loading it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from kvcellar.errors import ModelLoadError
from kvcellar.gguf_info import read_gguf_info
from kvcellar.model_source import ModelSource

GIB = 1 << 30
# Interpreter, torch and transformers, tokenizer, step activations and the dequantization buffer.
OVERHEAD_BYTES = 1 * GIB
# Bytes a weight of a decoder linear keeps, by mode (full: the dtype's size).
BYTES_PER_WEIGHT = {"int4": 0.5 + 4 / 32, "int8": 1.0}
# A GGUF's MXFP4 experts, kept as stored under both quantized modes: 17 bytes per 32 weights.
MXFP4_BYTES_PER_WEIGHT = 17 / 32
# What an int4 weight kept as panels without offsets saves (a Q4_0 source's: ``native.pack_int4``)
OFFSET_BYTES_PER_WEIGHT = 2 / 32
_GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                 "ffn_gate_up", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A MoE block's experts, stacked (engine/experts.py serves them as linears).
_HF_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class MemoryPlan:
    weights_mode: str
    linear_params: int
    head_params: int
    other_params: int
    weights_bytes: int
    kv_pool_bytes: int
    overhead_bytes: int = OVERHEAD_BYTES
    state_pool_bytes: int = 0  # a hybrid model's recurrent-state slots, every one in use
    embedding_int4_params: int = 0  # of ``other_params``: a GGUF's int4 embedding, kept as its blocks
    mxfp4_params: int = 0  # of ``linear_params``: a GGUF's MXFP4 experts, kept as stored

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_pool_bytes + self.state_pool_bytes + self.overhead_bytes

    def describe(self) -> str:
        gb: Callable[[int], str] = lambda n: f"{n / GIB:.1f} GB"  # noqa: E731
        return (f"{gb(self.total_bytes)}: weights {gb(self.weights_bytes)} ({self.weights_mode}), "
                f"KV pool {gb(self.kv_pool_bytes)}, "
                + (f"recurrent states {gb(self.state_pool_bytes)}, " if self.state_pool_bytes else "")
                + f"overhead {gb(self.overhead_bytes)}")

    def as_dict(self) -> dict[str, object]:
        return {"weights_mode": self.weights_mode, "weights_bytes": self.weights_bytes,
                "kv_pool_bytes": self.kv_pool_bytes, "state_pool_bytes": self.state_pool_bytes,
                "overhead_bytes": self.overhead_bytes,
                "total_bytes": self.total_bytes, "linear_params": self.linear_params,
                "head_params": self.head_params, "other_params": self.other_params,
                "embedding_int4_params": self.embedding_int4_params, "mxfp4_params": self.mxfp4_params}


def plan_memory(source: ModelSource, weights_mode: str, dtype: torch.dtype, kv_pool_bytes: int,
                state_slots: int = 0, *, stored_panels: bool = False) -> MemoryPlan:
    """The plan for ``source`` served under ``weights_mode`` (resolved: full, int8 or int4);
    ``state_slots``: the recurrent-state slots a hybrid model's engine keeps (live, checkpoint,
    snapshot and verification ones); ``stored_panels``: the artifact cache keeps the int4 linears
    as this CPU's panels (``artifacts/panels.py``), at any size, rather than the start packing
    them where they fit."""
    linear, head, other, tied = _param_counts(source)
    itemsize = dtype.itemsize
    embedding = mxfp4 = 0
    if weights_mode == "full":  # a tied LM head is the embedding itself
        weights = (linear + (0 if tied else head) + other) * itemsize
    else:
        embedding = _int4_embedding_params(source)
        mxfp4 = _mxfp4_expert_params(source)
        weights = int((linear - mxfp4) * BYTES_PER_WEIGHT[weights_mode] + mxfp4 * MXFP4_BYTES_PER_WEIGHT
                      + embedding * BYTES_PER_WEIGHT["int4"])
        if weights_mode == "int4":
            int4_bytes = int((linear - mxfp4) * BYTES_PER_WEIGHT["int4"])
            weights -= int(_q4_0_panel_params(source, int4_bytes, stored_panels) * OFFSET_BYTES_PER_WEIGHT)
        weights += head * 1 + (other - embedding) * itemsize
    return MemoryPlan(weights_mode, linear, head, other, int(weights), int(kv_pool_bytes),
                      embedding_int4_params=embedding, mxfp4_params=mxfp4,
                      state_pool_bytes=state_slots * _state_bytes_per_slot(source))


def _state_bytes_per_slot(source: ModelSource) -> int:
    """A recurrent-state slot's bytes for a hybrid model in a HF folder (cache/state_pool.py), else 0."""
    from kvcellar.cache.state_pool import StateLayout

    if source.kind == "gguf":
        return 0
    try:
        config = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    if not isinstance(text, dict) or "linear_num_value_heads" not in text:
        return 0
    layers = text.get("num_hidden_layers", 0)
    # transformers' default when a config lists no layer types: every 4th layer full attention
    types = text.get("layer_types") or ["full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0
                                        else "linear_attention" for i in range(layers)]
    fields = {"layer_types": types, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_num_key_heads": 16, "linear_conv_kernel_dim": 4, **text}
    layout = StateLayout.from_model_config(SimpleNamespace(**fields))
    return layout.bytes_per_slot if layout is not None else 0


def _q4_0_panel_params(source: ModelSource, int4_bytes: int, stored: bool) -> int:
    """The parameters of a GGUF's Q4_0 decoder linears that this CPU keeps as panels without
    offsets (``native.stores_panels``: rows in 8s; ``stored`` in the artifact cache, else packed
    by the start where ``native.panels_fit``: the model's ``int4_bytes`` within the share of
    memory panels may take), else 0."""
    from kvcellar.engine import native

    if source.kind != "gguf" or not native.available() or not (stored or native.panels_fit(int4_bytes)):
        return 0
    return sum(t.params for t in read_gguf_info(source.path).tensors
               if t.type == "Q4_0" and _is_gguf_linear(t.name) and len(t.dims) >= 2 and t.dims[1] % native.PANEL == 0)


def _is_gguf_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LINEARS and parts[3] == "weight"


def _mxfp4_expert_params(source: ModelSource) -> int:
    """The parameters of a GGUF's experts stored in MXFP4 (gpt-oss), else 0."""
    if source.kind != "gguf":
        return 0
    return sum(t.params for t in read_gguf_info(source.path).tensors if t.mxfp4_experts)


def _int4_embedding_params(source: ModelSource) -> int:
    """The parameters of a GGUF's embedding that quantized modes keep as its int4 blocks
    (``gguf_convert.EXACT_EMBEDDING_TYPES``; Gemma's scaled embedding is not one), else 0."""
    from kvcellar.artifacts.gguf_convert import EXACT_EMBEDDING_TYPES

    if source.kind != "gguf":
        return 0
    info = read_gguf_info(source.path)
    if info.architecture.startswith("gemma"):
        return 0
    stored = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
    return stored.params if stored is not None and stored.type in EXACT_EMBEDDING_TYPES else 0


def available_bytes() -> int | None:
    """Memory this process may still take: ``MemAvailable``, lowered by a cgroup limit; None
    where neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        usage = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            found.append(int(limit) - usage)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits(plan: MemoryPlan, max_memory_gb: float = 0.0) -> None:
    """``ModelLoadError`` with the figures when ``plan`` exceeds ``max_memory_gb`` (when > 0)
    or the memory available now."""
    limits = []
    if max_memory_gb > 0:
        limits.append((int(max_memory_gb * GIB), "--max-memory-gb"))
    available = available_bytes()
    if available is not None:
        limits.append((available, "available memory"))
    smaller = ", serve it with --weights int4," if plan.weights_mode != "int4" else ""
    for limit, what in limits:
        if plan.total_bytes > limit:
            raise ModelLoadError(
                f"the model will not fit: it needs {plan.describe()}, and {what} is {limit / GIB:.1f} GB. "
                f"Lower --kv-cache-gb{smaller} or raise the limit.")


def _param_counts(source: ModelSource) -> tuple[int, int, int, bool]:
    """Parameters of (decoder linears, LM head, everything else), and whether the LM head is
    tied to the embedding (then its count is the embedding's, which "everything else" holds)."""
    if source.kind == "gguf":
        info = read_gguf_info(source.path)
        linear = head = other = 0
        names = {t.name for t in info.tensors}
        for t in info.tensors:
            if _is_gguf_linear(t.name):
                linear += t.params
            elif t.name == "output.weight":
                head += t.params
            else:
                other += t.params
        tied = "output.weight" not in names
        if tied:  # quantized modes keep the LM head as an int8 copy of the embedding
            head = next((t.params for t in info.tensors if t.name == "token_embd.weight"), 0)
        return linear, head, other, tied
    return _hf_param_counts(Path(source.path))


def _hf_param_counts(folder: Path) -> tuple[int, int, int, bool]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {folder} to plan memory from")
    linear = head = embed = other = 0
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in meta["shape"]:
                n *= int(d)
            if (name.endswith(".weight") and name.rsplit(".", 2)[-2] in _HF_LINEARS) or name.endswith(_HF_EXPERTS):
                linear += n
            elif name == "lm_head.weight":
                head += n
            else:
                other += n
                if name.endswith("embed_tokens.weight"):
                    embed = n
    return linear, head or embed, other, not head
