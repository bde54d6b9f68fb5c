"""The model's linears as kvcellar runs them: prepacked, fused, quantized, chosen per step.

Measured on the 2-core AVX-512/AMX dev VM (docs/performance.md, bf16, one thread), the 211
linears of a SmolLM2 decode step: plain ``F.linear`` 37.7 ms, oneDNN with weights prepacked
once (``mkldnn._reorder_linear_weight`` / ``_linear_pointwise``) 25.5 ms, int8
(``aten._weight_int8pack_mm``) 18.3 ms, int4 (``aten._weight_int4pack_mm_for_cpu``) 9.8 ms
at one row; at 8 rows int8 42.8 and int4 28.3 against 25.5 prepacked, at 16 rows 72 and 53
against 26. So:

* dense weights are prepacked for oneDNN where that is faster (bf16 on a CPU with native
  bf16: every row count measured, 1 to 2048; fp32 stays on ``F.linear``, which was faster
  at 1-2 rows; fp16 on CPU was not measured and stays there too);
* a quantized linear runs its int8/int4 kernel for steps of at most ``quant_max_rows``
  rows (decodes; with kvcellar's own kernels on AVX2, prefill chunks too) and its
  dequantized weight, dense, above (prefill chunks, big batches).
  Where the cross-over lies depends on the CPU, so warm-up (``engine/warmup.py``) measures it over the
  model's own linears (``calibrate``); until then a default per device and dtype holds;
* QKV and gate-up projections of supported architectures are fused into one linear each
  (12-15 % less matmul time at 1-64 rows, 90 fewer calls per step).

``prepare_model`` does this once per model object, in place: every ``nn.Linear`` becomes a
``FastLinear`` (fused ones a ``FusedPart`` of a shared ``FastLinear``), so transformers'
own forward, kvcellar's lean forward and a test's reference all run the same numbers.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvcellar.engine import native
from kvcellar.quantization import QuantizedWeight, dequantize_int4

log = logging.getLogger(__name__)

# Row counts at which ``calibrate`` compares a quantized kernel with the dense weights (for
# a lean linear: dequantizing them first, which the kernel beats at more rows). 512 is a
# default prefill chunk: kvcellar's kernels multiply such chunks too (``engine/native``).
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 512)
# A linear whose first calibration run takes this long (a 7B model's LM head dequantized) is
# timed once more instead of ``repeats`` times: its noise is small beside it, and repeats of
# it made most of a 7B model's start.
LONG_RUN_S = 0.1
# Before calibration: steps of up to this many rows use the quantized kernel where one is
# fast at all (the measured cross-over above lies between 4 and 8).
DEFAULT_QUANT_MAX_ROWS = 4
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
    weights run. Whether they pay is measured (``loader.quantized_mode_pays``, ``calibrate``)."""
    if device.type != "cpu":
        return False
    return dtype == torch.bfloat16 or (dtype == torch.int8 and native.available())


