"""A GGUF file converted one tensor at a time: the weights of the artifact cache's entries.

transformers' own GGUF loading (``from_pretrained(gguf_file=...)``) dequantizes every tensor
into one state dict before it builds the model: the whole model in memory at once, in float32
for the quantized entry. The same steps run here on one tensor at a time, with transformers'
own pieces: its config, its GGUF -> HF name map (``get_gguf_hf_weights_map``, over the model
built on the meta device, which costs no memory) and its per-architecture ``TensorProcessor``
(e.g. llama's q/k row permutation), on the ``gguf`` package's dequantization, as
``load_gguf_checkpoint`` does. The values are those transformers loads, bit for bit.

A 2-D tensor the processor only renames or reorders by rows (every linear and embedding of
the dense architectures; found by running the processor on a small probe) is read and
dequantized a slice of rows at a time; any other tensor whole. Tensors are read with
``pread``, not through the reader's memory map, so the file's pages never count in this
process's memory. Peak memory: what the caller keeps (a shard, the quantized linears) plus a
slice of rows, or the tensor for one converted whole.

``write_dense`` writes safetensors shards in the serving dtype that ``from_pretrained``
loads; ``quantize_streamed`` gives ``QuantizedWeight``s by linear, taking Q4_0/Q4_1/Q4_K
blocks as they are where int4 is asked (``int4_from_blocks``) and quantizing the rest with
``kvcellar.quantization``.

Architectures transformers converts with its newer conversion mappings
(``transformers.integrations.gguf.GGUF_ARCHS``) are not converted here (``NotStreamable``):
their per-tensor steps are another API. prepare.py loads those whole, as before. Qwen3.5's
(``qwen35``, ``qwen35moe``) are the exception: their steps are written out here
(``qwen35_processor``, ``qwen35_key_map``: the same undoing of llama.cpp's converter),
so their files stream like the others.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import re
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard
from unittest import mock

import numpy as np
import torch

from kvcellar.artifacts.panels import PanelLayout, PanelWriter
from kvcellar.errors import ModelLoadError
from kvcellar.gguf_info import GGUFInfo, GGUFTensor, read_gguf_info
from kvcellar.model_source import MOE_GGUF_ARCHITECTURES
from kvcellar.quantization import INT4_GROUP, MXFP4_GROUP, QuantizedWeight, kind_for, quantize

log = logging.getLogger(__name__)

# Values per slice of rows read and dequantized at once (4 MiB in float32).
ROW_CHUNK_ELEMENTS = 1 << 20
SHARD_BYTES = 1 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# GGUF types whose blocks are int4 groups of 32 with a scale and an offset (Q4_K: 32-value
# sub-blocks): taken as they are for int4 linears.
INT4_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K")

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# A MoE layer's experts stacked in one tensor per projection (llama.cpp's ``ffn_*_exps``).
_EXPERTS = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps$")
# gpt-oss's expert tensors and their biases (``GgufFile._gpt_oss_tensors``).
# Gemma 4 tensors as llama.cpp names them -> their parameter in a layer of transformers' model.
_GEMMA4_NAMES = {"ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
                 "layer_output_scale.weight": "layer_scalar"}
_GPT_OSS_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
# The ggml types gguf's reader gives as values (numpy types); the others are bytes of blocks.
_VALUE_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


# GGUF types of an input embedding that int4 groups of 32 hold value for value
# (``int4_from_blocks``): such an embedding is kept as int4 beside the quantized linears and
# dequantized a row at a time as tokens are looked up (``quantization.QuantizedEmbedding``).
EXACT_EMBEDDING_TYPES = frozenset({"Q4_0", "Q4_1"})


class NotStreamable(ModelLoadError):
    """transformers converts this GGUF's architecture in a way this module does not follow."""


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in the file and how it is stored: what ``GGUFReader`` says of it,
    without the reader, which holds an object per metadata value (a large vocabulary's worth)."""

    name: str
    type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as the reader types the data: rows of blocks (uint8) for block types
    dtype: np.dtype
    offset: int  # in the file
    cols: int  # values per row

    @classmethod
    def of(cls, t: GGUFTensor, info: GGUFInfo) -> StoredTensor:
        """What ``gguf.GGUFReader`` makes of the tensor (its ``data``'s shape and dtype):
        values for plain types, rows of bytes for block types."""
        import gguf

        try:
            qtype = gguf.GGMLQuantizationType[t.type]
        except KeyError:
            raise ModelLoadError(f"tensor {t.name} has a ggml type gguf does not know ({t.type})") from None
        shape = tuple(reversed(t.dims))  # ggml order is the row length first
        item = _VALUE_TYPES.get(t.type)
        dtype: np.dtype[Any]
        if item is None:
            dtype, shape = np.dtype(np.uint8), tuple(gguf.quant_shape_to_byte_shape(shape, qtype))
        else:
            dtype = np.dtype(item).newbyteorder(">") if info.big_endian else np.dtype(item)
        return cls(t.name, qtype, shape, dtype, info.data_start + t.offset, t.dims[0])


@dataclass
class TensorSource:
    """One HF tensor of the file, not read yet (``whole`` aside). ``perm``: row ``i`` of the
    result is row ``perm[i]`` of the stored tensor (None: same order). ``whole``: the result
    already computed, for a tensor the processor does more to than reorder rows."""

    name: str
    gguf_name: str
    gguf_type: str
    shape: tuple[int, ...]
    file: GgufFile
    perm: torch.Tensor | None = None
    whole: torch.Tensor | None = None

    @property
    def exact_int4(self) -> bool:
        """Whether int4 groups hold the tensor's stored blocks value for value (an embedding
        kept as int4: ``EXACT_EMBEDDING_TYPES``)."""
        return self.whole is None and self.gguf_type in EXACT_EMBEDDING_TYPES

    def raw_rows(self) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, stored rows)`` in slices, as the reader types them."""
        return self.file.read_rows(self.gguf_name)

    def float_rows(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first row, float32 rows)`` in slices, in stored order."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.gguf_type]
        for first, raw in self.raw_rows():
            yield first, torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))

    def fill(self, out: torch.Tensor) -> torch.Tensor:
        """Write the tensor into ``out`` (of its shape, in any float dtype), a slice at a time."""
        if self.whole is not None:
            return out.copy_(self.whole)
        into = None if self.perm is None else torch.argsort(self.perm)
        for first, rows in self.float_rows():
            if into is None:
                out[first:first + len(rows)] = rows
            else:
                out.index_copy_(0, into[first:first + len(rows)], rows.to(out.dtype))
        return out

    def quantized(self, kind: str) -> QuantizedWeight:
        """The tensor quantized as ``kind`` (``quantization.quantize``), or its own int4 blocks,
        a slice of rows at a time (both quantizers work row by row: slices give what the whole
        tensor gives)."""
        if self.whole is not None:
            return quantize(self.whole.float(), kind)
        if kind == "int4" and self.gguf_type in INT4_BLOCK_TYPES:
            parts = ((first, int4_from_blocks(raw, self.gguf_type)) for first, raw in self.raw_rows())
        else:
            parts = ((first, quantize(rows, kind)) for first, rows in self.float_rows())
        into = None if self.perm is None else torch.argsort(self.perm)
        out: QuantizedWeight | None = None
        for first, part in parts:
            if out is None:
                out = _empty_like_rows(part, self.shape[0])
            n = part.qweight.shape[0]
            rows = slice(first, first + n) if into is None else into[first:first + n]
            for dst, src in ((out.qweight, part.qweight), (out.scales, part.scales), (out.offsets, part.offsets)):
                if dst is not None and src is not None:
                    dst[rows] = src
        assert out is not None
        return out


def gguf_config_dict(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``PreTrainedConfig.get_config_dict(gguf_file=...)`` gives for ``path`` (fresh
    copies). It parses the whole metadata with gguf's reader, seconds for a large vocabulary,
    and preparing a model reads it for each entry it writes, so it is kept per file version."""
    stat = path.stat()
    parsed, unused = _config_dict(str(path), stat.st_mtime_ns, stat.st_size)
    return copy.deepcopy(parsed), copy.deepcopy(unused)


