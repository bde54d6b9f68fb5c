"""kvcellar's own CPU kernels for quantized linears (``q8_kernels.c``), built on first use.

On an x86-64 CPU with AVX2, FMA and F16C, int4/int8 linears quantize their activations to 8
bits per block of 32 and multiply in 8-bit dot products (``int8`` activations in
``KernelTable.kernel_dtype`` terms); torch's int4 kernel converts every weight to float
first and stays well below memory speed on such a CPU (docs/performance.md). Decode-sized
steps of int4 weights read each weight row as it lies; prefill-sized ones multiply panels
of 8 weight rows (``PANEL_MIN_ROWS`` rows on; 16 rows with AVX-512's 8-bit dot product
where the CPU has it, ``WIDE_PANEL_MIN_ROWS`` rows on). Every int4 kernel sums each output
in the same order, so a row's outputs are the same bits whatever the step's row count.
``moe_matmul`` runs all routed experts of a MoE layer's projection in one call, each
expert's rows by the same arithmetic. The library also attends over KV blocks where they lie
(``attend_kv``: every query position by the same arithmetic, a decode step's or a prefill
chunk's), reads and writes quantized KV blocks and checksums block files (``crc32``).

The C file is compiled once per source, compiler and flags with the system C compiler into
``native/`` under the default cache directory (``paths.resolve_cache_dir``: one build per
user, whatever ``--cache-dir`` a server is given) and loaded with ctypes (which drops the
GIL around each call). It runs on the OpenMP runtime torch has loaded already, so its
threads are torch's. Where it cannot be built (another CPU, no compiler,
``KVCELLAR_NATIVE_KERNELS=0``) ``library()`` is None and torch's kernels run as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from kvcellar.cache.kv_pool import KVLayout
from kvcellar.paths import resolve_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q8_kernels.c")
CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
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
ENV_SWITCH = "KVCELLAR_NATIVE_KERNELS"
# The revision of the numbers these kernels compute (part of the KV namespace where they
# compute the KV): bumped whenever a change moves a bit of any output. 2: every int4 kernel
# sums as the panels do, and attention gives every position the decode step's arithmetic.
# 3: sliding-window layers attend by the kernel too (they ran SDPA).
ARITHMETIC = "kvc-3"

_P = ctypes.c_void_p
_I = ctypes.c_int64
_N = ctypes.c_int
_SIGNATURES = {
    "kvc_quantize_q8": [_P, _I, _I, _P, _P, _P, _N],
    "kvc_gemm_q4": [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _N],
    "kvc_gemm_q4_panels": [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _N],
    "kvc_gemm_q4_panels16": [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _N],
    "kvc_gemm_q8": [_P, _P, _I, _I, _P, _P, _I, _P, _N],
    "kvc_moe_q4": [_P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _P, _N],
    "kvc_moe_q8": [_P, _P, _P, _I, _I, _I, _P, _P, _P, _N],
    "kvc_gemm_mxfp4": [_P, _P, _I, _I, _P, _P, _I, _P, _N],
    "kvc_moe_mxfp4": [_P, _P, _P, _I, _I, _I, _P, _P, _P, _N],
    "kvc_dequantize_mxfp4": [_P, _P, _I, _I, _I, _P, _N],
    "kvc_dequantize_q4": [_P, _P, _P, _I, _I, _I, _P, _N, _N],
    "kvc_gather_kv": [_P, _I, _I, _I, _P, _I, _I, _I, _I, _N, _P, _N, _N],
    "kvc_write_kv": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _I, _I, _N, _P, _N, _N],
    "kvc_attend_kv": [_P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _N, _P, _I, ctypes.c_float, _P,
                      _I, _P, _N],
    "kvc_crc32": [_P, _I, ctypes.c_uint32],
}
_RESULTS = {"kvc_moe_q4": ctypes.c_int, "kvc_moe_q8": ctypes.c_int, "kvc_moe_mxfp4": ctypes.c_int,
            "kvc_attend_kv": ctypes.c_int, "kvc_write_kv": ctypes.c_int, "kvc_crc32": ctypes.c_uint32}
# The CPU flags ``kvc_crc32`` needs beyond ``CPU_FLAGS`` (carry-less multiplication).
CRC_FLAGS = frozenset({"pclmulqdq", "sse4_1"})
# Below this many bytes zlib's CRC-32 is as quick as a call into the library.
CRC_MIN_BYTES = 4096


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded once per process; None where they cannot run here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or not cpu_flags() >= CPU_FLAGS:
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: torch's quantized kernels run instead of kvcellar's")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
        digest = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *COMPILE_FLAGS]).encode()).hexdigest()
        folder = resolve_cache_dir() / "native"
        target = folder / f"q8_kernels-{digest[:16]}.so"
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
            os.close(fd)
            try:
                subprocess.run([cc, *COMPILE_FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                               check=True, timeout=120)
                os.replace(tmp, target)  # atomic: a process starting beside this one loads a whole file
            finally:
                Path(tmp).unlink(missing_ok=True)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("kvcellar's CPU kernels could not be built (%s); torch's run instead", detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _RESULTS.get(name)
    return lib


def available() -> bool:
    return library() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("kvcellar's CPU kernels are not available here")
    return lib


def quantize_activations(x: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` float32 ``[rows, cols]`` as 8-bit blocks: values (even inputs of a block first),
    scales, and scale x sum of the block's values."""
    rows, cols = x.shape
    x = x.contiguous()
    xq = torch.empty(rows, cols, dtype=torch.int8)
    xd = torch.empty(rows, cols // BLOCK)
    xs = torch.empty(rows, cols // BLOCK)
    _lib().kvc_quantize_q8(x.data_ptr(), rows, cols, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), threads)
    return xq, xd, xs


@functools.cache
def wide_panels() -> bool:
    """Whether this CPU runs ``kvc_gemm_q4_panels16``."""
    return cpu_flags() >= WIDE_FLAGS


def panel_min_rows(out: int) -> int:
    """Rows from which on ``matmul_int4`` multiplies panels of ``out`` outputs, on this CPU."""
    return WIDE_PANEL_MIN_ROWS if out % WIDE_PANEL == 0 and wide_panels() else PANEL_MIN_ROWS


def int4_kernel(rows: int, out: int) -> str:
    """The kernel ``matmul_int4`` runs for ``rows`` activations and ``out`` outputs. All
    three give every output the same numbers to the bit, whatever the other rows."""
    if rows < panel_min_rows(out) or out % PANEL:
        return "kvc_gemm_q4"
    return "kvc_gemm_q4_panels16" if out % WIDE_PANEL == 0 and wide_panels() else "kvc_gemm_q4_panels"


def matmul_int4(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                threads: int, kernel: str | None = None) -> torch.Tensor:
    """``x @ w.T`` in float32 for int4 ``w`` (``nibbles`` uint8 ``[out, in / 2]``, float16
    ``scales``/``offsets`` ``[out, in / 32]``), ``x`` float32 ``[rows, in]``; ``kernel``:
    another than ``int4_kernel``'s choice (a test comparing them)."""
    out = nibbles.shape[0]
    rows, cols = x.shape
    xq, xd, xs = quantize_activations(x, threads)
    y = torch.empty(rows, out)
    gemm = getattr(_lib(), kernel or int4_kernel(rows, out))
    gemm(nibbles.data_ptr(), scales.data_ptr(), offsets.data_ptr(), out, cols, xq.data_ptr(), xd.data_ptr(),
         xs.data_ptr(), rows, y.data_ptr(), threads)
    return y


def matmul_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, threads: int) -> torch.Tensor:
    """``x @ w.T`` in float32 for int8 ``w`` (``qweight`` ``[out, in]``, float32 ``scales [out]``)."""
    return _matmul_scaled("kvc_gemm_q8", x, qweight, scales, threads)


