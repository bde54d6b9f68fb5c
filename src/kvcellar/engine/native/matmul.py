"""Quantized linears on kvcellar's kernels (``quantize.c``, ``int4.c``, ``int8.c``, ``mxfp4.c``):
activations quantized to 8 bits per block of 32 inputs and multiplied in 8-bit dot products.

int4 linears keep their weights packed as panels of 8 rows (``stores_panels``, ``pack_int4``)
and every step multiplies them as they lie (two panels at once with AVX-512's 8-bit dot
product). Weights left in the row layout (rows not in 8s, a model whose panels would not fit
in memory) are read row by row for decode-sized steps and packed into panels for prefill-sized
ones (``PANEL_MIN_ROWS`` rows on; 16 rows with AVX-512, ``WIDE_PANEL_MIN_ROWS`` rows on). Every
int4 kernel sums each output in the same order, so a row's outputs are the same bits whatever
the step's row count and the CPU; int8 and MXFP4 have one kernel for every row count.
``moe_matmul`` runs all routed experts of a MoE layer's projection in one call, each expert's
rows by the same arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcellar import pages
from kvcellar.engine.native import lib

# Inputs per block of quantized activations (and per int4 group the kernels take).
BLOCK = 32
# Output rows of an int4 panel (``kvc_gemm_q4_panels``), and the step size from which on
# panels beat reading each weight row as it lies: packing a panel costs about what 4 rows'
# products do (docs/performance.md).
PANEL = 8
PANEL_MIN_ROWS = 8
# CPUs that multiply panels of 16 rows (``kvc_gemm_q4_panels16``): AVX-512 with its 8-bit dot
# product (VNNI), which sums 4 pairs a lane in one instruction where AVX2 takes two per 2 pairs.
WIDE_PANEL = 16
WIDE_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
# There the wide panels overtake the row kernel from 5 rows on, not 8 (docs/performance.md).
WIDE_PANEL_MIN_ROWS = 5


# The activations' dtypes the kernels take: a bf16 model's are quantized without a float32 copy.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def _check_activations(x: torch.Tensor, cols: int) -> None:
    if x.dtype not in ACTIVATION_DTYPES or x.dim() != 2 or x.shape[1] != cols or x.is_cuda or cols % BLOCK:
        raise ValueError(f"activations must be float32 or bfloat16 CPU [rows, {cols}] (blocks of {BLOCK} inputs), "
                         f"not {x.dtype} {tuple(x.shape)}")


def quantize_activations(x: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` float32 or bfloat16 ``[rows, cols]`` as 8-bit blocks: values (even inputs of a block
    first), scales, and scale x sum of the block's values (a bf16 ``x``: its float32 copy's)."""
    _check_activations(x, x.shape[1])
    return _quantize(x, threads)