def upcasts_dense(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a lean linear's dequantized weight is multiplied in float32: bf16 matmuls on a
    CPU without native bf16 are several times slower than float32 ones."""
    return device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16_cpu()


@dataclass
class KernelTable:
    """The per-step kernel choice shared by every linear of one model."""

    quant_max_rows: int
    # The activations' dtype in the quantized kernels; None: the model's own. bf16 under a
    # float32 model where the CPU has no native bf16 (``loader.resolve_serving``): the kernels
    # run decode steps, float32 runs everything else. int8: kvcellar's own kernels
    # (``engine/native``), which quantize the activations to 8 bits.
    kernel_dtype: torch.dtype | None = None
    # Row count -> ms of one pass over the model's quantized linears, per kernel; set by ``calibrate``.
    measured: dict[str, dict[int, float]] = field(default_factory=dict)
    calibrated: bool = False


# Rows of the weight dequantized at a time by a lean linear (bounds its float32 temporary).
_DEQUANT_ROWS = 1024
# Rows per block of torch's CPU int4 packing, by vector width (AVX-512: 64, AVX2: 32).
_INT4_BLOCKS = (64, 32, 16)
_scratch = threading.local()  # per thread: the engine's and a calibrating or testing one never share


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
    """Drop this thread's scratch buffers. Calibration sizes them for the largest linear it
    times, the LM head (a 7B's in float32: 2.2 GB), which serving steps rarely dequantize;
    the engine thread grows its own to what its steps need."""
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


class FastLinear(nn.Module):
    """``y = x @ W.T + b`` over a weight that may be prepacked and may be quantized.

    ``weight`` is the dense weight (for a quantized linear: its dequantized weight, which
    is what the quantized kernel computes too); ``quant`` the quantized form, if any.

    A quantized linear whose kernel runs keeps no dense copy ("lean"): steps of more rows
    than the kernel is fast for dequantize the weight into a scratch buffer shared by every
    linear (one layer's weight at a time), from the kernel's own packing, to exactly the
    numbers ``QuantizedWeight.dequantize`` gives."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: QuantizedWeight | None,
                 table: KernelTable) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.table = table
        self.bias = None if bias is None else bias.detach()
        self.dtype, self.device = dtype, device = weight.dtype, weight.device
        self.kernel_dtype = table.kernel_dtype or dtype
        self.native = self.kernel_dtype == torch.int8
        self.quant_kind = quant.kind if quant is not None and quant_kernels_run(self.kernel_dtype, device) else None
        self._q: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self._zero: torch.Tensor | None = None
        self.group_size = 0
        if self.quant_kind is not None:
            assert quant is not None
            try:
                self._pack_quantized(quant, self.kernel_dtype, device)
            except RuntimeError as exc:  # a shape the kernel does not take: the dequantized weight runs
                log.warning("no %s kernel for a %dx%d linear (%s); it runs dense", self.quant_kind,
                            self.out_features, self.in_features, exc)
                self.quant_kind = None
        self.lean = self.quant_kind == "int8" or (self.quant_kind == "int4" and (self.native or (
            int4_pack_block() > 0 and self.out_features % int4_pack_block() == 0)))
        self.dense_kind = "dequantized" if self.lean else "packed" if packs_dense(dtype, device) else "plain"
        self.upcast = self.lean and upcasts_dense(dtype, device)
        # What kvcellar's kernels' dense path multiplies in: a bf16 model's dtype where the CPU's
        # bf16 matmul is the fast one (AMX: 4-6x float32's at prefill sizes), else float32.
        self.native_dense_dtype = torch.bfloat16 if dtype == torch.bfloat16 and not upcasts_dense(dtype, device) \
            else torch.float32
        self._dense: torch.Tensor | None = None
        if quant is not None and not self.lean:
            # The model's weights may be as loaded (``quantize_model(materialize=False)``) or
            # placeholders (``loader.linear_placeholder``): the dense path must compute what
            # the kernel does.
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
            else:
                assert quant.offsets is not None
                self._scale = quant.scales.to(torch.float16).contiguous()  # float16 already: as mapped
                self._zero = quant.offsets.to(torch.float16).contiguous()
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
                     table: KernelTable) -> FastLinear:
        """One linear computing ``linears`` side by side (outputs concatenated)."""
        quant = None
        if all(q is not None for q in quants):
            quant = (QuantizedWeight.concat(quants)  # type: ignore[arg-type]  # all() above: no None in quants
                     if len(quants) > 1 else quants[0])
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
        return cls(weight, bias, quant, table)

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

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` in the compute dtype (``native_dense_dtype`` for kvcellar's
        kernels), dequantized into the scratch buffer (valid until the next call on this thread)."""
        assert self._q is not None
        rows, cols = self.out_features, self.in_features
        dtype = self.native_dense_dtype if self.native else self.dtype
        out = _scratch_buffer(rows * cols, dtype, self.device).view(rows, cols)
        if self.native and self.quant_kind == "int4":
            assert self._scale is not None and self._zero is not None
            return native.dequantize_int4(self._q, self._scale, self._zero, 0, rows, out, torch.get_num_threads())
        for start in range(0, rows, _DEQUANT_ROWS):
            end = min(rows, start + _DEQUANT_ROWS)
            if self.quant_kind == "int8":
                assert self._scale is not None
                w = self._q[start:end].float() * self._scale[start:end].float()[:, None]
                out[start:end].copy_(w)
            else:
                assert self._zero is not None
                params = self._zero[:, start:end].to(self.dtype)  # the kernel's scales, in the compute dtype
                values = _unpack_int4(self._q, start, end, cols, int4_pack_block())
                dequantize_int4(values, params[..., 0].t(), params[..., 1].t(), self.group_size, out=out[start:end])
        return out

    def dense(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.dense_kind == "packed":
            packed: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x2d, self._dense, self.bias, "none", [], "")
            return packed
        if self.dense_kind == "dequantized":
            if self.native:  # the kernels' 8-bit activations: the same products at every step size
                x8 = native.round_activations(x2d.float(), torch.get_num_threads()).to(self.native_dense_dtype)
                bias = None if self.bias is None else self.bias.to(self.native_dense_dtype)
                return F.linear(x8, self.dequantized(), bias).to(self.dtype)
            if self.upcast:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x2d.float(), self.dequantized().float(), bias).to(self.dtype)
            return F.linear(x2d, self.dequantized(), self.bias)
        assert self._dense is not None  # "plain" always keeps its dense weight (__init__)
        return F.linear(x2d, self._dense, self.bias)

    def quantized_kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.native:
            assert self._q is not None and self._scale is not None
            x32, threads = x2d.float(), torch.get_num_threads()
            if self.quant_kind == "int8":
                out = native.matmul_int8(x32, self._q, self._scale, threads)
            else:
                assert self._zero is not None
                out = native.matmul_int4(x32, self._q, self._scale, self._zero, threads)
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
        if self.quant_kind is not None and x2d.shape[0] <= self.table.quant_max_rows:
            out = self.quantized_kernel(x2d)
        else:
            out = self.dense(x2d)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        quant = f", {self.quant_kind} up to {self.table.quant_max_rows} rows" if self.quant_kind else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.dense_kind}{quant}"


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
                  fuse: Sequence[tuple[str, Sequence[str]]] = (), kernel_dtype: torch.dtype | None = None
                  ) -> PreparedModel:
    """Turn every ``nn.Linear`` of ``model`` into a ``FastLinear``, in place, once (a model
    already prepared is returned as it is). ``quantized``: quantized weights by module name
    (``quantization.quantize_model``); ``fuse``: (name, [module names]) groups to fuse, e.g.
    ``("model.layers.0.self_attn.qkv", ["...q_proj", "...k_proj", "...v_proj"])``;
    ``kernel_dtype``: the activations' dtype in the quantized kernels (``KernelTable``)."""
    prepared: PreparedModel | None = getattr(model, "_kvcellar_prepared", None)
    if prepared is not None:
        return prepared
    quantized = quantized or {}
    param = next(model.parameters())
    kernels = bool(quantized) and quant_kernels_run(kernel_dtype or param.dtype, param.device)
    table = KernelTable(DEFAULT_QUANT_MAX_ROWS if kernels else 0, kernel_dtype=kernel_dtype)
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
        one = FastLinear.from_linears(parts, [quantized.get(m) for m in members], table)
        fused[name] = one
        linears.append(one)
        start = 0
        for member, part in zip(members, parts, strict=True):
            replace[member] = FusedPart(one, start, start + part.out_features)
            start += part.out_features
    for name, module in modules.items():
        if type(module) is nn.Linear and name not in replace:
            one = FastLinear.from_linears([module], [quantized.get(name)], table)
            linears.append(one)
            replace[name] = one
    for name, new in replace.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    head = next((new for name, new in replace.items() if modules[name] is head_module), None)
    prepared = PreparedModel(table, fused, linears, head if isinstance(head, FastLinear) else None)
    model._kvcellar_prepared = prepared  # type: ignore[assignment]  # nn.Module types attributes as tensors or modules
    return prepared


def calibrate(prepared: PreparedModel, threads_for: Callable[[int], int], repeats: int = 3,
              max_rows: int = CALIBRATION_ROWS[-1]) -> KernelTable:
    """Time one pass over the model's quantized linears with their quantized kernel and with
    their dense weights, at each of ``CALIBRATION_ROWS`` rows (``threads_for(rows)`` torch
    threads, as steps of that size run), and use the kernel up to the largest row count from
    which on it is no longer faster; where it is faster at every count, for steps of up to
    ``max_rows`` (the engine's largest step). Returns the table, updated in place.

    Linears of one shape and kind take the same time, so one of each is timed and counted
    as many times as the model holds it: a 7B model's ~200 quantized linears are 5 shapes,
    and dequantizing every one at every row count took minutes. The LM head is left out where
    other linears are timed: it runs on a step's last tokens, a few rows, and its dense run
    would dequantize the largest weight (a 7B's: 2.2 GB in float32) for a choice it never faces."""
    table = prepared.table
    layers = [m for m in prepared.quantized if m is not prepared.head] or prepared.quantized
    if not layers:
        return table
    dtype, device = layers[0].dtype, layers[0].device
    shapes: dict[tuple[int, int, str | None, bool, int], list[FastLinear]] = {}
    for m in layers:
        shapes.setdefault((m.out_features, m.in_features, m.quant_kind, m.lean, m.group_size), []).append(m)
    sample = [(group[0], len(group)) for group in shapes.values()]
    widths = sorted({m.in_features for m, _ in sample})
    measured: dict[str, dict[int, float]] = {"quantized": {}, "dense": {}}
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for rows in CALIBRATION_ROWS:
                threads = threads_for(rows)
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                inputs = {w: torch.randn(rows, w, dtype=dtype, device=device) for w in widths}
                for kind in ("quantized", "dense"):
                    total = 0.0
                    for m, count in sample:
                        run = m.quantized_kernel if kind == "quantized" else m.dense
                        times = []
                        for i in range(repeats + 1):  # the first run warms up
                            t0 = time.perf_counter()
                            run(inputs[m.in_features])
                            times.append(time.perf_counter() - t0)
                            if i == 1 and times[0] >= LONG_RUN_S:
                                break  # a run this long times itself: one after the warm-up is enough
                        total += statistics.median(times[1:]) * count
                    measured[kind][rows] = total * 1e3
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
    best = 0
    for rows in CALIBRATION_ROWS:
        if measured["quantized"][rows] >= measured["dense"][rows]:
            break
        best = rows
    table.quant_max_rows = max(best, max_rows) if best == CALIBRATION_ROWS[-1] else best
    table.measured = measured
    table.calibrated = True
    return table