def matmul_mxfp4(x: torch.Tensor, nibbles: torch.Tensor, exponents: torch.Tensor, threads: int) -> torch.Tensor:
    """``x @ w.T`` in float32 for MXFP4 ``w`` (``nibbles`` uint8 ``[out, in / 2]`` as int4's, each
    an E2M1 code; ``exponents`` uint8 E8M0 ``[out, in / 32]``), ``x`` float32 ``[rows, in]``."""
    return _matmul_scaled("kvc_gemm_mxfp4", x, nibbles, exponents, threads)


def _matmul_scaled(kernel: str, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                   threads: int) -> torch.Tensor:
    """A kernel that takes the weight, its scales and the 8-bit activations with their block
    scales (no offsets): int8's and MXFP4's."""
    out = weight.shape[0]
    rows, cols = x.shape
    xq, xd, _ = quantize_activations(x, threads)
    y = torch.empty(rows, out)
    getattr(_lib(), kernel)(weight.data_ptr(), scales.data_ptr(), out, cols, xq.data_ptr(), xd.data_ptr(), rows,
                            y.data_ptr(), threads)
    return y


def dequantize_mxfp4(nibbles: torch.Tensor, exponents: torch.Tensor, start: int, end: int, out: torch.Tensor,
                     threads: int) -> torch.Tensor:
    """Rows ``start:end`` of an MXFP4 weight (layout as ``matmul_mxfp4``) into float32 ``out``."""
    cols = nibbles.shape[1] * 2
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == (end - start, cols)
    _lib().kvc_dequantize_mxfp4(nibbles.data_ptr(), exponents.data_ptr(), start, end, cols, out.data_ptr(), threads)
    return out


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert of a MoE layer, as ``moe_matmul`` reads it: the
    addresses of each expert's quantized weight (``kind`` int4, int8 or mxfp4, laid out as
    ``matmul_int4``'s, ``matmul_int8``'s or ``matmul_mxfp4``'s), its scales (mxfp4: exponents)
    and (int4) offsets, int64
    ``[experts]``; ``keep`` holds the tensors they point into."""

    kind: str
    out: int
    cols: int
    weights: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    keep: tuple[torch.Tensor, ...]


def expert_weights(kind: str, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                   offsets: Sequence[torch.Tensor] | None = None) -> ExpertWeights:
    """``ExpertWeights`` over per-expert tensors (all of one shape and layout)."""
    if kind not in ("int4", "int8", "mxfp4") or (kind == "int4") != (offsets is not None):
        raise ValueError(f"experts of kind {kind!r} take {'offsets' if kind == 'int4' else 'no offsets'}")
    out, packed = weights[0].shape
    cols = packed if kind == "int8" else packed * 2
    tensors = [*weights, *scales, *(offsets or ())]
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        raise ValueError("experts' weights must be contiguous CPU tensors")
    if any(w.shape != weights[0].shape for w in weights):
        raise ValueError("experts of one projection must share a shape")

    def addresses(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)

    return ExpertWeights(kind, out, cols, addresses(weights), addresses(scales),
                         None if offsets is None else addresses(offsets), tuple(tensors))


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
    xq, xd, xs = quantize_activations(x, threads)
    y = torch.empty(rows, experts.out)
    if experts.kind == "int4":
        assert experts.offsets is not None
        status = _lib().kvc_moe_q4(experts.weights.data_ptr(), experts.scales.data_ptr(), experts.offsets.data_ptr(),
                                   starts.data_ptr(), n_experts, experts.out, cols, xq.data_ptr(), xd.data_ptr(),
                                   xs.data_ptr(), y.data_ptr(), threads)
    else:
        kernel = _lib().kvc_moe_q8 if experts.kind == "int8" else _lib().kvc_moe_mxfp4
        status = kernel(experts.weights.data_ptr(), experts.scales.data_ptr(), starts.data_ptr(), n_experts,
                        experts.out, cols, xq.data_ptr(), xd.data_ptr(), y.data_ptr(), threads)
    if status != 0:
        raise MemoryError("no memory for the experts' work list")
    return y


def dequantize_int4(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, start: int, end: int,
                    out: torch.Tensor, threads: int) -> torch.Tensor:
    """Rows ``start:end`` of an int4 weight (layout as ``matmul_int4``) into ``out``
    ``[end - start, in]``, float32 or bfloat16 (rounded as ``Tensor.to`` rounds):
    ``q * scale + offset``."""
    cols = nibbles.shape[1] * 2
    assert out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous() and out.shape == (end - start, cols)
    _lib().kvc_dequantize_q4(nibbles.data_ptr(), scales.data_ptr(), offsets.data_ptr(), start, end, cols,
                             out.data_ptr(), out.dtype == torch.bfloat16, threads)
    return out


@functools.cache
def folds_crc32() -> bool:
    """Whether ``crc32`` runs kvcellar's kernel here (else zlib's)."""
    return cpu_flags() >= CRC_FLAGS and available()


def crc32(buf: memoryview | bytes | bytearray, value: int = 0) -> int:
    """``zlib.crc32(buf, value)``, by carry-less multiplication where the CPU has it, several
    times zlib 1.2's speed (docs/performance.md): the block files' payload checksum, which a
    restart computes over every byte it reads."""
    n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if n < CRC_MIN_BYTES or not folds_crc32():
        return zlib.crc32(buf, value) & 0xFFFFFFFF
    address = numpy.frombuffer(buf, dtype=numpy.uint8).ctypes.data
    return int(_lib().kvc_crc32(address, n, value))


def gathers_kv(layout: KVLayout, device: torch.device) -> bool:
    """Whether ``gather_kv`` (and ``attend_kv``, ``write_kv``) take this quantized KV layout:
    on CPU, float32 or bf16, groups of a multiple of 16 values, at most 512."""
    return (device.type == "cpu" and layout.quantized and layout.kv_group_size % 16 == 0
            and layout.kv_group_size <= 512 and layout.dtype in (torch.float32, torch.bfloat16) and available())


def gather_kv(pool: torch.Tensor, layout: KVLayout, layer: int, kv: int, blocks: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s K (``kv`` 0) or V (1) of ``blocks`` (int64 block ids) in a quantized
    KV pool (``pool`` uint8 ``[num_blocks, *layout.storage_shape]``), dequantized in one pass
    into ``[len(blocks) * block_size, kv_heads, head_dim]`` of ``layout.dtype``: what
    ``kv_pool.dequantize_kv`` gives for those blocks, bit for bit."""
    assert pool.is_contiguous() and pool.dtype == torch.uint8 and pool.shape[1:] == layout.storage_shape
    blocks = blocks.to(torch.int64).contiguous()
    if blocks.numel() and not 0 <= int(blocks.min()) <= int(blocks.max()) < pool.shape[0]:
        raise IndexError(f"block ids outside the pool's {pool.shape[0]} blocks")  # C would read past it
    layer_bytes = layout.storage_shape[-1]
    out = torch.empty(blocks.numel() * layout.block_size, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype)
    _lib().kvc_gather_kv(pool.data_ptr(), layout.bytes_per_block, (layer * 2 + kv) * layer_bytes,
                         layout.values_bytes, blocks.data_ptr(), blocks.numel(),
                         layout.block_size * layout.num_kv_heads, layout.head_dim, layout.kv_group_size,
                         layout.kv_bits, out.data_ptr(), layout.dtype == torch.bfloat16, torch.get_num_threads())
    return out


