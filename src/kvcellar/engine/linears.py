"""The model's linears as kvcellar runs them: prepacked, fused, quantized.

* dense weights are prepacked for oneDNN where that is faster (bf16 on a CPU with native
  bf16; fp32 stays on ``F.linear``; docs/performance.md);
* a quantized linear runs its int8/int4 kernel for every step, whatever its row count, and
  keeps no dense copy ("lean"). A token's numbers must not depend on the step it runs in
  (a cache hit computes a prompt's last tokens in a small step, a cold start in a large
  one): kvcellar's kernels (``engine/native``) give each row the same bits at every row
  count, and so do torch's int4/int8 kernels, where a dense path for large steps would round
  the activations and weights otherwise (docs/performance.md, "One arithmetic per token");
* QKV and gate-up projections of supported architectures are fused into one linear each
  (fewer calls a step, the same numbers).

``prepare_model`` does this once per model object, in place: every ``nn.Linear`` becomes a
``FastLinear`` (fused ones a ``FusedPart`` of a shared ``FastLinear``), so transformers'
own forward, kvcellar's lean forward and a test's reference all run the same numbers.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvcellar.artifacts.panels import PanelLayout
from kvcellar.engine import native
from kvcellar.quantization import QuantizedWeight, dequantize_int4

log = logging.getLogger(__name__)

# The row count oneDNN packs the weights for: packing for one row slows large prefill matmuls,
# and 64 costs decode nothing (docs/performance.md).
PACK_ROWS_HINT = 64


def native_bf16_cpu() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs_dense(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense weights are prepacked for oneDNN (see the module docstring)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native_bf16_cpu()


def quant_kernels_run(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether quantized kernels take activations of ``dtype`` here: torch's weight-only
    int8/int4 kernels bf16 on CPU, with or without native bf16 (fp32 activations run them
    3-50x slower than fp32 ``F.linear``); kvcellar's own (``engine/native``) ``int8``, the
    activations quantized to 8 bits, where they were built. On other devices the dequantized
    weights run. Whether they pay is measured (``loader.quantized_mode_pays``)."""
    if device.type != "cpu":
        return False
    return dtype == torch.bfloat16 or (dtype == torch.int8 and native.available())


