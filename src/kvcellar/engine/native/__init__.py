"""kvcellar's own CPU kernels, a C file per family with one header (``kvc.h``), built on first
use (``lib``).

On an x86-64 CPU with AVX2, FMA and F16C, int4/int8/MXFP4 linears quantize their activations
to 8 bits per block of 32 and multiply in 8-bit dot products (``matmul``; ``int8``
activations in ``KernelTable.kernel_dtype`` terms): torch's int4 kernel converts every weight
to float first and stays well below memory speed on such a CPU (docs/performance.md). The
library also attends over KV blocks where they lie and reads and writes quantized KV blocks
(``kv``), runs a dense model's layers in one call a step (``layer``), hybrid models' linear
attention (``recurrent``), and checksums block files (``checksum``). Where it cannot be built
(another CPU, no compiler, ``KVCELLAR_NATIVE_KERNELS=0``) ``library()`` is None and torch's
kernels run.
"""

from kvcellar.engine.native.checksum import crc32, folds_crc32
from kvcellar.engine.native.kv import attend_kv, attends_kv, gather_kv, gathers_kv, write_kv
from kvcellar.engine.native.lib import ENV_SWITCH, available, cpu_flags, library
from kvcellar.engine.native.logits import argmax_rows, round_bf16_, topk_row
from kvcellar.engine.native.matmul import (
    ACTIVATION_DTYPES,
    BLOCK,
    INT8_PANEL,
    PANEL,
    PANEL_MIN_ROWS,
    WIDE_FLAGS,
    WIDE_PANEL,
    WIDE_PANEL_MIN_ROWS,
    ExpertWeights,
    Int4Group,
    Int8Group,
    amx_tiles,
    cpu_kernels,
    dequantize_int4,
    dequantize_mxfp4,
    expert_weights,
    int4_kernel,
    matmul_int4,
    matmul_int4_many,
    matmul_int8,
    matmul_int8_many,
    matmul_mxfp4,
    moe_glu,
    moe_matmul,
    pack_int4,
    pack_int8,
    pack_mxfp4,
    panel_layout,
    panel_min_rows,
    panels_fit,
    quantize_activations,
    stores_panels,
    unpack_int4,
    unpack_mxfp4,
    wide_panels,
)
from kvcellar.engine.native.recurrent import (
    RECURRENCE,
    delta_conv,
    delta_inputs,
    gated_delta,
    gated_norm,
    runs_gated_delta,
)
from kvcellar.engine.native.router import ROUTER_ORDERS, route

# The revision of the numbers these kernels compute (part of the KV namespace where they
# compute the KV): bumped whenever a change moves a bit of any output. 2: every int4 kernel
# sums as the panels do, and attention gives every position the decode step's arithmetic.
# 3: sliding-window layers attend by the kernel too (they ran SDPA). 4: the hidden states'
# RMSNorm on the kernels (``norm.rms_norm_for``), with its own order of sums. 5: a gated MLP's
# silu on the kernels (``layer.silu_for``: their exp) and Qwen3's per-head norms too, for the
# one-call layers of ``layer.c``.
ARITHMETIC = "kvc-5"
# The revision of a MoE block's numbers where these kernels route it (``route``) or run its
# experts whole (``moe_glu``): their softmax and gating round as libm's expf and exp8 do, not
# as torch's, so the KV namespace names them (MXFP4 experts, which only MoE blocks have, too).
# 2: gpt-oss's blocks run whole, and MXFP4 rows sum as int4's do (a block's whole dot product,
# then its scale).
MOE_ARITHMETIC = "kvc-moe-2"

__all__ = [
    "ACTIVATION_DTYPES",
    "ARITHMETIC", "BLOCK", "ENV_SWITCH", "INT8_PANEL", "MOE_ARITHMETIC", "PANEL", "PANEL_MIN_ROWS", "RECURRENCE",
    "ROUTER_ORDERS",
    "WIDE_FLAGS",
    "WIDE_PANEL", "WIDE_PANEL_MIN_ROWS", "ExpertWeights", "Int4Group", "Int8Group", "amx_tiles", "argmax_rows",
    "attend_kv", "attends_kv", "available", "cpu_flags", "cpu_kernels", "crc32",
    "delta_conv", "delta_inputs", "dequantize_int4", "dequantize_mxfp4", "expert_weights", "folds_crc32",
    "gated_delta", "gated_norm", "gather_kv", "gathers_kv",
    "int4_kernel", "library", "matmul_int4", "matmul_int4_many", "matmul_int8", "matmul_int8_many", "matmul_mxfp4",
    "moe_glu", "moe_matmul",
    "pack_int4", "pack_int8", "pack_mxfp4", "panel_layout", "panel_min_rows", "panels_fit", "quantize_activations",
    "round_bf16_",
    "route",
    "runs_gated_delta",
    "stores_panels", "topk_row", "unpack_int4", "unpack_mxfp4",
    "wide_panels", "write_kv",
]