def attends_kv(layout: KVLayout, device: torch.device) -> bool:
    """Whether ``attend_kv`` takes this KV layout: on CPU, the quantized layouts ``gathers_kv``
    takes, or float32 and bf16 blocks with heads of a multiple of 16 values."""
    if layout.quantized:
        return gathers_kv(layout, device)
    return (device.type == "cpu" and layout.dtype in (torch.float32, torch.bfloat16) and layout.head_dim % 16 == 0
            and available())


def attend_kv(pool: torch.Tensor, layout: KVLayout, layer: int, tables: torch.Tensor, contexts: torch.Tensor,
              q: torch.Tensor, scale: float, threads: int = 0, rows: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of query positions over a KV pool's blocks, read where they lie:
    sequence ``i`` has ``rows[i]`` query positions (default one each), the last seeing the
    first ``contexts[i]`` tokens of ``tables[i]`` (``[n, width]`` block ids) and each earlier
    one a token fewer; ``q [sum(rows), kv_heads, groups, head_dim]`` (the query heads of each
    KV head; a sequence's positions one after the other). Returns ``q``'s shape and dtype.
    Computed in float32 from the stored values (packed ones dequantized as ``gather_kv``
    does in float32), with its own order of sums: within float32 rounding of SDPA over the
    gathered context, not bit for bit; but a position's result is the same to the bit
    whatever the other positions of its call (a decode step, a prefill chunk of any size).
    ``sinks``: per query head, an attention sink's logit (gpt-oss): a key without a value that
    takes its share of each position's softmax. ``window``: each position sees its last
    ``window`` keys only (a sliding-window layer; 0: all of its context)."""
    total, kv_heads, groups, head_dim = q.shape
    assert pool.is_contiguous() and pool.dtype == layout.storage_dtype and pool.shape[1:] == layout.storage_shape
    assert kv_heads == layout.num_kv_heads and head_dim == layout.head_dim and head_dim % 16 == 0
    n = contexts.shape[0]
    tables = tables.to(torch.int64).contiguous()
    contexts = contexts.to(torch.int64).contiguous()
    rows = torch.ones(n, dtype=torch.int64) if rows is None else rows.to(torch.int64).contiguous()
    assert tables.shape[0] == rows.shape[0] == n and int(rows.sum()) == total
    qf = q.to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        assert sinks.shape == (kv_heads * groups,)
    if layout.quantized:
        layer_bytes, values_bytes, bits = layout.storage_shape[-1], layout.values_bytes, layout.kv_bits
    else:  # float32 or bf16 blocks: 32 or 16 bits as stored
        assert layout.dtype in (torch.float32, torch.bfloat16)
        layer_bytes = layout.bytes_per_block // (layout.num_layers * 2)
        values_bytes, bits = 0, layout.dtype.itemsize * 8
    status = _lib().kvc_attend_kv(pool.data_ptr(), pool.shape[0], layout.bytes_per_block, layer * 2 * layer_bytes,
                                  (layer * 2 + 1) * layer_bytes, values_bytes, tables.data_ptr(),
                                  tables.shape[1], contexts.data_ptr(), rows.data_ptr(), n, layout.block_size,
                                  kv_heads, head_dim, layout.kv_group_size, bits, qf.data_ptr(), groups, scale,
                                  None if sinks is None else sinks.data_ptr(), window, out.data_ptr(),
                                  threads or torch.get_num_threads())
    if status == -2:
        raise IndexError("a block outside the pool, or a context longer than its block table or shorter than its rows")
    if status != 0:
        raise MemoryError("no scratch memory for attention over the pool")
    return out.to(q.dtype)


def write_kv(pool: torch.Tensor, layout: KVLayout, layer: int, kv: int, blocks: torch.Tensor,
             offsets: torch.Tensor, x: torch.Tensor) -> None:
    """``x [n, kv_heads, head_dim]`` (float32 or bf16) quantized into layer ``layer``'s K
    (``kv`` 0) or V (1) at (block, offset) pairs of a quantized KV pool: what
    ``kv_pool.quantize_kv`` and the pool's indexed stores write, bit for bit."""
    assert pool.is_contiguous() and pool.dtype == torch.uint8 and pool.shape[1:] == layout.storage_shape
    assert layout.kv_group_size <= 512 and x.dtype in (torch.float32, torch.bfloat16)
    n = x.shape[0]
    assert x.shape == (n, layout.num_kv_heads, layout.head_dim) and blocks.numel() == offsets.numel() == n
    blocks = blocks.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    x = x.contiguous()
    layer_bytes = layout.storage_shape[-1]
    status = _lib().kvc_write_kv(pool.data_ptr(), pool.shape[0], layout.block_size, layout.bytes_per_block,
                                 (layer * 2 + kv) * layer_bytes, layout.values_bytes, blocks.data_ptr(),
                                 offsets.data_ptr(), n, layout.num_kv_heads, layout.head_dim,
                                 layout.kv_group_size, layout.kv_bits, x.data_ptr(), x.dtype == torch.bfloat16,
                                 torch.get_num_threads())
    if status != 0:
        raise IndexError("a slot outside the pool")
