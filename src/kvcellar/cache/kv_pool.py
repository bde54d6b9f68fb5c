"""The KV block pool: one preallocated tensor holding every layer's K and V, in blocks.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block-major, so
one block (all layers, K and V) is a single contiguous region. That makes saving a block
to a lower tier one copy and loading one ``readinto`` straight into the pool; gathering a
sequence's blocks for one layer is an ``index_select`` over the block dimension of a
strided view, measured as fast as a layer-major layout here.

Quantized KV (``kv_bits`` 8 or 4, as mlx-lm's ``--kv-bits``): each group of
``kv_group_size`` values along the head dimension is stored as ``kv_bits``-bit integers with
float16 parameters: 8 bits symmetric, ``x = q * scale`` (q in -127..127; an offset would cost
6 % of the bytes and win little at 255 levels), 4 bits min/max affine, ``x = q * scale +
offset`` (q in 0..15). A block is then bytes, ``[num_layers, 2, layer_bytes]``: per layer
and K/V, the packed values ``[block_size, kv_heads, head_dim * bits / 8]`` then the
parameters ``[block_size, kv_heads, groups, 1 or 2]``; still one contiguous region, so the
tiers move it as they move any block.
Models whose layers differ in KV heads or head size (Gemma 4: wider heads, fewer of them, on
its global layers) give each layer its own ``layer_shapes``; every layer keeps a region of the
widest layer's size and a narrower one fills its start (``[block_size, its kv_heads, its
head_dim]``, packed values then parameters when quantized), so a block stays one region of one
size and a layer's place in it one product.
Attention reads a step's blocks dequantized (``gather``): no full-precision copy of the
cache exists. Every token's K/V is read back from the pool, its own step's too, so the KV a
request attends to is the quantized KV whoever computed it: a cache hit gives what
recomputing gives under the same setting.

Keys are stored after RoPE (the model applies it before attention). The pool is zeroed at
allocation: masked-out positions must hold finite values (0 x NaN is NaN in softmax @ V).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcellar import pages
from kvcellar.errors import ModelLoadError

_PAGE_BYTES = 4096  # the smallest page a mapping has: touch writes one byte each

KV_BITS = (16, 8, 4)
DEFAULT_KV_GROUP_SIZE = 64
_PARAM_DTYPE = torch.float16  # scale and offset of a group
_PARAM_MAX = 65504.0  # float16's largest finite value


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_bits: int = 16
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    # Per layer (kv_heads, head_dim) where layers differ; () where every layer has
    # ``num_kv_heads`` x ``head_dim`` (then the widest layer's, which sizes every region).
    layer_shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, not {self.kv_bits}")
        if self.layer_shapes and len(self.layer_shapes) != self.num_layers:
            raise ValueError(f"{len(self.layer_shapes)} layer shapes for {self.num_layers} layers")
        if any(h * d > self.num_kv_heads * self.head_dim for h, d in self.layer_shapes):
            raise ValueError("a layer's KV is wider than the region each layer has")
        for _, head_dim in self.layer_shapes or ((self.num_kv_heads, self.head_dim),):
            if self.quantized and (self.kv_group_size < 2 or head_dim % self.kv_group_size):
                raise ValueError(f"kv_group_size {self.kv_group_size} must divide the head dimension {head_dim}")

    def heads(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s (kv_heads, head_dim)."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads, self.head_dim)

    def layer_values_bytes(self, layer: int) -> int:
        """Bytes of layer ``layer``'s packed K (or V) values in a block (quantized KV); its
        parameters follow them."""
        kv_heads, head_dim = self.heads(layer)
        return self.block_size * kv_heads * head_dim * self.kv_bits // 8

    @property
    def quantized(self) -> bool:
        return self.kv_bits < 16

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The KV a block holds, as attention sees it."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def packed_dim(self) -> int:
        """Bytes of one head's packed values (quantized KV)."""
        return self.head_dim * self.kv_bits // 8

    @property
    def groups(self) -> int:
        return self.head_dim // self.kv_group_size

    @property
    def params_per_group(self) -> int:
        """float16 parameters of a group: a scale (8 bits), a scale and an offset (4 bits)."""
        return 1 if self.kv_bits == 8 else 2

    @property
    def values_bytes(self) -> int:
        """Bytes of one layer's packed K (or V) values in a block (quantized KV)."""
        return self.block_size * self.num_kv_heads * self.packed_dim

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """A block as stored: ``block_shape`` in ``dtype``, or bytes when quantized."""
        if not self.quantized:
            return self.block_shape
        params = self.block_size * self.num_kv_heads * self.groups * self.params_per_group * _PARAM_DTYPE.itemsize
        return (self.num_layers, 2, self.values_bytes + params)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    @property
    def bytes_per_block(self) -> int:
        n = 1
        for d in self.storage_shape:
            n *= d
        return n * self.storage_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @classmethod
    def from_model_config(cls, config: Any, block_size: int, dtype: torch.dtype, kv_bits: int = 16,
                          kv_group_size: int = DEFAULT_KV_GROUP_SIZE) -> KVLayout:
        text = getattr(config, "get_text_config", lambda: config)()
        shapes = layer_shapes(text)
        layers = attention_layers(text)
        if len(set(shapes)) > 1:  # the regions sized for the widest layer
            kv_heads, head_dim = max(shapes, key=lambda s: (s[0] * s[1], s[1]))
            return cls(layers, kv_heads, head_dim, block_size, dtype, kv_bits, kv_group_size, tuple(shapes))
        kv_heads, head_dim = shapes[0]
        return cls(layers, kv_heads, head_dim, block_size, dtype, kv_bits, kv_group_size)


