"""A dense decoder's layers on kvcellar's kernels, all of a step's in one call (``layer.c``), and
the gated MLP's act, silu, on the kernels for the steps that run it in torch (``silu_for``).

The call runs the operations the lean forward runs for a Llama/Qwen2 layer, rounded where
torch rounds them, so a step gives the same bits either way (tested); it takes decode and
verification-sized steps, where Python between the kernels cost about a tenth of a token."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcellar.cache.kv_pool import KVPool
from kvcellar.engine.native import lib
from kvcellar.engine.native.kv import attends_kv, gathers_kv, regions

# Steps of up to this many rows take the one call (decodes, drafts' verification); a prompt's
# chunk spends its time in the linears, and its scratch would be the size of its activations.
MAX_ROWS = 64
ACTIVATIONS = (torch.float32, torch.bfloat16)


# The act modules that are silu (transformers' names), which ``silu_for`` stands in for.
SILU_ACTS = frozenset({"SiLUActivation", "SiLU"})


def silu_for(otherwise: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """silu on the kernels (``x / (1 + exp(-x))`` by their exp, rounded to ``x``'s dtype): the
    act of every step a gated MLP runs in torch, so its numbers are those of ``layer.c``'s
    layers. None where the kernels are not here; ``otherwise(x)`` for an input they do not take
    (another device or dtype, a size not in 8s) or once the library is gone."""
    if not lib.available():
        return None

    def silu(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in ACTIVATIONS or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] % 8 \
                or not lib.available():
            return otherwise(x)
        cols = x.shape[-1]
        rows = x.reshape(-1, cols)  # a view where it can be (the gate half of a fused gate-up)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        lib.call("kvc_silu", x=rows.data_ptr(), bf16=int(x.dtype == torch.bfloat16), rows=rows.shape[0], cols=cols,
                 stride=rows.stride(0) if rows.shape[0] > 1 else cols, out=out.data_ptr(),
                 threads=torch.get_num_threads())
        return out

    return silu


def _float_bits(value: float) -> int:
    bits: int = struct.unpack("<i", struct.pack("<f", value))[0]
    return bits


@dataclass
class DenseLayer:
    """One layer's parts as ``layer.c`` takes them: its linears' ``kvc_linear`` specs and biases
    (``FastLinear.kernel_spec``), the norms' float32 weights."""

    q_heads: int
    kv_heads: int
    head_dim: int
    inner: int
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    scale: float
    # qkv, o, gate_up, down: kvc_linear's spec, what keeps its addresses, each part's bias
    linears: tuple[tuple[torch.Tensor, Any, list[torch.Tensor | None]], ...]
    # Qwen3: each query and key head RMS-normalized before RoPE (float32 weights, eps)
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def __post_init__(self) -> None:
        self.biases = [torch.tensor([0 if b is None else b.data_ptr() for b in biases], dtype=torch.int64)
                       for _, _, biases in self.linears]


class DenseLayers:
    """A model's dense layers run by ``kvc_dense_layers``: the spec built once per KV pool."""

    def __init__(self, layers: Sequence[DenseLayer], hidden: int, dtype: torch.dtype) -> None:
        self.layers = list(layers)
        self.hidden = hidden
        self.dtype = dtype
        self._pool: KVPool | None = None
        self._spec: torch.Tensor | None = None

    def takes(self, pool: KVPool, rows: int) -> bool:
        """Whether a step of ``rows`` rows over ``pool`` runs here."""
        return 0 < rows <= MAX_ROWS and self.spec_for(pool) is not None

    def spec_for(self, pool: KVPool) -> torch.Tensor | None:
        if pool is not self._pool:
            self._pool, self._spec = pool, self._build(pool)
        return self._spec

    def _build(self, pool: KVPool) -> torch.Tensor | None:
        layout = pool.layout
        if not pool.attends or not attends_kv(layout, pool.device) or layout.dtype != self.dtype \
                or (layout.quantized and not gathers_kv(layout, pool.device)):
            return None
        rows: list[list[int]] = []
        for i, layer in enumerate(self.layers):
            if layout.heads(i) != (layer.kv_heads, layer.head_dim):
                return None
            k_region, v_region, values_bytes, _ = regions(layout, i)
            q_norm, k_norm, qk_eps = layer.head_norms or (None, None, 0.0)
            head_norms = [0 if q_norm is None else q_norm.data_ptr(), 0 if k_norm is None else k_norm.data_ptr(),
                          _float_bits(qk_eps)]
            linears = [x for (spec, _, _), biases in zip(layer.linears, layer.biases, strict=True)
                       for x in (spec.data_ptr(), biases.data_ptr())]
            rows.append([self.hidden, layer.q_heads, layer.kv_heads, layer.head_dim, layer.inner,
                         layer.in_norm.data_ptr(), layer.post_norm.data_ptr(), _float_bits(layer.eps), *linears,
                         k_region, v_region, values_bytes, _float_bits(layer.scale), 0, *head_norms])
        if any(len(r) != int(lib.call("kvc_layer_fields") or 0) for r in rows):
            raise RuntimeError("layer.c and native/layer.py disagree on a layer's spec")
        return torch.tensor(rows, dtype=torch.int64)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any) -> None:
        """``h [1, rows, hidden]`` through every layer in place; ``cos``/``sin`` the rotary
        module's ``[1, rows, head_dim]``; ``meta`` the step's ``StepMeta``."""
        pool: KVPool = meta.pool
        spec = self.spec_for(pool)
        assert spec is not None and h.is_contiguous() and h.dtype == self.dtype
        layout = pool.layout
        tables, contexts, seq_rows = meta.direct_batch()
        cos, sin = cos.contiguous(), sin.contiguous()
        blocks, offsets = meta.slot_blocks.contiguous(), meta.slot_offsets.contiguous()
        _, _, _, bits = regions(layout, 0)
        status = lib.call(
            "kvc_dense_layers", spec=spec.data_ptr(), layers=len(self.layers), h=h.data_ptr(),
            bf16=int(h.dtype == torch.bfloat16), rows=h.shape[1], cos=cos.data_ptr(), sin=sin.data_ptr(),
            pool=pool.data.data_ptr(), n_blocks=pool.data.shape[0], block_size=layout.block_size,
            block_bytes=layout.bytes_per_block, group=layout.kv_group_size, bits=bits, slot_blocks=blocks.data_ptr(),
            slot_offsets=offsets.data_ptr(), tables=tables.data_ptr(), table_width=tables.shape[1],
            contexts=contexts.data_ptr(), seq_rows=seq_rows.data_ptr(), n_seq=contexts.shape[0],
            attend_threads=meta.attend_threads or torch.get_num_threads(), threads=torch.get_num_threads())
        if status == -1:
            raise MemoryError("no memory for the layers' scratch")
        if status != 0:
            raise IndexError("a slot outside the pool, a context longer than its block table, or a layer it cannot run")