def gguf_config(path: Path) -> Any:
    """transformers' config of the GGUF at ``path`` (``gguf_config_dict``), as an object."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    parsed, unused = gguf_config_dict(path)
    return CONFIG_MAPPING[parsed["model_type"]].from_dict(parsed, **unused)


@functools.lru_cache(maxsize=4)
def _config_dict(path: str, _mtime_ns: int, _size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    from transformers import PreTrainedConfig

    p = Path(path)
    with transformers_reads_gguf(p):
        parsed, unused = PreTrainedConfig.get_config_dict(str(p.parent), gguf_file=p.name)
    # transformers reads no expert size from a qwen3moe file: its config's default (a 30B-A3B's
    # 768) would stand for every model, and any other would not load.
    info = read_gguf_info(p)
    meta = info.metadata
    expert_ffn = meta.get(f"{info.architecture}.expert_feed_forward_length")
    if parsed.get("model_type") == "qwen3_moe" and isinstance(expert_ffn, int):
        parsed["moe_intermediate_size"] = expert_ffn
    if parsed.get("model_type") == "gpt_oss":
        parsed.update(_gpt_oss_config(meta))
    if parsed.get("model_type") == "gemma4_text":
        parsed.update(_gemma4_config(p, info))
    return parsed, unused


# Gemma 4's tokens that end a turn besides the file's end token: the end of a turn, and the
# start of a tool's result (the model stops after its calls; the result follows them).
GEMMA4_ENDS = ("<turn|>", "<|tool_response>")


def _gemma4_config(path: Path, info: GGUFInfo) -> dict[str, Any]:
    """What transformers' GGUF reading leaves out of, or defaults in, a Gemma 4 config, from the
    keys and tensors llama.cpp writes: head sizes and KV heads of the sliding and global
    layers (keys as values where a global layer has no ``attn_v``), which layers slide,
    per-layer embeddings, shared KV layers, experts, the global layers' partial rotation (the
    ``rope_freqs`` tensor: 1 where a pair rotates, 1e30 where it does not) and the tokens
    that end a turn (transformers sets Gemma 4's own ids, whatever the vocabulary)."""
    import gguf

    meta, a = info.metadata, "gemma4."
    layers = int(meta[a + "block_count"])  # type: ignore[arg-type]

    def per_layer(key: str, default: Any) -> list[Any]:
        value = meta.get(a + key, default)
        return list(value) if isinstance(value, tuple) else [value] * layers

    sliding = [bool(s) for s in per_layer("attention.sliding_window_pattern", True)]
    kv_heads = per_layer("attention.head_count_kv", meta.get(a + "attention.head_count"))
    names = {t.name: t for t in info.tensors}
    full = [i for i in range(layers) if not sliding[i]]
    out: dict[str, Any] = {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "head_dim": meta.get(a + "attention.key_length_swa", meta.get(a + "attention.key_length")),
        "global_head_dim": meta.get(a + "attention.key_length"),
        "num_key_value_heads": next((k for k, s in zip(kv_heads, sliding, strict=True) if s), kv_heads[0]),
        "num_global_key_value_heads": kv_heads[full[0]] if full else None,
        "attention_k_eq_v": bool(full) and not any(f"blk.{i}.attn_v.weight" in names for i in full),
        "num_kv_shared_layers": int(meta.get(a + "attention.shared_kv_layers", 0)),  # type: ignore[arg-type]
        "hidden_size_per_layer_input": int(meta.get(a + "embedding_length_per_layer_input", 0)),  # type: ignore[arg-type]
    }
    if isinstance(meta.get(a + "final_logit_softcapping"), float):
        out["final_logit_softcapping"] = meta[a + "final_logit_softcapping"]
    ffn = per_layer("feed_forward_length", meta.get(a + "feed_forward_length"))
    out["intermediate_size"] = ffn[0]
    out["use_double_wide_mlp"] = max(ffn) > min(ffn)
    if "per_layer_token_embd.weight" in names:
        out["vocab_size_per_layer_input"] = names["per_layer_token_embd.weight"].dims[1]
    experts = meta.get(a + "expert_count", 0)
    if isinstance(experts, int) and experts > 0:
        out.update(enable_moe_block=True, num_experts=experts, top_k_experts=meta.get(a + "expert_used_count"),
                   moe_intermediate_size=meta.get(a + "expert_feed_forward_length"))
    reader = gguf.GGUFReader(str(path))
    factor = 0.25  # Gemma 4's own, where the file has no rope_freqs
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            factor = float(np.count_nonzero(np.asarray(t.data) < 1e10)) * 2 / float(out["global_head_dim"] or 1)
    out["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(meta.get(a + "rope.freq_base_swa", 10000.0))},  # type: ignore[arg-type]
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": factor,
                           "rope_theta": float(meta.get(a + "rope.freq_base", 1000000.0))},  # type: ignore[arg-type]
    }
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    ends = [eos] if isinstance(eos, int) else []
    if tokens is not None:
        texts = {bytes(tokens.parts[i]).decode("utf-8", "replace"): n for n, i in enumerate(tokens.data)}
        ends += [texts[t] for t in GEMMA4_ENDS if t in texts and texts[t] not in ends]
    out["eos_token_id"] = ends
    return out