# A weight in the panel layout: int4's nibbles, scales and offsets or None (``native.pack_int4``),
# or MXFP4's codes, exponents and None (``native.pack_mxfp4``).
Panels = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _int4_rows(quant: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 weight's row layout as kvcellar's kernels read it (float16 scales and offsets:
    as mapped where the entry holds them so)."""
    assert quant.offsets is not None
    return (quant.qweight.contiguous(), quant.scales.to(torch.float16).contiguous(),
            quant.offsets.to(torch.float16).contiguous())


def keeps_panels(quant: QuantizedWeight) -> bool:
    """Whether kvcellar's kernels keep ``quant``'s linear as panels (where they fit): int4 and
    MXFP4 weights in groups of the kernels' block, rows in 8s."""
    out, cols = quant.qweight.shape[0], quant.qweight.shape[1] * 2
    return (quant.kind in ("int4", "mxfp4") and quant.group_size == native.BLOCK and cols % native.BLOCK == 0
            and native.stores_panels(out))


def _rows(quant: QuantizedWeight) -> Panels:
    """A weight kept as panels in its row layout, as ``native.pack_int4``/``pack_mxfp4`` take it."""
    if quant.kind == "mxfp4":
        return quant.qweight.contiguous(), quant.scales.contiguous(), None
    return _int4_rows(quant)


def _pack(rows: Panels) -> Panels:
    """``rows`` (``_rows``) in the panel layout."""
    if rows[2] is None:  # MXFP4
        return (*native.pack_mxfp4(rows[0], rows[1], torch.get_num_threads()), None)
    return native.pack_int4(rows[0], rows[1], rows[2], torch.get_num_threads())


def row_layout(quant: QuantizedWeight) -> QuantizedWeight:
    """``quant`` in the row layout: stored panels unpacked into new tensors (exactly), else itself."""
    if not quant.panels:
        return quant
    threads = torch.get_num_threads()
    if quant.kind == "mxfp4":
        return QuantizedWeight(quant.kind, *native.unpack_mxfp4(quant.qweight, quant.scales, threads),
                               group_size=quant.group_size)
    return QuantizedWeight(quant.kind, *native.unpack_int4(quant.qweight, quant.scales, quant.offsets, threads),
                           group_size=quant.group_size)


def panel_form(quant: QuantizedWeight) -> QuantizedWeight | None:
    """``quant`` packed as this CPU's panels where kvcellar's kernels keep it so, else None."""
    if quant.panels or not keeps_panels(quant):
        return None
    return QuantizedWeight(quant.kind, *_pack(_rows(quant)), group_size=quant.group_size, panels=True)


def panel_layout() -> PanelLayout | None:
    """How the artifact cache stores the linears kvcellar's kernels keep as panels on this CPU
    (``artifacts.panels``); None where they do not run."""
    return PanelLayout(native.panel_layout(), panel_form) if native.available() else None


@dataclass
class KernelTable:
    """What every linear of one model shares about its quantized kernels."""

    # The activations' dtype in the quantized kernels; None: the model's own. bf16 under a
    # float32 model where the CPU has no native bf16 (``loader.resolve_serving``). int8:
    # kvcellar's own kernels (``engine/native``), which quantize the activations to 8 bits.
    kernel_dtype: torch.dtype | None = None
    # Whether int4 and MXFP4 weights given in the row layout are packed as panels
    # (``native.stores_panels``): where they fit ``native.panels_fit``, else they stay in the row
    # layout, mapped. Weights the artifact cache stored as panels are kept so at any size.
    panels: bool = True


# Rows of the weight dequantized at a time by a lean linear (bounds its float32 temporary).
_DEQUANT_ROWS = 1024
# Rows per block of torch's CPU int4 packing, by vector width (AVX-512: 64, AVX2: 32).
_INT4_BLOCKS = (64, 32, 16)
_scratch = threading.local()  # per thread: the engine's and a testing one never share


def _scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused buffer of at least ``numel`` elements for a lean linear's dequantized weight
    (one per thread, dtype and device: the size of the largest linear, not of the model)."""
    # An inference tensor cannot be written outside inference mode: one buffer for each.
    key = (dtype, device, torch.is_inference_mode_enabled())
    buffers: dict[tuple[torch.dtype, torch.device, bool], torch.Tensor] = getattr(_scratch, "buffers", None) or {}
    _scratch.buffers = buffers
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def release_scratch() -> None:
    """Drop this thread's scratch buffers (``FastLinear.dequantized``'s: the size of the
    largest weight dequantized on this thread)."""
    _scratch.buffers = {}


@functools.cache
def int4_pack_block() -> int:
    """The rows per block of torch's CPU int4 packing here, in the layout ``FastLinear``
    unpacks (for each input, a block's row j in the low nibble of byte j and row j + block/2
    in the high one): 64 on AVX-512, 32 on AVX2. Found on a probe once; 0 for a layout not
    known, where int4 linears keep their dense weights."""
    probe = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (2 * _INT4_BLOCKS[0], 64), dtype=torch.int32, generator=probe)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    except RuntimeError:
        return 0
    for block in _INT4_BLOCKS:
        if torch.equal(_unpack_int4(packed, 0, values.shape[0], values.shape[1], block), values.to(torch.uint8)):
            return block
    return 0


def _unpack_int4(packed: torch.Tensor, start: int, end: int, cols: int, block: int) -> torch.Tensor:
    """Rows ``start:end`` (multiples of ``block``) of the 4-bit values in torch's CPU int4 packing."""
    half = block // 2
    blocks = packed.reshape(-1)[start * cols // 2: end * cols // 2].view(-1, cols, half)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).transpose(1, 2).reshape(end - start, cols)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory aligned for the kernels' vector loads: safetensors aligns tensors to 8
    bytes only, and torch's int8 kernel faults on such a weight (SIGSEGV)."""
    return t if t.data_ptr() % 64 == 0 else t.clone(memory_format=torch.contiguous_format)


def call_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cheapest call of a linear: ``F.linear`` on a plain ``nn.Linear``'s tensors, a
    ``FastLinear``'s ``forward`` (no hooks to run, so no ``__call__``)."""
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    forward: Callable[[torch.Tensor], torch.Tensor] = module.forward
    return forward


def logits_call_of(head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``head``'s call giving float32 logits: ``head(x).float()``'s numbers (rounded to the model's
    dtype, as its output is), without the conversions there and back where kvcellar's kernel runs
    it (each one over a vocabulary woke torch's threads: ~0.1 ms a step)."""
    call = call_of(head)
    if not (isinstance(head, FastLinear) and head.native and head.bias is None and head._group is not None
            and head.dtype in (torch.float32, torch.bfloat16)):
        return lambda x: call(x).float()
    group, dtype, cols, out = head._group, head.dtype, head.in_features, head.out_features

    def logits(x: torch.Tensor) -> torch.Tensor:
        y = group(_kernel_input(x.reshape(-1, cols)), torch.get_num_threads(), torch.float32)[0]
        if dtype == torch.bfloat16:
            native.round_bf16_(y)
        return y.view(*x.shape[:-1], out)

    return logits


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """Activations as kvcellar's kernels take them: a bf16 model's as they are (no float32 copy)."""
    return x if x.dtype in native.ACTIVATION_DTYPES else x.float()


def _kernel_output(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel returns for a model of ``dtype``: bf16 where its kernel writes it, the
    same bits as the float32 result's conversion."""
    return dtype if dtype in native.ACTIVATION_DTYPES else torch.float32


def kernel_group(modules: Sequence[nn.Module]) -> native.Int4Group | native.Int8Group | None:
    """Two or more linears that take the same input as one call of kvcellar's kernels, where
    each runs the same one (int8, int4 in the same layout); None otherwise."""
    linears = [m for m in modules if isinstance(m, FastLinear) and m.native and m.quant_kind in ("int4", "int8")]
    if len(linears) < 2 or len(linears) != len(modules):
        return None
    if len({(m.in_features, m.dtype, m.quant_kind, m.panels) for m in linears}) != 1:
        return None
    if linears[0].quant_kind == "int8":
        pairs = [(m._q, m._scale) for m in linears if m._q is not None and m._scale is not None]
        return native.Int8Group(pairs, linears[0].panels) if len(pairs) == len(linears) else None
    weights = [(m._q, m._scale, m._zero) for m in linears]
    assert all(q is not None and s is not None and (z is not None or m.panels)
               for (q, s, z), m in zip(weights, linears, strict=True))
    return native.Int4Group(weights, linears[0].panels)  # type: ignore[arg-type]


def call_together(modules: Sequence[nn.Module]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """The outputs of linears that take the same input (a layer's q/k/v, gate/up), as their own
    calls give them. Where each runs kvcellar's int8 kernel, its int4 row kernel for the step
    (decode-sized steps) or int4 weights kept as panels (any step), one call computes them all
    over the input quantized once (``native.Int8Group``, ``native.Int4Group``): the threads
    wake once for them, not once a linear."""
    calls = [call_of(m) for m in modules]

    def apart(x: torch.Tensor) -> list[torch.Tensor]:
        return [call(x) for call in calls]

    group = kernel_group(modules)
    if group is None:
        return apart
    linears = [m for m in modules if isinstance(m, FastLinear)]
    outs = group.outs
    cols, dtype = linears[0].in_features, linears[0].dtype
    rows_layout = linears[0].quant_kind == "int4" and not linears[0].panels  # grouped for the row kernel only

    def together(x: torch.Tensor) -> list[torch.Tensor]:
        x2d = x.reshape(-1, cols)
        if rows_layout and any(native.int4_kernel(x2d.shape[0], out) != "kvc_gemm_q4" for out in outs):
            return apart(x)
        ys = group(_kernel_input(x2d), torch.get_num_threads(), _kernel_output(dtype))
        results = []
        for m, y in zip(linears, ys, strict=True):
            y = y.to(dtype)
            results.append((y if m.bias is None else y + m.bias).view(*x.shape[:-1], m.out_features))
        return results

    return together


_MADV_DONTNEED = 4
_file_maps: list[tuple[int, int]] = []  # address ranges of this process's file mappings, as last read


def _file_mapped(lo: int, hi: int) -> bool:
    """Whether bytes ``lo..hi`` lie in one file mapping (``/proc/self/maps`` read again only
    when the ranges last read do not hold them: a model's weights come from a few files)."""
    for fresh in (False, True):
        if fresh:
            try:
                with open("/proc/self/maps") as f:
                    lines = f.read().splitlines()
            except OSError:
                return False
            _file_maps[:] = [tuple(int(v, 16) for v in fields[0].split("-"))  # type: ignore[misc]
                             for fields in map(str.split, lines) if len(fields) >= 6 and fields[4] != "0"]
        if any(start <= lo and hi <= end for start, end in _file_maps):
            return True
    return False


def _drop_mapped_pages(tensors: Sequence[torch.Tensor]) -> None:
    """Gives back the pages of ``tensors`` that a file mapping holds (the artifact cache's
    weights, read once to pack them): loading a model would otherwise hold the file's pages
    and the packed copy at once. The file is not changed; a later read maps the pages again."""
    page = mmap.PAGESIZE
    for t in tensors:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        first, last = -(-lo // page) * page, hi // page * page  # whole pages inside the tensor only
        if last > first and _file_mapped(lo, hi):
            _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class FastLinear(nn.Module):
    """``y = x @ W.T + b`` over a weight that may be prepacked and may be quantized.

    ``weight`` is the dense weight (for a quantized linear: its dequantized weight, which
    is what the quantized kernel computes too); ``quant`` the quantized form, if any.

    A quantized linear whose kernel runs keeps no dense copy ("lean") and runs the kernel for
    every step (see the module's docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: QuantizedWeight | None,
                 table: KernelTable, name: str = "") -> None:
        super().__init__()
        self.name = name  # the module's (a fused one's own), naming its stored panels
        self.out_features, self.in_features = weight.shape
        self.table = table
        self.bias = None if bias is None else bias.detach()
        self.dtype, self.device = dtype, device = weight.dtype, weight.device
        self.kernel_dtype = table.kernel_dtype or dtype
        self.native = self.kernel_dtype == torch.int8
        if quant is not None and quant.panels and not self.native:  # stored for kvcellar's kernels, not run by them
            quant = row_layout(quant)
        runs = quant is not None and quant_kernels_run(self.kernel_dtype, device)
        # MXFP4 has only kvcellar's kernel: elsewhere its dequantized weight runs
        self.quant_kind = quant.kind if quant is not None and runs and (quant.kind != "mxfp4" or self.native) else None
        self._q: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self._zero: torch.Tensor | None = None
        self.group_size = 0
        # kept in the panel layout (``native.pack_int4``, offsets None: Q4_0's; ``native.pack_mxfp4``; int8:
        # ``keep_int8_panels``)
        self.panels = False
        self._group: native.Int4Group | native.Int8Group | None = None  # its kernel's call, as a group of one
        if self.quant_kind is not None:
            assert quant is not None
            try:
                self._pack_quantized(quant, self.kernel_dtype, device)
            except RuntimeError as exc:  # a shape the kernel does not take: the dequantized weight runs
                log.warning("no %s kernel for a %dx%d linear (%s); it runs dense", self.quant_kind,
                            self.out_features, self.in_features, exc)
                self.quant_kind = None
        self.lean = self.quant_kind is not None
        self.dense_kind = "none" if self.lean else "packed" if packs_dense(dtype, device) else "plain"
        self._dense: torch.Tensor | None = None
        if quant is not None and not self.lean:
            # No kernel here: the model's weights may be as loaded (``quantize_model(materialize=
            # False)``) or placeholders (``loader.linear_placeholder``), and the dense weights
            # must be what the quantized ones hold.
            weight = quant.dequantize(dtype).to(device)
        if self.dense_kind == "packed":
            self._dense = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
        elif self.dense_kind == "plain":
            self._dense = weight.detach()

    def _pack_quantized(self, quant: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        if self.native:  # kvcellar's kernels read the portable layout as it is (``engine/native``)
            if self.in_features % native.BLOCK or (quant.kind == "int4" and quant.group_size != native.BLOCK):
                raise RuntimeError(f"kvcellar's kernels take groups of {native.BLOCK} inputs")
            self._q = quant.qweight.contiguous()
            self.group_size = quant.group_size
            if quant.kind == "int8":
                self._scale = quant.scales.float().contiguous()
            elif quant.panels:  # packed by the artifact cache: mapped as they are
                self._q, self._scale, self._zero = quant.qweight, quant.scales, quant.offsets
                self.panels = True
            else:  # int4; MXFP4 (its scales: E8M0 exponents, as mapped)
                rows = _rows(quant)
                self._q, self._scale, self._zero = rows
                if self.table.panels and keeps_panels(quant):
                    self._q, self._scale, self._zero = _pack(rows)
                    self.panels = True
                    _drop_mapped_pages([t for t in rows if t is not None])
            if quant.kind == "int8":
                self._group = native.Int8Group([(self._q, self._scale)])
            elif self.panels and quant.kind == "int4":
                self._group = native.Int4Group([(self._q, self._scale, self._zero)], panels=True)
            return
        self._scale, zero = quant.kernel_params(dtype)
        if quant.kind == "int8":
            self._q = _aligned(quant.qweight.to(device))
            self._scale = _aligned(self._scale)
        else:
            self.group_size = quant.group_size
            self._q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quant.int4_values().to(device), 1)
            assert zero is not None
            # [in / group, out, 2]: the kernel's scale-and-zero layout
            self._zero = torch.stack([self._scale, zero], dim=-1).transpose(0, 1).contiguous()
            self._scale = None  # int4 scales live in ``_zero``, the kernel's scale-and-zero layout

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], quants: Sequence[QuantizedWeight | None],
                     table: KernelTable, name: str = "") -> FastLinear:
        """One linear computing ``linears`` side by side (outputs concatenated), named ``name``."""
        quant = None
        if all(q is not None for q in quants):
            present = [q for q in quants if q is not None]
            quant = QuantizedWeight.concat(row_layout(q) for q in present) if len(present) > 1 else present[0]
        elif any(q is not None for q in quants):
            raise ValueError("cannot fuse a quantized linear with a dense one")
        first = linears[0].weight
        if len(linears) == 1:
            weight = first
        elif quant is not None:  # its values come from ``quant``: only the shape is needed
            weight = first[:1, :1].expand(sum(m.out_features for m in linears), first.shape[1])
        else:
            weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                                            device=m.weight.device)
                              for b, m in zip(biases, linears, strict=True)])
        return cls(weight, bias, quant, table, name)

    def keep_int8_panels(self) -> bool:
        """Keep this linear's int8 weight as panels of 16 rows (``native.pack_int8``), where it runs
        kvcellar's int8 kernel and its rows come in 16s: a step of several rows (a verification,
        batched decoding) then multiplies each loaded weight by every row in one lane per output,
        a third of the row layout's time at 9 rows. Their arithmetic is their own (each output's
        the same at any row count and on every CPU), so the LM head takes them: its numbers reach
        no KV block. Returns whether it keeps them."""
        if not self.native or self.quant_kind != "int8" or self.panels or self.out_features % native.INT8_PANEL:
            return False
        assert self._q is not None and self._scale is not None
        rows = self._q
        self._q = native.pack_int8(rows, torch.get_num_threads())
        self._group = native.Int8Group([(self._q, self._scale)], panels=True)
        self.panels = True
        _drop_mapped_pages([rows])
        return True

    @property
    def quantized(self) -> bool:
        return self.quant_kind is not None

    @property
    def nbytes(self) -> int:
        """Bytes this linear holds (weights in every form kept, scales, bias)."""
        held = (self._q, self._scale, self._zero, self.bias, None if self.dense_kind == "packed" else self._dense)
        n = sum(t.numel() * t.element_size() for t in held if t is not None)
        if self.dense_kind == "packed":
            n += self.out_features * self.in_features * self.dtype.itemsize
        return n

    def native_weight(self) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``(kind, weight, scales, offsets)`` as kvcellar's kernels read them (``engine/native``),
        where this linear runs them; else None."""
        if not self.native or self.quant_kind is None:
            return None
        assert self._q is not None and self._scale is not None
        return self.quant_kind, self._q, self._scale, self._zero

    def kernel_spec(self) -> torch.Tensor | None:
        """``kvc_linear``'s spec of this linear's weight where its step is one such call (int8,
        int4 kept as panels): what a kernel that runs it inside a larger step takes
        (``native.layer``), its bias then added as ``quantized_kernel`` adds it."""
        return self._group.spec if self.native and self._group is not None else None

    def dequantized(self) -> torch.Tensor:
        """The quantized weight ``[out, in]`` as the kernel multiplies it, in the compute dtype
        (float32 for kvcellar's kernels), dequantized into the scratch buffer (valid until the
        next call on this thread)."""
        assert self._q is not None
        rows, cols = self.out_features, self.in_features
        dtype = torch.float32 if self.native else self.dtype
        out = _scratch_buffer(rows * cols, dtype, self.device).view(rows, cols)
        if self.native and self.quant_kind == "int4":
            assert self._scale is not None
            return native.dequantize_int4(self._q, self._scale, self._zero, 0, rows, out, torch.get_num_threads(),
                                          self.panels)
        if self.quant_kind == "mxfp4":
            assert self._scale is not None
            return native.dequantize_mxfp4(self._q, self._scale, 0, rows, out, torch.get_num_threads(), self.panels)
        if self.panels and self.quant_kind == "int8":
            raise RuntimeError("an int8 weight kept as panels has no row layout to dequantize")
        for start in range(0, rows, _DEQUANT_ROWS):
            end = min(rows, start + _DEQUANT_ROWS)
            if self.quant_kind == "int8":
                assert self._scale is not None
                w = self._q[start:end].float() * self._scale[start:end].float()[:, None]
                out[start:end].copy_(w)
            else:
                assert self._zero is not None
                params = self._zero[:, start:end].to(self.dtype)  # the kernel's scales, in the compute dtype
                if int4_pack_block() == 0 or rows % int4_pack_block():
                    raise RuntimeError("torch's int4 packing of this linear is not one kvcellar unpacks")
                values = _unpack_int4(self._q, start, end, cols, int4_pack_block())
                dequantize_int4(values, params[..., 0].t(), params[..., 1].t(), self.group_size, out=out[start:end])
        return out

    def dense(self, x2d: torch.Tensor) -> torch.Tensor:
        """``x2d`` times the dense weight; a linear that runs a quantized kernel has none."""
        if self.dense_kind == "packed":
            packed: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x2d, self._dense, self.bias, "none", [], "")
            return packed
        if self._dense is None:
            raise RuntimeError("a quantized linear keeps no dense weight: it runs its kernel")
        return F.linear(x2d, self._dense, self.bias)

    def quantized_kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.native:
            assert self._q is not None and self._scale is not None
            xn, threads = _kernel_input(x2d), torch.get_num_threads()
            if self._group is not None:  # int8, int4 kept as panels
                out = self._group(xn, threads, _kernel_output(self.dtype))[0]
            elif self.quant_kind == "mxfp4":
                out = native.matmul_mxfp4(xn, self._q, self._scale, threads, self.panels)
            else:  # int4 in the row layout
                out = native.matmul_int4(xn, self._q, self._scale, self._zero, threads,
                                         out_dtype=_kernel_output(self.dtype))
            out = out.to(self.dtype)
            return out if self.bias is None else out + self.bias
        x = x2d.to(self.kernel_dtype)
        if self.quant_kind == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x, self._q, self._scale)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._q, self.group_size, self._zero)
        out = out.to(self.dtype)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        out = self.quantized_kernel(x2d) if self.quant_kind is not None else self.dense(x2d)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = self.quant_kind or self.dense_kind
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class FusedPart(nn.Module):
    """One of the linears fused into a ``FastLinear`` (e.g. ``k_proj`` of a fused QKV), for
    callers that still call it alone (transformers' modules): computes the fused output and
    returns its slice, so both paths give the same numbers."""

    def __init__(self, fused: FastLinear, start: int, end: int) -> None:
        super().__init__()
        self.fused = fused
        self.start, self.end = start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fused(x)
        return out[..., self.start : self.end]


@dataclass
class PreparedModel:
    """What ``prepare_model`` did to a model (kept on it as ``_kvcellar_prepared``)."""

    table: KernelTable
    fused: dict[str, FastLinear]  # "<layer path>.qkv" / ".gate_up" -> the fused linear
    linears: list[FastLinear]  # every distinct FastLinear, in model order
    head: FastLinear | None = None  # the LM head, where it is a linear of its own

    @property
    def quantized(self) -> list[FastLinear]:
        return [m for m in self.linears if m.quantized]


def prepare_model(model: nn.Module, quantized: dict[str, QuantizedWeight] | None = None,
                  fuse: Sequence[tuple[str, Sequence[str]]] = (),
                  kernel_dtype: torch.dtype | None = None) -> PreparedModel:
    """Turn every ``nn.Linear`` of ``model`` into a ``FastLinear``, in place, once (a model
    already prepared is returned as it is). ``quantized``: quantized weights by module name
    (``quantization.quantize_model``); ``fuse``: (name, [module names]) groups to fuse, e.g.
    ``("model.layers.0.self_attn.qkv", ["...q_proj", "...k_proj", "...v_proj"])``;
    ``kernel_dtype``: the activations' dtype in the quantized kernels (``KernelTable``).
    Weights the artifact cache stored as panels (``QuantizedWeight.panels``) are kept as
    panels whatever their size."""
    prepared: PreparedModel | None = getattr(model, "_kvcellar_prepared", None)
    if prepared is not None:
        return prepared
    quantized = quantized or {}
    param = next(model.parameters())
    kernels = bool(quantized) and quant_kernels_run(kernel_dtype or param.dtype, param.device)
    # what packing would take (panels stored in the artifact cache are its mapped pages)
    panel_bytes = sum(q.nbytes for q in quantized.values() if q.kind in ("int4", "mxfp4") and not q.panels)
    table = KernelTable(kernel_dtype=kernel_dtype, panels=native.panels_fit(panel_bytes))
    # kvcellar's kernels read quantized weights where they are mapped from the entry; fusing
    # them would copy them (a 7B's QKV and gate-up: 2.7 GB of anonymous memory).
    in_place = kernels and kernel_dtype == torch.int8
    modules = dict(model.named_modules())
    output_embeddings = getattr(model, "get_output_embeddings", None)  # transformers' models have it
    head_module = output_embeddings() if callable(output_embeddings) else None
    fused: dict[str, FastLinear] = {}
    linears: list[FastLinear] = []
    replace: dict[str, nn.Module] = {}
    for name, members in fuse:
        parts = [modules[m] for m in members]
        if not all(type(p) is nn.Linear for p in parts) or (in_place and any(m in quantized for m in members)):
            continue
        one = FastLinear.from_linears(parts, [quantized.get(m) for m in members], table, name)
        fused[name] = one
        linears.append(one)
        start = 0
        for member, part in zip(members, parts, strict=True):
            replace[member] = FusedPart(one, start, start + part.out_features)
            start += part.out_features
    for name, module in modules.items():
        if type(module) is nn.Linear and name not in replace:
            one = FastLinear.from_linears([module], [quantized.get(name)], table, name)
            linears.append(one)
            replace[name] = one
    for name, new in replace.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    head = next((new for name, new in replace.items() if modules[name] is head_module), None)
    if isinstance(head, FastLinear):
        head.keep_int8_panels()
    prepared = PreparedModel(table, fused, linears, head if isinstance(head, FastLinear) else None)
    model._kvcellar_prepared = prepared  # type: ignore[assignment]  # nn.Module types attributes as tensors or modules
    return prepared