def attention_layers(text: Any) -> int:
    """The layers that keep KV: all, but for a hybrid model's linear-attention layers (their
    state is ``cache/state_pool.py``'s), which the pool leaves out."""
    types = getattr(text, "layer_types", None) or ()
    layers = int(text.num_hidden_layers) - sum(1 for t in types if t == "linear_attention")
    if layers <= 0:
        raise ModelLoadError(f"this model's {text.num_hidden_layers} layers are all linear attention; kvcellar "
                             "serves hybrids with at least one attention layer (its blocks name the cached prefixes)")
    return layers


def layer_shapes(text: Any) -> list[tuple[int, int]]:
    """Per layer (kv_heads, head_dim) of a text config: one shape for all, or each layer's own
    where a config gives layers their own (transformers' ``per_layer_config``: Gemma 4's
    global layers have wider heads, fewer of them)."""
    per_layer = getattr(text, "per_layer_config", None)
    layers = [per_layer[i] for i in range(text.num_hidden_layers)] if per_layer else [text]
    shapes = []
    for layer in layers:
        heads = layer.num_attention_heads
        shapes.append((int(getattr(layer, "num_key_value_heads", None) or heads),
                       int(getattr(layer, "head_dim", None) or layer.hidden_size // heads)))
    return shapes * (text.num_hidden_layers if not per_layer else 1)


def quantize_kv(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., head_dim]`` as packed ``bits``-bit values ``[..., head_dim * bits / 8]``
    (uint8 bytes; 8-bit: int8 ``round(x / scale)``; 4-bit: ``round((x - offset) / scale)``
    in 0..15, element 2i in the low nibble of byte i, 2i + 1 in the high one) and float16
    parameters per group of ``group_size``: ``[..., groups, 1]`` (scale) for 8 bits,
    ``[..., groups, 2]`` (scale, offset) for 4. Every value comes back within half a step
    (plus, at 4 bits, the float16 rounding of the offset): the values are computed against
    the rounded parameters."""
    *lead, dim = x.shape
    g = x.float().reshape(*lead, dim // group_size, group_size).clamp(-_PARAM_MAX, _PARAM_MAX)
    if bits == 8:
        scale = (g.abs().amax(dim=-1, keepdim=True) / 127).to(_PARAM_DTYPE)
        step = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
        q = (g / step).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        return q.reshape(*lead, dim), scale
    levels = (1 << bits) - 1
    low = g.amin(dim=-1, keepdim=True)
    high = g.amax(dim=-1, keepdim=True)
    offset = low.to(_PARAM_DTYPE)
    scale = ((high - low) / levels).to(_PARAM_DTYPE)
    step = torch.where(scale > 0, scale.float(), torch.ones_like(low))
    q = ((g - offset.float()) / step).round_().clamp_(0, levels).to(torch.uint8).reshape(*lead, dim)
    return q[..., 0::2] | (q[..., 1::2] << 4), torch.cat([scale, offset], dim=-1)


def dequantize_kv(q: torch.Tensor, params: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_kv``: ``[..., head_dim]`` in ``dtype``, computed in ``dtype``
    in place (this runs for every block a step reads: the fewest passes measured fastest)."""
    q = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2) if bits == 4 else q.view(torch.int8)
    *lead, dim = q.shape
    groups = params.shape[-2]
    g = q.reshape(*lead, groups, dim // groups).to(dtype)
    p = params.to(dtype)
    g.mul_(p[..., 0:1])
    if bits == 4:
        g.add_(p[..., 1:2])
    return g.reshape(*lead, dim)


# A faster ``gather`` of quantized KV, given by the engine where it has one (kvcellar's CPU
# kernels): (pool data, layout, layer, 0 for K or 1 for V, int64 block ids) -> the blocks'
# ``[n * block_size, kv_heads, head_dim]`` in ``layout.dtype``, exactly ``dequantize_kv``'s.
QuantizedGather = Callable[[torch.Tensor, KVLayout, int, int, torch.Tensor], torch.Tensor]
# Quantizing rows into the pool in one pass, given likewise: (pool data, layout, layer, 0 for K
# or 1 for V, block ids [n], offsets [n], rows [n, kv_heads, head_dim]), exactly ``write``'s.
QuantizedWrite = Callable[[torch.Tensor, KVLayout, int, int, torch.Tensor, torch.Tensor, torch.Tensor], None]
# Attention of one query position per sequence over the blocks where they lie, given by the
# engine where it has a kernel for the layout: (pool data, layout, layer, block tables [n, w],
# contexts [n], q [n, kv_heads, groups, head_dim], scale, threads (0: torch's count)) ->
# [n, kv_heads, groups, head_dim].
DirectAttend = Callable[[torch.Tensor, KVLayout, int, torch.Tensor, torch.Tensor, torch.Tensor, float, int,
                         torch.Tensor | None, torch.Tensor | None, int], torch.Tensor]


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device,
                 gather_quantized: QuantizedGather | None = None,
                 attend_direct: DirectAttend | None = None,
                 write_quantized: QuantizedWrite | None = None) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self._gather_quantized = gather_quantized if layout.quantized else None
        self._attend_direct = attend_direct
        self._write_quantized = write_quantized if layout.quantized else None
        shape = (num_blocks, *layout.storage_shape)
        # A decode step reads a sequence's blocks wherever they lie: 2 MB pages spare it most TLB misses.
        self.data = (pages.empty(shape, layout.storage_dtype) if device.type == "cpu"
                     else torch.zeros(shape, dtype=layout.storage_dtype, device=device))
        lay = layout
        if layout.quantized:
            # Views, per layer: values [num_blocks, block_size, kv_heads, packed_dim] and
            # params [num_blocks, block_size, kv_heads, groups, 1 or 2] of K and of V.
            self._qk: list[torch.Tensor] = []
            self._qv: list[torch.Tensor] = []
            self._pk: list[torch.Tensor] = []
            self._pv: list[torch.Tensor] = []
            for i in range(lay.num_layers):
                kv_heads, head_dim = lay.heads(i)
                values_bytes = lay.layer_values_bytes(i)
                params_bytes = lay.block_size * kv_heads * head_dim // lay.kv_group_size * lay.params_per_group * 2
                for kv, (values, params) in enumerate(((self._qk, self._pk), (self._qv, self._pv))):
                    region = self.data[:, i, kv]
                    values.append(region[:, :values_bytes].view(
                        num_blocks, lay.block_size, kv_heads, head_dim * lay.kv_bits // 8))
                    params.append(region[:, values_bytes : values_bytes + params_bytes].view(_PARAM_DTYPE).view(
                        num_blocks, lay.block_size, kv_heads, head_dim // lay.kv_group_size, lay.params_per_group))
        else:
            # Per-layer views [num_blocks, block_size, kv_heads, head_dim]; indexing them does not copy.
            self._k: list[torch.Tensor] = []
            self._v: list[torch.Tensor] = []
            for i in range(lay.num_layers):
                kv_heads, head_dim = lay.heads(i)
                width = lay.block_size * kv_heads * head_dim
                for kv, views in enumerate((self._k, self._v)):
                    region = self.data[:, i, kv].reshape(num_blocks, -1)[:, :width]
                    views.append(region.view(num_blocks, lay.block_size, kv_heads, head_dim))

    def touch(self, block_ids: list[int]) -> None:
        """Write a byte of every 4 KB page of these blocks (free ones: what they hold is nobody's),
        so that their pages are in memory before a step writes KV there: a fresh mapping's first
        write to a page faults it in, which on some virtual machines costs milliseconds a page
        (the host backs the guest's memory only then). CPU pools only."""
        if self.device.type != "cpu" or not block_ids:
            return
        flat = self.data.view(self.num_blocks, -1).view(torch.uint8)
        flat[block_ids, ::_PAGE_BYTES] = 0

    @staticmethod
    def blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return max(2, budget_bytes // layout.bytes_per_block)

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` at (block, offset) pairs."""
        lay = self.layout
        if not lay.quantized:
            self._k[layer][blocks, offsets] = key
            self._v[layer][blocks, offsets] = value
            return
        if self._write_quantized is not None and key.dtype in (torch.float32, torch.bfloat16):
            self._write_quantized(self.data, lay, layer, 0, blocks, offsets, key)
            self._write_quantized(self.data, lay, layer, 1, blocks, offsets, value)
            return
        for x, values, params in ((key, self._qk, self._pk), (value, self._qv, self._pv)):
            q, p = quantize_kv(x, lay.kv_bits, lay.kv_group_size)
            values[layer][blocks, offsets] = q
            params[layer][blocks, offsets] = p

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_table [B, n]`` as ``[B, kv_heads, n * block_size, head_dim]``
        (views of the pool; dequantized copies of those blocks alone when quantized)."""
        lay = self.layout
        b, n = block_table.shape
        flat = block_table.reshape(-1)
        shape = (b, n * lay.block_size, *lay.heads(layer))
        if not lay.quantized:
            k = self._k[layer].index_select(0, flat).view(shape).transpose(1, 2)
            v = self._v[layer].index_select(0, flat).view(shape).transpose(1, 2)
            return k, v
        if self._gather_quantized is not None:  # one pass, no copy of the packed blocks
            k = self._gather_quantized(self.data, lay, layer, 0, flat)
            v = self._gather_quantized(self.data, lay, layer, 1, flat)
            return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        k = dequantize_kv(self._qk[layer].index_select(0, flat), self._pk[layer].index_select(0, flat),
                          lay.kv_bits, lay.dtype)
        v = dequantize_kv(self._qv[layer].index_select(0, flat), self._pv[layer].index_select(0, flat),
                          lay.kv_bits, lay.dtype)
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    @property
    def attends(self) -> bool:
        """Whether ``attend`` runs here: a kernel that reads this layout's blocks."""
        return self._attend_direct is not None

    def attend(self, layer: int, block_tables: torch.Tensor, contexts: torch.Tensor, q: torch.Tensor,
               scale: float, threads: int = 0, rows: torch.Tensor | None = None,
               sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """Causal attention of ``rows[i]`` query positions per sequence (default one; ``q
        [sum(rows), kv_heads, groups, head_dim]``, the query heads of each KV head), the last
        over the first ``contexts[i]`` tokens of ``block_tables[i]``, without a gathered (or
        dequantized) copy of the context, on ``threads`` threads (0: torch's count). A
        position's result does not depend on the other positions of the call. Only where
        ``attends``. ``sinks``: per query head, an attention sink's logit (gpt-oss); ``window``:
        each position sees its last ``window`` keys (0: all)."""
        assert self._attend_direct is not None
        return self._attend_direct(self.data, self.layout, layer, block_tables, contexts, q, scale, threads, rows,
                                   sinks, window)

    def copy_block(self, src: int, dst: int) -> None:
        self.data[dst].copy_(self.data[src])

    def block(self, block_id: int) -> torch.Tensor:
        """One block's storage (all layers, K and V), a contiguous view."""
        return self.data[block_id]