def _gpt_oss_config(meta: dict[str, Any]) -> dict[str, Any]:
    """What transformers' GGUF reading leaves out of, or defaults in, a gpt-oss config: the
    head size, window, expert size and YaRN rope as llama.cpp writes them."""
    out: dict[str, Any] = {}
    for key, field in (("attention.key_length", "head_dim"), ("attention.sliding_window", "sliding_window"),
                       ("expert_feed_forward_length", "intermediate_size")):
        if isinstance(meta.get(f"gpt-oss.{key}"), int):
            out[field] = meta[f"gpt-oss.{key}"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("gpt-oss.rope.freq_base", 150000.0))}
    if meta.get("gpt-oss.rope.scaling.type") == "yarn":
        # gpt-oss's own config: beta_fast 32, beta_slow 1, not truncated (llama.cpp's YaRN
        # takes the correction range as it is too)
        rope.update(rope_type="yarn", factor=float(meta.get("gpt-oss.rope.scaling.factor", 1.0)),
                    original_max_position_embeddings=int(meta.get("gpt-oss.rope.scaling.original_context_length",
                                                                  4096)),
                    beta_fast=float(meta.get("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(meta.get("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
    out["rope_parameters"] = rope
    return out


# Keys transformers 5.23 reads wrongly, hidden from it (the config's fields are set from the
# metadata instead): a gpt-oss file's ``rope.scaling`` keys (read by the wrong part of each
# field, which fails on every file that has them: ``_gpt_oss_config``); Gemma 4's KV heads per
# layer, an array its config takes as one number (``_gemma4_config``).
_HIDDEN_KEYS: dict[str, tuple[str, ...]] = {"gpt-oss": ("gpt-oss.rope.scaling.",),
                                             "gemma4": ("gemma4.attention.head_count_kv",)}


@contextlib.contextmanager
def transformers_reads_gguf(path: Path) -> Iterator[None]:
    """Around a transformers call that reads the GGUF at ``path`` (its config, tokenizer): it is
    handed the file's reader without the keys it reads wrongly (``_HIDDEN_KEYS``)."""
    found = _HIDDEN_KEYS.get(read_gguf_info(path).architecture)
    if found is None:
        yield
        return
    hidden: tuple[str, ...] = found
    import gguf

    class Reader(gguf.GGUFReader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith(hidden)]:
                del self.fields[key]

    with mock.patch.object(gguf, "GGUFReader", Reader):
        yield


class GgufFile:
    """A GGUF file opened for conversion: transformers' config for it, its model on the meta
    device (no memory; ``dtype`` is what its config records), the name map and tensor
    processor ``load_gguf_checkpoint`` would use. Not thread-safe; ``close`` (or ``with``)
    releases the file."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = path
        info = read_gguf_info(path)
        self.architecture = info.architecture
        self.stored = [StoredTensor.of(t, info) for t in info.tensors]
        if _converted_by_mapping(self.architecture) and self.architecture not in QWEN35_ARCHITECTURES:
            raise NotStreamable(f"transformers converts GGUF architecture {self.architecture!r} with its weight "
                                f"conversion mappings")
        try:
            # What ``AutoConfig.from_pretrained(gguf_file=...)`` does, keeping the metadata dict
            # on the way: transformers hands that to the processor, not the config object.
            parsed, _ = gguf_config_dict(path)
            config = gguf_config(path)
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            if self.architecture in QWEN35_ARCHITECTURES:
                self.processor: Any = qwen35_processor(copy.deepcopy(parsed))
                self.key_map: dict[str, str] = qwen35_key_map([t.name for t in self.stored],
                                                              int(parsed["num_hidden_layers"]))
            else:
                processor_class: type[TensorProcessor] = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)
                self.processor = processor_class(config=copy.deepcopy(parsed))
                self.key_map = _weights_map(self.model, self.processor)
        except Exception as exc:
            raise ModelLoadError(f"Could not read the model configuration of {path}: {exc}") from exc
        self._tensors = {t.name: t for t in self.stored}
        # Expert tensors: GGUF name -> (the HF stacked weight, its role: gate, up or down).
        # Served as one linear per expert (``engine/experts.py``), quantized from them.
        self.experts: dict[str, tuple[str, str]] = {}
        for key, hf_name in self.key_map.items():
            m = _EXPERTS.match(key.removesuffix(".weight"))
            if m and self.architecture in MOE_GGUF_ARCHITECTURES:
                self.experts[key.removesuffix(".weight") + ".weight"] = (hf_name, m[1])
        # gpt-oss: names transformers' map does not give (see ``_gpt_oss_tensors``)
        self.gpt_oss = self.architecture == "gpt-oss"
        if self.gpt_oss:
            for t in self.stored:
                block = _block(t.name)
                if t.name.endswith(".attn_sinks.weight"):
                    self.key_map[t.name] = f"model.layers.{block}.self_attn.sinks"
                m = _EXPERTS.match(t.name.removesuffix(".weight"))
                if m:
                    stacked = "gate_up_proj" if m[1] in ("gate", "up") else "down_proj"
                    self.experts[t.name] = (f"model.layers.{block}.mlp.experts.{stacked}", m[1])
        if self.architecture == "gemma4":  # names transformers' map does not give
            for t in self.stored:
                block = _block(t.name)
                for leaf, hf_leaf in _GEMMA4_NAMES.items():
                    if t.name == f"blk.{block}.{leaf}":
                        self.key_map[t.name] = f"model.layers.{block}.{hf_leaf}"
                m = _EXPERTS.match(t.name.removesuffix(".weight"))
                if m:
                    stacked = "gate_up_proj" if m[1] != "down" else "down_proj"
                    self.key_map[t.name] = f"model.layers.{block}.experts.{stacked}"
                    self.experts[t.name] = (self.key_map[t.name], m[1])
        # Tensors a name map leaves out on purpose, never read.
        self.unmapped: frozenset[str] = frozenset()
        if self.architecture in QWEN35_ARCHITECTURES:
            mapped = {*self.key_map, *(key + ".weight" for key in self.key_map)}
            self.unmapped = frozenset(t.name for t in self.stored if t.name not in mapped)
        # A tied weight is loaded under its first name (transformers ties the others to it).
        self.names = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
        self._fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def linears(self, mode: str) -> dict[str, tuple[str, str]]:
        """``{weight name: (linear name, kind)}`` of the linears ``mode`` quantizes
        (``quantization.kind_for``); a tied LM head under the embedding's name."""
        first = {id(p): n for n, p in self.model.named_parameters()}
        # A router's linear (Gemma 4's) becomes kvcellar's router's weight, kept dense.
        routers = {n for n, m in self.model.named_modules() if type(m).__name__.endswith("Router")}
        out: dict[str, tuple[str, str]] = {}
        for name, module in self.model.named_modules():
            if name.rpartition(".")[0] in routers:
                continue
            if isinstance(module, torch.nn.Linear) and (kind := kind_for(mode, name, module)) is not None:
                out[first[id(module.weight)]] = (name, kind)
        return out

    def embedding(self) -> tuple[str, str] | None:
        """(weight name, module name) of the input embedding, where it is a plain
        ``nn.Embedding`` (a scaled one, Gemma's, computes more than its rows)."""
        module = self.model.get_input_embeddings()
        if type(module) is not torch.nn.Embedding:
            return None
        weight = next(n for n, p in self.model.named_parameters() if p is module.weight)  # a tied one's first name
        return weight, next(n for n, m in self.model.named_modules() if m is module)

    def exact_embedding(self) -> bool:
        """Whether the input embedding is stored in one of ``EXACT_EMBEDDING_TYPES``."""
        found = self.embedding()
        if found is None:
            return False
        stored = next((t for t in self.tensors(wanted=found[0].__eq__)), None)
        return stored is not None and stored.exact_int4

    def linear_weights(self) -> set[str]:
        """The HF names of the weights only linears use (a tied LM head's is the embedding's:
        not one of them), which ``--weights int8|int4`` serves from the quantized entry;
        stacked experts among them."""
        linears = {weight for weight, (linear, _) in self.linears("int8").items() if weight == f"{linear}.weight"}
        return linears | {hf_name for hf_name, _ in self.experts.values()}

    def expert_linears(self, mode: str) -> Iterator[tuple[str, QuantizedWeight]]:
        """Every expert's linears quantized under ``mode``, one expert at a time, as
        ``engine/experts.py`` names them: ``<experts>.gate_up.<e>`` (the gate's rows, then the
        up projection's) and ``<experts>.down.<e>``. Q4_0/Q4_1/Q4_K blocks are taken as
        they are for int4; a layer's gate projections are held until its up ones are read."""
        import gguf

        held: dict[tuple[str, int], tuple[str, QuantizedWeight]] = {}
        for t in self.stored:
            if t.name not in self.experts:
                continue
            hf_name, role = self.experts[t.name]
            module = hf_name.rpartition(".")[0]
            kind = "int4" if mode == "int4" and t.cols % INT4_GROUP == 0 else "int8"
            for e in range(t.shape[0]):
                raw = self._read(t, e, e + 1)[0]
                if t.type.name == "MXFP4":  # kept as stored under every quantized mode: exact and smallest
                    q = mxfp4_from_blocks(raw)
                elif kind == "int4" and t.type.name in INT4_BLOCK_TYPES:
                    q = int4_from_blocks(raw, t.type.name)
                else:
                    rows = gguf.quants.dequantize(raw, t.type)
                    q = quantize(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)), kind)
                if role in ("down", "gate_up"):  # (Gemma 4's gate and up come fused)
                    yield f"{module}.{role}.{e}", q
                    continue
                other = held.pop((module, e), None)
                if other is None:
                    held[(module, e)] = (role, q)
                    continue
                gate, up = (q, other[1]) if role == "gate" else (other[1], q)
                # gpt-oss's gating takes gate and up outputs interleaved (``experts._ClampedGlu``)
                fused = _interleaved(gate, up) if self.gpt_oss else QuantizedWeight.concat([gate, up])
                yield f"{module}.gate_up.{e}", fused
        if held:
            module, e = next(iter(held))
            raise ModelLoadError(f"{self.path.name} holds a gate or an up projection of expert {e} of {module}, "
                                 f"not both")

    def tensors(self, wanted: Callable[[str], bool] | None = None) -> Iterator[TensorSource]:
        """The file's tensors under their HF names, in file order, one at a time; ``wanted``
        (an HF name) skips the others, unread where the name is known before reading."""
        import gguf

        def keep(name: str | None) -> TypeGuard[str]:
            return name is not None and name in self.names and (wanted is None or wanted(name))

        last_of_block = {_block(t.name): i for i, t in enumerate(self.stored)}
        # What a processor puts aside (``parsed_parameters``), by block: a later tensor of the
        # same block may complete it (MoE experts fused from gate and up), so it is given out
        # after the block's last tensor.
        held: dict[int | None, dict[str, torch.Tensor]] = {}
        origin: dict[str, StoredTensor] = {}
        gpt_oss_held: dict[str, tuple[str, torch.Tensor]] = {}  # a layer's gate or up part, until the other
        for i, t in enumerate(self.stored):
            block = _block(t.name)
            if self.gpt_oss and _GPT_OSS_EXPERTS.match(t.name):
                yield from self._gpt_oss_tensors(t, keep, gpt_oss_held)
                continue
            rows = self._row_map(t) if len(t.shape) == 2 else None
            if t.name in self.experts and not keep(self.experts[t.name][0]):
                pass  # unread: a layer's experts are gigabytes
            elif t.name in self.unmapped:
                pass  # unread: nothing of the model (Qwen3.5's multi-token-prediction block)
            elif rows is not None:
                name, perm = rows
                if keep(name):
                    yield TensorSource(name, t.name, t.type.name, (t.shape[0], t.cols), self, perm=perm)
            else:
                side = held.setdefault(block, {})
                weights = gguf.quants.dequantize(self._read(t), t.type)
                result = self.processor.process(weights=weights, name=t.name, tensor_key_mapping=self.key_map,
                                                parsed_parameters={"tensors": side})
                origin.update({k: t for k in side if k not in origin})
                name = self.key_map.get(result.name) if result.name is not None else None
                if keep(name):
                    whole = _from_numpy(result.weights)
                    yield TensorSource(name, t.name, t.type.name, tuple(whole.shape), self, whole=whole)
            if block is None or last_of_block[block] == i:
                for name, tensor in held.pop(block, {}).items():
                    if keep(name):
                        yield TensorSource(name, origin[name].name, origin[name].type.name, tuple(tensor.shape), self,
                                           whole=tensor)

    def _gpt_oss_tensors(self, t: StoredTensor, keep: Callable[[str | None], bool],
                         held: dict[str, tuple[str, torch.Tensor]]) -> Iterator[TensorSource]:
        """A gpt-oss expert tensor (weight or bias) as transformers' model holds it: gate and
        up projections de-interleaved by llama.cpp are interleaved again (``gate_up_proj``
        ``[E, H, 2I]``, its bias ``[E, 2I]``), the stacked weights stored inputs first; read
        only where wanted (the weights are gigabytes, ``--weights full`` only)."""
        import gguf

        m = _GPT_OSS_EXPERTS.match(t.name)
        assert m is not None
        block, role, part = m[1], m[2], m[3]
        stacked = "gate_up_proj" if role in ("gate", "up") else "down_proj"
        name = f"model.layers.{block}.mlp.experts.{stacked}" + ("_bias" if part == "bias" else "")
        if not keep(name):
            return
        values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(self._read(t), t.type),
                                                       dtype=np.float32))
        if part == "weight":
            values = values.transpose(1, 2)  # [E, out, in] -> inputs first
        if role == "down":
            yield TensorSource(name, t.name, t.type.name, tuple(values.shape), self, whole=values.contiguous())
            return
        other = held.pop(f"{block}.{part}", None)
        if other is None:
            held[f"{block}.{part}"] = (role, values)
            return
        gate, up = (other[1], values) if other[0] == "gate" else (values, other[1])
        both = torch.stack([gate, up], dim=-1).flatten(-2)  # gate at even outputs, up at odd
        yield TensorSource(name, t.name, t.type.name, tuple(both.shape), self, whole=both)

    def read_rows(self, gguf_name: str) -> Iterator[tuple[int, np.ndarray]]:
        t = self._tensors[gguf_name]
        rows = t.shape[0]
        step = max(1, ROW_CHUNK_ELEMENTS // max(1, t.cols))
        for first in range(0, rows, step):
            yield first, self._read(t, first, min(rows, first + step))

    def _read(self, t: StoredTensor, first: int = 0, end: int | None = None) -> np.ndarray:
        """Rows ``first:end`` of a tensor (all of it by default) as the reader types them."""
        shape = t.shape if end is None else (end - first, *t.shape[1:])
        out = np.empty(shape, dtype=t.dtype)
        row_bytes = out[0].nbytes if first else 0
        view = memoryview(out.data).cast("B")
        done, offset = 0, t.offset + first * row_bytes
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise ModelLoadError(f"{self.path} ends inside tensor {t.name}")
            done += n
        return out

    def _row_map(self, t: StoredTensor) -> tuple[str | None, torch.Tensor | None] | None:
        """What the processor does to a 2-D tensor, if no more than rename it and reorder its
        rows: ``(HF name or None to drop it, row order or None)``; None otherwise. Found on a
        probe of two columns numbering the elements."""
        rows = t.shape[0]
        probe = np.arange(2 * rows, dtype=np.float64).reshape(rows, 2)
        side: dict[str, Any] = {}
        try:
            result = self.processor.process(weights=probe, name=t.name, tensor_key_mapping=self.key_map,
                                            parsed_parameters={"tensors": side})
        except Exception:
            return None
        got = np.asarray(result.weights)
        if side or result.name is None or got.shape != probe.shape or not np.array_equal(got[:, 1], got[:, 0] + 1):
            return None
        perm = got[:, 0] / 2
        if not np.array_equal(np.sort(perm), np.arange(rows)):
            return None
        name = self.key_map.get(result.name)
        identity = np.array_equal(perm, np.arange(rows))
        return name, None if identity else torch.from_numpy(perm.astype(np.int64))


class ShardWriter:
    """Writes tensors into safetensors files of at most ``max_bytes`` each (a bigger tensor
    gets one of its own), each saved from only its own tensors. ``close`` names them as
    ``save_pretrained`` does: one file ``model.safetensors``, or ``model-0000k-of-0000n``
    files and their index.

    The tensors of a shard are views of one buffer, reused from shard to shard: tensors
    allocated and freed one by one would leave the heap fragmented (glibc keeps what it
    cannot trim), and memory would grow past one shard."""

    ALIGN = 64

    def __init__(self, out_dir: Path, max_bytes: int = SHARD_BYTES) -> None:
        self.out_dir = out_dir
        self.max_bytes = max_bytes
        self._buffer: torch.Tensor | None = None
        self._shard: dict[str, torch.Tensor] = {}
        self._used = 0
        self._files: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_bytes = 0

    def slot(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor that will be written as ``name``: fill it before the next
        call (the shard it is in may be written out then)."""
        if name in self._names:
            raise ModelLoadError(f"tensor {name} converted twice")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._shard and start + nbytes > self.max_bytes:
            self._flush()
            start = 0
        if nbytes > self.max_bytes:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            if self._buffer is None:
                self._buffer = torch.empty(self.max_bytes, dtype=torch.uint8)
            tensor = self._buffer[start:start + nbytes].view(dtype).view(shape)
        self._used = start + nbytes
        self._shard[name] = tensor
        self._names.add(name)
        self.total_bytes += nbytes
        return tensor

    def close(self, empty: bool = False) -> list[Path]:
        """Name the files written; ``empty``: none may be (else an error)."""
        if self._shard:
            self._flush()
        self._buffer = None
        n = len(self._files)
        if n == 0:
            if empty:
                return []
            raise ModelLoadError("no tensors to write")
        final = [self.out_dir / (SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors")
                 for k in range(n)]
        for (path, _), target in zip(self._files, final, strict=True):
            path.rename(target)
        if n > 1:
            weight_map = {name: target.name for (_, names), target in zip(self._files, final, strict=True)
                          for name in names}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return final

    def _flush(self) -> None:
        path = self.out_dir / f"model-{len(self._files) + 1:05d}.safetensors.partial"
        save_safetensors(self._shard, path, {"format": "pt"})
        self._files.append((path, list(self._shard)))
        self._shard, self._used = {}, 0


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, its I/O errors (a full disk) raised as ``OSError``:
    the artifact store takes those for its directory failing and loads without it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as exc:
        raise OSError(f"could not write {path}: {exc}") from exc


def write_dense(source: GgufFile, out_dir: Path, dtype: torch.dtype, *, shard_bytes: int = SHARD_BYTES,
                on_tensor: Callable[[], None] | None = None, skip: frozenset[str] = frozenset()) -> list[str]:
    """Write the weights of ``source`` in ``dtype`` as safetensors shards into ``out_dir``,
    but those named in ``skip``; returns the HF names written."""
    writer = ShardWriter(out_dir, shard_bytes)
    written = []
    for t in source.tensors(wanted=lambda name: name not in skip):
        t.fill(writer.slot(t.name, t.shape, dtype))
        written.append(t.name)
        if on_tensor is not None:
            on_tensor()
    writer.close()
    missing = sorted(set(source.model.state_dict()) & source.names - set(written) - skip)
    if missing:  # transformers initialises them anew, loading the GGUF or the entry
        log.warning("%s holds no tensor for %s", source.path.name, ", ".join(missing))
    return written


def quantize_streamed(source: GgufFile, mode: str, *,
                      on_tensor: Callable[[], None] | None = None) -> dict[str, QuantizedWeight]:
    """The quantized weights of every linear ``mode`` quantizes, by module name (the set
    ``quantization.quantize_linears`` gives for the loaded model)."""
    out: dict[str, QuantizedWeight] = {}
    for name, q in iter_quantized(source, mode):
        out[name] = q
        if on_tensor is not None:
            on_tensor()
    return out


def iter_quantized(source: GgufFile, mode: str) -> Iterator[tuple[str, QuantizedWeight]]:
    """``quantize_streamed`` one linear at a time, in file order: (module name, weights);
    also the input embedding under its module name where it is stored in one of
    ``EXACT_EMBEDDING_TYPES`` (its own blocks, whatever ``mode``)."""
    linears = source.linears(mode)
    embedding = source.embedding()
    done: set[str] = set()
    for t in source.tensors(wanted=lambda n: n in linears or (embedding is not None and n == embedding[0])):
        if embedding is not None and t.name == embedding[0] and t.exact_int4:
            yield embedding[1], t.quantized("int4")
        if t.name not in linears:
            continue
        name, kind = linears[t.name]
        done.add(name)
        yield name, t.quantized(kind)
    for weight, (name, _) in linears.items():
        if name not in done:
            raise ModelLoadError(f"{source.path.name} holds no tensor for {weight}")
    yield from source.expert_linears(mode)


def write_quantized(weights: Iterable[tuple[str, QuantizedWeight]], out_dir: Path, *,
                    shard_bytes: int = SHARD_BYTES, on_tensor: Callable[[], None] | None = None,
                    layout: PanelLayout | None = None, keep_rows: Container[str] = ()) -> tuple[int, int]:
    """Write quantized linears as they come, holding one shard and one linear: those ``layout``
    keeps as panels packed into its file (``artifacts/panels.py``; not those in ``keep_rows``,
    e.g. an input embedding), the rest as safetensors shards (``QuantizedWeight.to_tensors``
    names). Returns (linears, bytes)."""
    writer = ShardWriter(out_dir, shard_bytes)
    count = nbytes = 0
    with contextlib.ExitStack() as stack:
        panels = stack.enter_context(PanelWriter(out_dir)) if layout is not None else None
        for name, q in weights:
            packed = layout.pack(q) if layout is not None and name not in keep_rows else None
            if panels is not None and packed is not None:
                panels.add(name, packed)
                nbytes += packed.nbytes
            else:
                for key, value in q.to_tensors(name).items():
                    writer.slot(key, tuple(value.shape), value.dtype).copy_(value)
                nbytes += q.nbytes
            count += 1
            if on_tensor is not None:
                on_tensor()
        writer.close(empty=panels is not None and bool(panels.index))
    return count, nbytes


def int4_from_blocks(raw: np.ndarray, gguf_type: str) -> QuantizedWeight:
    """Rows of Q4_0 / Q4_1 / Q4_K blocks (uint8 ``[rows, bytes]``) as int4 groups of 32,
    value for value: Q4_0 ``(q - 8) * d`` is scale ``d``, offset ``-8d``; Q4_1 ``q * d + m``
    is scale ``d``, offset ``m``; a Q4_K 32-value sub-block ``q * d * sc - dmin * m`` is scale
    ``d * sc``, offset ``-dmin * m`` (6-bit ``sc``, ``m`` decoded by the gguf package), those
    products rounded to float16 as int4 keeps them (Q4_0's and Q4_1's are float16 already)."""
    import gguf

    rows = raw.shape[0]
    if gguf_type == "Q4_K":
        blocks = raw.reshape(-1, 144)
        d = _half(blocks[:, 0:2])
        dmin = _half(blocks[:, 2:4])
        sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scales = d * sc.astype(np.float32)
        offsets = -(dmin * mins.astype(np.float32))
        # 4 runs of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        values = np.concatenate([qs & 0xF, qs >> 4], axis=2)
    else:
        size, head = (18, 2) if gguf_type == "Q4_0" else (20, 4)
        blocks = raw.reshape(-1, size)
        scales = _half(blocks[:, 0:2])
        offsets = -8 * scales if gguf_type == "Q4_0" else _half(blocks[:, 2:4])
        values = _block_values(blocks[:, head:])
    packed = _as_int4_nibbles(values.reshape(rows, -1))
    return QuantizedWeight("int4", torch.from_numpy(packed),
                           torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1), dtype=np.float16)),
                           torch.from_numpy(np.ascontiguousarray(offsets.reshape(rows, -1), dtype=np.float16)),
                           INT4_GROUP)


def mxfp4_from_blocks(raw: np.ndarray) -> QuantizedWeight:
    """Rows of MXFP4 blocks (uint8 ``[rows, bytes]``: per 32 values an E8M0 byte, then 16
    bytes whose low nibbles are codes 0..15 and high nibbles 16..31) as kvcellar's ``mxfp4``
    weight, code for code: the nibbles regrouped as int4's (input 2j low, 2j + 1 high)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, 17)
    packed = _as_int4_nibbles(_block_values(blocks[:, 1:]).reshape(rows, -1))
    return QuantizedWeight("mxfp4", torch.from_numpy(packed),
                           torch.from_numpy(np.ascontiguousarray(blocks[:, 0].reshape(rows, -1))), None, MXFP4_GROUP)


def _block_values(qs: np.ndarray) -> np.ndarray:
    """A 32-value block's 16 bytes (Q4_0, Q4_1, MXFP4) as its values in order: the low
    nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _as_int4_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit values ``[rows, cols]`` packed as kvcellar's int4 (input 2j low, 2j + 1 high)."""
    return np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4))