def _quantize(x: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_activations`` of activations already checked."""
    rows, cols = x.shape
    x = x.contiguous()
    xq = torch.empty(rows, cols, dtype=torch.int8)
    xd = torch.empty(rows, cols // BLOCK)
    xs = torch.empty(rows, cols // BLOCK)
    lib.call("kvc_quantize_q8", x=x.data_ptr(), x_bf16=int(x.dtype == torch.bfloat16), rows=rows, cols=cols,
             xq=xq.data_ptr(), xd=xd.data_ptr(), xs=xs.data_ptr(), threads=threads)
    return xq, xd, xs


@functools.cache
def wide_panels() -> bool:
    """Whether this CPU runs ``kvc_gemm_q4_panels16`` (and the kernels' other AVX-512 forms;
    ``KVCELLAR_AVX512=0``: their AVX2 forms, the same bits)."""
    return lib.cpu_flags() >= WIDE_FLAGS and os.environ.get(lib.AVX512_SWITCH, "1") != "0"


@functools.cache
def amx_tiles() -> bool:
    """Whether int4 weights kept as panels take prefill-sized steps on AMX tiles here (``amx.c``:
    the CPU has AMX-INT8, Linux gives the process the tile state, ``KVCELLAR_AMX`` is not 0),
    to the bits of the AVX-512 kernels."""
    return lib.available() and bool(lib.call("kvc_amx"))


def cpu_kernels() -> dict[str, object]:
    """The kernels' forms this CPU runs, for ``/health`` and the benchmarks' records: the vector
    width, the int4 panels multiplied at once, and AMX tiles."""
    if not lib.available():
        return {"native": False}
    return {"native": True, "vectors": "avx512" if wide_panels() else "avx2",
            "int4_panels_at_once": 2 if wide_panels() else 1, "amx": amx_tiles()}


def panel_layout() -> str:
    """The name of the layout ``pack_int4`` packs on this CPU (``kept_panel_at``): pairs of
    panels interleaved where two are multiplied at once. Stored panels are this machine's."""
    return f"int4-panels-x{2 if wide_panels() else 1}"


def panel_min_rows(out: int) -> int:
    """Rows from which on ``matmul_int4`` multiplies panels of ``out`` outputs, on this CPU."""
    return WIDE_PANEL_MIN_ROWS if out % WIDE_PANEL == 0 and wide_panels() else PANEL_MIN_ROWS


def int4_kernel(rows: int, out: int) -> str:
    """The kernel ``matmul_int4`` runs for ``rows`` activations and ``out`` outputs. All
    three give every output the same numbers to the bit, whatever the other rows."""
    if rows < panel_min_rows(out) or out % PANEL:
        return "kvc_gemm_q4"
    return "kvc_gemm_q4_panels16" if out % WIDE_PANEL == 0 and wide_panels() else "kvc_gemm_q4_panels"


def _check_weight(weight: torch.Tensor, scales: torch.Tensor, cols: int, more: torch.Tensor | None = None) -> None:
    out = weight.shape[0]
    for t in (weight, scales) if more is None else (weight, scales, more):
        if not t.is_contiguous() or t.is_cuda:
            raise ValueError("a quantized weight's tensors must be contiguous CPU tensors")
    shape = scales.shape
    if shape[0] != out or (len(shape) == 2 and shape[1] != cols // BLOCK) or (more is not None and more.shape != shape):
        raise ValueError(f"scales {tuple(shape)} do not fit a weight of {out} rows and {cols} inputs")


# The share of the machine's memory a model's int4 weights may take as panels: panels are
# anonymous memory (packed at every start, held whatever the page cache needs), where weights in
# the row layout stay the artifact cache's mapped pages. A Qwen3-30B-A3B's 17.5 GB of experts on a
# 24 GB machine left no room (23.6 GB at start, 134 s of packing a start; docs/performance.md).
PANEL_RAM_SHARE = 0.5


def panels_fit(int4_bytes: int) -> bool:
    """Whether a model of ``int4_bytes`` of int4 weights keeps them as panels where this CPU
    would (``stores_panels``): at most ``PANEL_RAM_SHARE`` of the machine's memory."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return True
    return int4_bytes <= PANEL_RAM_SHARE * total


def stores_panels(out: int) -> bool:
    """Whether an int4 weight of ``out`` rows is kept in the panel layout here (``pack_int4``):
    rows in 8s. A decode step then needs no horizontal sums per block (the row kernel's bound),
    and a prefill packs nothing; with AVX-512's 8-bit dot product two panels run at once
    (docs/performance.md)."""
    return out % PANEL == 0


def pack_int4(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
              threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An int4 weight (``matmul_int4``'s layout, ``out`` a multiple of 8) in the panel layout:
    new tensors of the same shapes, each 8 rows' nibbles, scales and offsets as one panel
    (``kvc_pack_q4``), in 2 MB pages where the OS gives them (``pages``); no offsets (None)
    where each is exactly -8 x its scale, as a Q4_0 source's are: the kernels derive them.
    ``matmul_int4(..., panels=True)`` multiplies them, to the same bits."""
    out, cols = nibbles.shape[0], nibbles.shape[1] * 2
    _check_weight(nibbles, scales, cols, offsets)
    if out % PANEL or cols % BLOCK:
        raise ValueError(f"a {out}x{cols} int4 weight has no panel layout (rows in 8s, inputs in {BLOCK}s)")
    derived = torch.equal(offsets.float(), scales.float() * -8)
    pw, ps = pages.empty(nibbles.shape, nibbles.dtype), pages.empty(scales.shape, scales.dtype)
    po = None if derived else pages.empty(offsets.shape, offsets.dtype)
    lib.call("kvc_pack_q4", w=nibbles.data_ptr(), scales=scales.data_ptr(), offsets=offsets.data_ptr(), out=out,
             cols=cols, pw=pw.data_ptr(), ps=ps.data_ptr(), po=_address(po), threads=threads)
    return pw, ps, po


def pack_mxfp4(nibbles: torch.Tensor, exponents: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 weight (``matmul_mxfp4``'s layout, ``out`` a multiple of 8) in the panel layout
    int4's share (``kvc_pack_mxfp4``): new tensors of the same shapes, in 2 MB pages where the OS
    gives them. ``matmul_mxfp4(..., panels=True)`` multiplies them, to the same bits."""
    out, cols = nibbles.shape[0], nibbles.shape[1] * 2
    _check_weight(nibbles, exponents, cols)
    if out % PANEL or cols % BLOCK:
        raise ValueError(f"a {out}x{cols} MXFP4 weight has no panel layout (rows in 8s, inputs in {BLOCK}s)")
    pw, pe = pages.empty(nibbles.shape, nibbles.dtype), pages.empty(exponents.shape, exponents.dtype)
    lib.call("kvc_pack_mxfp4", w=nibbles.data_ptr(), exps=exponents.data_ptr(), out=out, cols=cols,
             pw=pw.data_ptr(), pe=pe.data_ptr(), threads=threads)
    return pw, pe


def unpack_mxfp4(nibbles: torch.Tensor, exponents: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_mxfp4`` undone: the row layout of an MXFP4 weight kept as panels."""
    out, cols = nibbles.shape[0], nibbles.shape[1] * 2
    _check_weight(nibbles, exponents, cols)
    w, e = torch.empty_like(nibbles), torch.empty_like(exponents)
    lib.call("kvc_unpack_mxfp4", pw=nibbles.data_ptr(), pe=exponents.data_ptr(), out=out, cols=cols,
             w=w.data_ptr(), exps=e.data_ptr(), threads=threads)
    return w, e


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def unpack_int4(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_int4`` undone: the row layout of a weight kept as panels (its offsets derived
    where none were kept)."""
    out, cols = nibbles.shape[0], nibbles.shape[1] * 2
    _check_weight(nibbles, scales, cols, offsets)
    w, sc, of = torch.empty_like(nibbles), torch.empty_like(scales), torch.empty_like(scales)
    lib.call("kvc_unpack_q4", pw=nibbles.data_ptr(), ps=scales.data_ptr(), po=_address(offsets), out=out, cols=cols,
             w=w.data_ptr(), scales=sc.data_ptr(), offsets=of.data_ptr(), threads=threads)
    return w, sc, of


def matmul_int4(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                threads: int, kernel: str | None = None, panels: bool = False,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ w.T`` for int4 ``w`` (``nibbles`` uint8 ``[out, in / 2]``, float16
    ``scales``/``offsets`` ``[out, in / 32]``; in the panel layout where ``panels``, whose
    offsets may be None: ``pack_int4``), ``x`` float32 or bfloat16 ``[rows, in]``, computed in
    float32 and returned in ``out_dtype`` (bfloat16: as ``.to`` rounds the float32 result; the
    panel kernels write it so); ``kernel``: another than ``int4_kernel``'s choice (a test
    comparing them)."""
    out, cols = nibbles.shape[0], nibbles.shape[1] * 2
    _check_weight(nibbles, scales, cols, offsets)
    _check_activations(x, cols)
    if offsets is None and not panels:
        raise ValueError("an int4 weight in the row layout needs its offsets")
    _check_out_dtype(out_dtype)
    rows = x.shape[0]
    xq, xd, xs = _quantize(x, threads)
    if panels:
        if out % PANEL:
            raise ValueError(f"a weight of {out} rows has no panel layout")
        y = torch.empty(rows, out, dtype=out_dtype)
        lib.call("kvc_gemm_q4p", pw=nibbles.data_ptr(), ps=scales.data_ptr(), po=_address(offsets), out=out,
                 cols=cols, xq=xq.data_ptr(), xd=xd.data_ptr(), xs=xs.data_ptr(), rows=rows, y=y.data_ptr(),
                 y_bf16=int(out_dtype == torch.bfloat16), threads=threads)
        return y
    assert offsets is not None  # refused above
    y = torch.empty(rows, out)
    lib.call(kernel or int4_kernel(rows, out), w=nibbles.data_ptr(), scales=scales.data_ptr(),
             offsets=offsets.data_ptr(), out=out, cols=cols, xq=xq.data_ptr(), xd=xd.data_ptr(), xs=xs.data_ptr(),
             rows=rows, y=y.data_ptr(), threads=threads)
    return y.to(out_dtype)


def _check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"the kernels' results are float32 or bfloat16, not {dtype}")


def _addresses(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    return torch.tensor([_address(t) for t in tensors], dtype=torch.int64)


# ``kvc_linear``'s kinds (``linear.c``): int4 weights kept as panels, int8 weights, int8 kept as panels.
LINEAR_KINDS = {"kvc_gemm_q4p_many": 0, "kvc_gemm_q8_many": 1, "kvc_gemm_q8p_many": 2}


class _Group:
    """Quantized weights that take the same activations, checked and their addresses taken once:
    ``kernel`` multiplies them all in one call over the activations quantized once. Panels and
    int8 weights go in one foreign call, ``kvc_linear``, activations quantized in it (a decode
    step makes ~4 such calls a layer: Python's part of a call costs what a small kernel does)."""

    kernel: str
    cols: int
    outs: list[int]
    _w: torch.Tensor
    _s: torch.Tensor
    _o: torch.Tensor | None = None  # int4's offsets
    _spec: torch.Tensor | None = None  # kvc_linear's: [kind, count, cols, w..., scales..., offsets..., outs...]

    def _take(self, weights: Sequence[tuple[Any, ...]]) -> None:
        self.weights = list(weights)  # keeps the tensors the addresses point into
        self.outs = [w[0].shape[0] for w in weights]
        self._w, self._s = _addresses([w[0] for w in weights]), _addresses([w[1] for w in weights])
        self._outs = torch.tensor(self.outs, dtype=torch.int64)

    def _take_spec(self) -> None:
        kind = LINEAR_KINDS.get(self.kernel)
        if kind is not None:
            offsets = self._o if self._o is not None else torch.zeros(len(self.outs), dtype=torch.int64)
            self._spec = torch.cat([torch.tensor([kind, len(self.outs), self.cols]), self._w, self._s, offsets,
                                    self._outs])

    @property
    def spec(self) -> torch.Tensor | None:
        """``kvc_linear``'s spec of these weights, where their step is one such call."""
        return self._spec

    def __call__(self, x: torch.Tensor, threads: int, out_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Each weight times ``x`` float32 or bfloat16 ``[rows, cols]`` in one call over ``x``
        quantized once: each result in ``out_dtype``, the same bits as its own ``matmul_int4`` /
        ``matmul_int8`` gives it."""
        _check_activations(x, self.cols)
        _check_out_dtype(out_dtype)
        rows = x.shape[0]
        direct = self.kernel == "kvc_gemm_q4p_many"  # writes bf16 itself
        ys = [torch.empty(rows, out, dtype=out_dtype if direct else torch.float32) for out in self.outs]
        if self._spec is not None:
            x = x.contiguous()
            done = lib.call("kvc_linear", spec=self._spec.data_ptr(), x=x.data_ptr(),
                            x_bf16=int(x.dtype == torch.bfloat16), rows=rows,
                            ys=(ctypes.c_int64 * len(ys))(*[y.data_ptr() for y in ys]),
                            y_bf16=int(out_dtype == torch.bfloat16), threads=threads)
        else:
            xq, xd, xs = _quantize(x, threads)
            addresses = _addresses(ys)  # held until the call returns
            args: dict[str, object] = {"w": self._w.data_ptr(), "scales": self._s.data_ptr(),
                                       "outs": self._outs.data_ptr(), "ys": addresses.data_ptr(),
                                       "count": len(self.outs), "cols": self.cols, "xq": xq.data_ptr(),
                                       "xd": xd.data_ptr(), "rows": rows, "threads": threads}
            if self._o is not None:
                args.update(offsets=self._o.data_ptr(), xs=xs.data_ptr())
            done = lib.call(self.kernel, **args)
        if done == -1:
            raise MemoryError("no memory for the linears' activations or work list")
        if done != 0:
            raise ValueError("an empty weight")
        return ys if direct else [y.to(out_dtype) for y in ys]


class Int4Group(_Group):
    """int4 weights that take the same activations (``(nibbles, scales, offsets)`` each, as
    ``matmul_int4`` takes them; all in the panel layout where ``panels``)."""

    def __init__(self, weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                 panels: bool = False) -> None:
        self.cols = cols = weights[0][0].shape[1] * 2
        self.kernel = "kvc_gemm_q4p_many" if panels else "kvc_gemm_q4_many"
        for nibbles, scales, offsets in weights:
            if nibbles.shape[1] * 2 != cols:
                raise ValueError(f"weights of {nibbles.shape[1] * 2} and of {cols} inputs in one group")
            if panels and nibbles.shape[0] % PANEL:
                raise ValueError(f"a weight of {nibbles.shape[0]} rows has no panel layout")
            if offsets is None and not panels:
                raise ValueError("an int4 weight in the row layout needs its offsets")
            _check_weight(nibbles, scales, cols, offsets)
        self._take(weights)
        self._o = _addresses([o for _, _, o in weights])
        self._take_spec()


class Int8Group(_Group):
    """int8 weights that take the same activations (``(qweight, scales)`` each, as
    ``matmul_int8`` takes them; all in the panel layout where ``panels``)."""

    def __init__(self, weights: Sequence[tuple[torch.Tensor, torch.Tensor]], panels: bool = False) -> None:
        self.cols = cols = weights[0][0].shape[1]
        self.kernel = "kvc_gemm_q8p_many" if panels else "kvc_gemm_q8_many"
        for qweight, scales in weights:
            if qweight.shape[1] != cols:
                raise ValueError(f"weights of {qweight.shape[1]} and of {cols} inputs in one group")
            if panels and (qweight.dtype != torch.uint8 or qweight.shape[0] % INT8_PANEL):
                raise ValueError(f"a {tuple(qweight.shape)} {qweight.dtype} weight is not in the int8 panel layout")
            _check_weight(qweight, scales, cols)
        self._take(weights)
        self._take_spec()


def matmul_int8_many(x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     threads: int, panels: bool = False) -> list[torch.Tensor]:
    """``matmul_int8`` of ``x`` by each of ``weights`` in one call (``Int8Group``)."""
    return Int8Group(weights, panels)(x, threads)


def matmul_int4_many(x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                     threads: int, panels: bool = False) -> list[torch.Tensor]:
    """``matmul_int4`` of ``x`` by each of ``weights`` in one call (``Int4Group``)."""
    return Int4Group(weights, panels)(x, threads)


def matmul_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, threads: int,
                panels: bool = False) -> torch.Tensor:
    """``x @ w.T`` in float32 for int8 ``w`` (``qweight`` ``[out, in]``, float32 ``scales [out]``;
    uint8 in the panel layout where ``panels``: ``pack_int8``, whose numbers are its own)."""
    return _matmul_scaled("kvc_gemm_q8p" if panels else "kvc_gemm_q8", x, qweight, qweight.shape[1], scales, threads)


# Output rows of an int8 weight's panel (``kvc_pack_q8``).
INT8_PANEL = 16


def pack_int8(qweight: torch.Tensor, threads: int) -> torch.Tensor:
    """An int8 weight (``matmul_int8``'s layout, ``out`` a multiple of ``INT8_PANEL``) in the panel
    layout: a uint8 tensor of the same shape, in 2 MB pages where the OS gives them; its scales
    stay as they are. ``matmul_int8(..., panels=True)`` multiplies it, each output by its own
    arithmetic (a block's exact integer dot product times the activations' scale, summed in
    block order, then the row's scale), the same bits at any row count and on every CPU."""
    out, cols = qweight.shape
    if qweight.dtype != torch.int8 or not qweight.is_contiguous() or out % INT8_PANEL or cols % BLOCK:
        raise ValueError(f"a {out}x{cols} {qweight.dtype} weight has no int8 panel layout "
                         f"(contiguous int8, rows in {INT8_PANEL}s, inputs in {BLOCK}s)")
    pw = pages.empty(qweight.shape, torch.uint8)
    lib.call("kvc_pack_q8", w=qweight.data_ptr(), out=out, cols=cols, pw=pw.data_ptr(), threads=threads)
    return pw


def matmul_mxfp4(x: torch.Tensor, nibbles: torch.Tensor, exponents: torch.Tensor, threads: int,
                 panels: bool = False) -> torch.Tensor:
    """``x @ w.T`` in float32 for MXFP4 ``w`` (``nibbles`` uint8 ``[out, in / 2]`` as int4's, each
    an E2M1 code; ``exponents`` uint8 E8M0 ``[out, in / 32]``; in the panel layout where
    ``panels``: ``pack_mxfp4``), ``x`` float32 ``[rows, in]``. Both layouts give the same bits."""
    if panels and nibbles.shape[0] % PANEL:
        raise ValueError(f"a weight of {nibbles.shape[0]} rows has no panel layout")
    return _matmul_scaled("kvc_gemm_mxfp4p" if panels else "kvc_gemm_mxfp4", x, nibbles, nibbles.shape[1] * 2,
                          exponents, threads)


def _matmul_scaled(kernel: str, x: torch.Tensor, weight: torch.Tensor, cols: int, scales: torch.Tensor,
                   threads: int) -> torch.Tensor:
    """A kernel that takes the weight, its scales and the 8-bit activations with their block
    scales (no offsets): int8's and MXFP4's."""
    _check_weight(weight, scales, cols)
    _check_activations(x, cols)
    out, rows = weight.shape[0], x.shape[0]
    xq, xd, _ = _quantize(x, threads)
    y = torch.empty(rows, out)
    names = {"kvc_gemm_mxfp4": ("w", "exps"), "kvc_gemm_mxfp4p": ("pw", "pe"),
             "kvc_gemm_q8p": ("pw", "scales")}.get(kernel, ("w", "scales"))
    done = lib.call(kernel, **{names[0]: weight.data_ptr(), names[1]: scales.data_ptr()}, out=out, cols=cols,
                    xq=xq.data_ptr(), xd=xd.data_ptr(), rows=rows, y=y.data_ptr(), threads=threads)
    if done == -1:  # the kernels returning int (kvc_gemm_q8p); the others give None
        raise MemoryError("no memory for the activations' block sums")
    if done == -2:
        raise ValueError(f"a {out}x{cols} weight has no int8 panel layout")
    return y


def _check_rows(out: torch.Tensor, dtypes: tuple[torch.dtype, ...], start: int, end: int, rows: int,
                cols: int) -> None:
    if out.dtype not in dtypes or not out.is_contiguous() or tuple(out.shape) != (end - start, cols):
        raise ValueError(f"out must be a contiguous [{end - start}, {cols}] tensor of {dtypes}")
    if not 0 <= start <= end <= rows:
        raise ValueError(f"rows {start}:{end} outside the weight's {rows}")


def dequantize_mxfp4(nibbles: torch.Tensor, exponents: torch.Tensor, start: int, end: int, out: torch.Tensor,
                     threads: int, panels: bool = False) -> torch.Tensor:
    """Rows ``start:end`` of an MXFP4 weight (layout as ``matmul_mxfp4``, the panel layout where
    ``panels``) into float32 ``out``."""
    cols = nibbles.shape[1] * 2
    _check_weight(nibbles, exponents, cols)
    _check_rows(out, (torch.float32,), start, end, nibbles.shape[0], cols)
    if panels:
        nibbles, exponents = unpack_mxfp4(nibbles, exponents, threads)
    lib.call("kvc_dequantize_mxfp4", w=nibbles.data_ptr(), exps=exponents.data_ptr(), start=start, end=end,
             cols=cols, out=out.data_ptr(), threads=threads)
    return out


def dequantize_int4(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, start: int, end: int,
                    out: torch.Tensor, threads: int, panels: bool = False) -> torch.Tensor:
    """Rows ``start:end`` of an int4 weight (layout as ``matmul_int4``, the panel layout where
    ``panels``) into ``out`` ``[end - start, in]``, float32 or bfloat16 (rounded as
    ``Tensor.to`` rounds): ``q * scale + offset``."""
    cols = nibbles.shape[1] * 2
    _check_weight(nibbles, scales, cols, offsets)
    _check_rows(out, (torch.float32, torch.bfloat16), start, end, nibbles.shape[0], cols)
    if panels:
        nibbles, scales, offsets = unpack_int4(nibbles, scales, offsets, threads)
    elif offsets is None:
        raise ValueError("an int4 weight in the row layout needs its offsets")
    lib.call("kvc_dequantize_q4", w=nibbles.data_ptr(), scales=scales.data_ptr(), offsets=offsets.data_ptr(),
             start=start, end=end, cols=cols, dst=out.data_ptr(), bf16=out.dtype == torch.bfloat16, threads=threads)
    return out


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert of a MoE layer, as ``moe_matmul`` reads it: the
    addresses of each expert's quantized weight (``kind`` int4, int8 or mxfp4, laid out as
    ``matmul_int4``'s, ``matmul_int8``'s or ``matmul_mxfp4``'s), its scales (mxfp4: exponents)
    and (int4) offsets, int64 ``[experts]``; ``keep`` holds the tensors they point into."""

    kind: str
    out: int
    cols: int
    weights: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    keep: tuple[torch.Tensor, ...]
    panels: bool = False  # int4 or MXFP4 in the panel layout (``pack_int4``, ``pack_mxfp4``)


def expert_weights(kind: str, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                   offsets: Sequence[torch.Tensor | None] | None = None, panels: bool = False) -> ExpertWeights:
    """``ExpertWeights`` over per-expert tensors (all of one shape and layout; an int4 expert
    kept as panels may have no offsets: ``pack_int4``)."""
    if kind not in ("int4", "int8", "mxfp4") or (kind == "int4") != (offsets is not None):
        raise ValueError(f"experts of kind {kind!r} take {'offsets' if kind == 'int4' else 'no offsets'}")
    if panels and (kind == "int8" or weights[0].shape[0] % PANEL):
        raise ValueError("only int4 and MXFP4 experts of rows in 8s have a panel layout")
    if not panels and offsets is not None and any(o is None for o in offsets):
        raise ValueError("int4 experts in the row layout need their offsets")
    out, packed = weights[0].shape
    cols = packed if kind == "int8" else packed * 2
    tensors = [*weights, *scales, *(o for o in offsets or () if o is not None)]
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        raise ValueError("experts' weights must be contiguous CPU tensors")
    if any(w.shape != weights[0].shape for w in weights):
        raise ValueError("experts of one projection must share a shape")
    return ExpertWeights(kind, out, cols, _addresses(weights), _addresses(scales),
                         None if offsets is None else _addresses(offsets), tuple(tensors), panels)


_MOE_KERNELS = {("int4", False): "kvc_moe_q4", ("int4", True): "kvc_moe_q4p", ("int8", False): "kvc_moe_q8",
                ("mxfp4", False): "kvc_moe_mxfp4", ("mxfp4", True): "kvc_moe_mxfp4p"}


def moe_matmul(x: torch.Tensor, experts: ExpertWeights, starts: torch.Tensor, threads: int) -> torch.Tensor:
    """Rows ``starts[e]:starts[e + 1]`` of ``x`` float32 ``[slots, cols]`` times expert ``e``'s
    weight, every expert in one call: ``[slots, out]`` float32, each row the same bits as
    ``matmul_int4``/``matmul_int8``/``matmul_mxfp4`` over that expert's weight give it (at any
    row count)."""
    rows, cols = x.shape
    n_experts = experts.weights.shape[0]
    starts = starts.to(torch.int64).contiguous()
    if cols != experts.cols or starts.shape != (n_experts + 1,) or int(starts[0]) != 0 or int(starts[-1]) != rows:
        raise ValueError("activations and expert groups do not match the experts' weights")
    if bool((starts[1:] < starts[:-1]).any()):
        raise ValueError("expert groups must be in order")
    _check_activations(x, cols)
    xq, xd, xs = _quantize(x, threads)
    y = torch.empty(rows, experts.out)
    args: dict[str, object] = {"w": experts.weights.data_ptr(), "starts": starts.data_ptr(), "experts": n_experts,
                               "out": experts.out, "cols": cols, "xq": xq.data_ptr(), "xd": xd.data_ptr(),
                               "y": y.data_ptr(), "threads": threads}
    if experts.kind == "mxfp4":
        args["exps"] = experts.scales.data_ptr()
    else:
        args["scales"] = experts.scales.data_ptr()
    if experts.kind == "int4":
        assert experts.offsets is not None  # expert_weights requires them
        args.update(offsets=experts.offsets.data_ptr(), xs=xs.data_ptr())
    if lib.call(_MOE_KERNELS[(experts.kind, experts.panels)], **args) != 0:
        raise MemoryError("no memory for the experts' work list")
    return y


# The gatings ``moe_glu`` computes (``kvc_moe_glu``'s ``act``): the gate half then the up half,
# act(gate) * up; or gpt-oss's, gate and up interleaved and clamped (``alpha``, ``limit``).
GLU_ACTS = {"silu": 0, "gelu_tanh": 1, "clamped": 2}
# ``kvc_moe_glu``'s kinds of experts.
_GLU_KINDS = {("int4", False): 0, ("int4", True): 1, ("int8", False): 2, ("mxfp4", False): 3, ("mxfp4", True): 4}


def moe_glu(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: ExpertWeights,
            down: ExpertWeights, act: str, threads: int, *, alpha: float = 1.0, limit: float = float("inf"),
            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE block's routed experts from its input to its output in one call, for experts of one
    kind and layout: ``x`` float32 ``[tokens, cols]``, the routed experts ``index [tokens, k]``
    and their ``weights``, the biases (``[experts, out]`` float32, or None); each token's
    ``sum_j weights[t, j] * (down_e(glu(gate_up_e(x_t) + b_e)) + b'_e)``, every product by
    ``moe_matmul``'s arithmetic, the gating (``GLU_ACTS``) and the sum by the kernel's own."""
    tokens, cols = x.shape
    kind = _GLU_KINDS.get((gate_up.kind, gate_up.panels))
    if kind is None or (down.kind, down.panels) != (gate_up.kind, gate_up.panels):
        raise ValueError("moe_glu runs experts of one kind and layout")
    n_experts = gate_up.weights.shape[0]
    if (gate_up.cols != cols or down.out != cols or gate_up.out != 2 * down.cols
            or down.weights.shape[0] != n_experts or index.shape != weights.shape or index.shape[0] != tokens):
        raise ValueError("activations, routes and the experts' weights do not match")
    biases = []
    for bias, out in ((gate_up_bias, gate_up.out), (down_bias, down.out)):
        if bias is not None and (bias.shape != (n_experts, out) or bias.dtype != torch.float32
                                 or not bias.is_contiguous()):
            raise ValueError(f"an experts' bias must be contiguous float32 [{n_experts}, {out}]")
        biases.append(0 if bias is None else bias.data_ptr())
    _check_activations(x, cols)
    index = index.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    x = x.contiguous()
    y = torch.empty(tokens, cols)
    offsets = [0 if e.offsets is None else e.offsets.data_ptr() for e in (gate_up, down)]
    rc = lib.call("kvc_moe_glu", kind=kind, x=x.data_ptr(), tokens=tokens, cols=cols, index=index.data_ptr(),
                  weights=weights.data_ptr(), k=index.shape[1], experts=n_experts, gw=gate_up.weights.data_ptr(),
                  gs=gate_up.scales.data_ptr(), go=offsets[0], gb=biases[0], dw=down.weights.data_ptr(),
                  ds=down.scales.data_ptr(), dof=offsets[1], db=biases[1], inner=down.cols, act=GLU_ACTS[act],
                  alpha=alpha, limit=limit, y=y.data_ptr(), threads=threads)
    if rc == -2:
        raise ValueError("an expert index outside the layer's experts, or shapes the kernel does not take")
    if rc != 0:
        raise MemoryError("no memory for the experts' scratch")
    return y