def _interleaved(a: QuantizedWeight, b: QuantizedWeight) -> QuantizedWeight:
    """Rows of ``a`` and ``b`` alternating (a's at even rows): each row is quantized on its own,
    so any row order keeps every value."""

    def mix(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None or y is None else torch.stack([x, y], dim=1).flatten(0, 1)

    if (a.kind, a.group_size) != (b.kind, b.group_size):
        raise ModelLoadError("gate and up projections of an expert are quantized differently")
    qweight, scales = mix(a.qweight, b.qweight), mix(a.scales, b.scales)
    assert qweight is not None and scales is not None
    return QuantizedWeight(a.kind, qweight, scales, mix(a.offsets, b.offsets), a.group_size)


def _half(two_bytes: np.ndarray) -> np.ndarray:
    """The fp16 numbers stored in ``[n, 2]`` bytes, as float32 ``[n, 1]``."""
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32)


def _empty_like_rows(part: QuantizedWeight, rows: int) -> QuantizedWeight:
    """An uninitialised weight of ``rows`` rows, quantized as ``part`` is."""

    def like(t: torch.Tensor) -> torch.Tensor:
        return torch.empty((rows, *t.shape[1:]), dtype=t.dtype)

    return QuantizedWeight(part.kind, like(part.qweight), like(part.scales),
                           None if part.offsets is None else like(part.offsets), part.group_size)


def _from_numpy(weights: Any) -> torch.Tensor:
    if isinstance(weights, torch.Tensor):
        return weights
    arr = np.ascontiguousarray(weights)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


QWEN35_ARCHITECTURES = ("qwen35", "qwen35moe")
# llama.cpp's Qwen3.5 names of a layer's tensors -> transformers' (the stacked experts' without
# ".weight", as transformers' MoE processors look them up).
_QWEN35_LEAVES = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight", "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_QWEN35_GLOBALS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
# Zero-centred RMS norms llama.cpp stores as ``w + 1`` (not the linear attention's gated one).
_QWEN35_OFFSET_NORMS = frozenset({"attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                                  "attn_k_norm.weight", "output_norm.weight"})


def qwen35_key_map(names: Iterable[str], layers: int) -> dict[str, str]:
    """GGUF -> HF names of a Qwen3.5 file's tensors; its blocks from ``layers`` on (the
    multi-token-prediction block, which transformers' model does not have) left out."""
    out: dict[str, str] = {}
    for name in names:
        if name in _QWEN35_GLOBALS:
            out[name] = _QWEN35_GLOBALS[name]
            continue
        m = _BLOCK.match(name)
        if m is None or int(m[1]) >= layers:
            continue
        leaf = name[m.end():]
        if leaf in _QWEN35_LEAVES:
            out[name] = f"model.layers.{m[1]}.{_QWEN35_LEAVES[leaf]}"
        elif leaf.removesuffix(".weight") in _QWEN35_LEAVES:  # stacked experts
            out[name.removesuffix(".weight")] = f"model.layers.{m[1]}.{_QWEN35_LEAVES[leaf.removesuffix('.weight')]}"
    return out


def _grouped_order(key_heads: int, per_key: int, size: int) -> np.ndarray:
    """The row order that takes llama.cpp's tiled value heads (``v0k0 v0k1 v1k0 ...``, ``size``
    rows each) to transformers' grouped ones (every value head of key head 0 first)."""
    tiled_from_grouped = np.arange(key_heads * per_key * size).reshape(key_heads, per_key, size)
    return np.argsort(tiled_from_grouped.transpose(1, 0, 2).reshape(-1), kind="stable")


@functools.cache
def _qwen35_processor_class() -> type:
    """``Qwen35TensorProcessor``'s class, made on first use (transformers' GGUF module is not
    imported before a GGUF is converted)."""
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, Qwen2MoeTensorProcessor

    class Qwen35TensorProcessor(Qwen2MoeTensorProcessor):  # type: ignore[misc]
        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__(config=config)
            k, v = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
            self.qk_rows = 2 * k * int(config["linear_key_head_dim"])
            self.values = _grouped_order(k, v // k, int(config["linear_value_head_dim"]))
            self.heads = _grouped_order(k, v // k, 1)

        def process(self, weights: Any, name: str, **kwargs: Any) -> Any:
            m = _BLOCK.match(name)
            leaf = name[m.end():] if m else name
            if leaf in _QWEN35_OFFSET_NORMS:
                weights = (np.asarray(weights, dtype=np.float32) - 1).astype(np.asarray(weights).dtype)
            elif leaf == "ssm_a":  # torch's log, as transformers takes it (numpy's rounds otherwise)
                weights = torch.log(-torch.from_numpy(np.asarray(weights, dtype=np.float32))).numpy()[self.heads]
            elif leaf in ("ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight"):
                weights = weights[self.heads]
            elif leaf == "attn_gate.weight":
                weights = weights[self.values]
            elif leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
                weights = np.concatenate([weights[: self.qk_rows], weights[self.qk_rows:][self.values]])
                if leaf == "ssm_conv1d.weight":
                    weights = weights[:, None, :]
            elif leaf == "ssm_out.weight":
                weights = weights[:, self.values]
            elif leaf == "ffn_gate_inp_shexp.weight":
                weights = np.reshape(weights, (1, -1))
            else:
                return super().process(weights, name, **kwargs)
            return GGUFTensor(weights, name, {})

    return Qwen35TensorProcessor


def qwen35_processor(config: dict[str, Any]) -> Any:
    """What transformers' conversion mapping for ``qwen35``/``qwen35moe`` does to a tensor of
    llama.cpp's file, as a tensor processor, one tensor at a time: norms back from ``w + 1``,
    ``A_log`` from ``-exp(A_log)``, the convolution unsqueezed, the value heads' rows (or
    ``out_proj``'s columns) from tiled to grouped order; the routed experts stacked as
    transformers' qwen3moe processor stacks them."""
    return _qwen35_processor_class()(config)


def _block(gguf_name: str) -> int | None:
    m = _BLOCK.match(gguf_name)
    return int(m.group(1)) if m else None


def _weights_map(model: Any, processor: Any) -> dict[str, str]:
    """transformers' GGUF -> HF name map (``get_gguf_hf_weights_map``). It builds gguf's name
    table anew for every submodule, slowly: the same table, memoized while it runs."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        mapping: dict[str, str] = get_gguf_hf_weights_map(model, processor)
        return mapping
    finally:
        gguf.get_tensor_name_map = build


def _converted_by_mapping(architecture: str) -> bool:
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:
        return False
    return bool(is_gguf_arch_supported(architecture))

