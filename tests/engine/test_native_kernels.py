"""kvcellar's own CPU kernels (``engine/native``) against float64 references of the same
arithmetic: 8-bit activation blocks times the int4/int8 weights."""

from __future__ import annotations

import itertools
import random
import zlib

import numpy as np
import pytest
import torch

from kvcellar.artifacts.gguf_convert import mxfp4_from_blocks
from kvcellar.engine import native
from kvcellar.engine.linears import FastLinear, KernelTable, quant_kernels_run
from kvcellar.quantization import QuantizedWeight, dequantize_mxfp4, quantize_int4, quantize_int8
from kvcellar.storage import block_format
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from tests._models import make_engine, without_native_kernels

needs_native = pytest.mark.skipif(not native.available(), reason="kvcellar's kernels cannot be built on this machine")
THREADS = 2
# (rows out, inputs): blocks of 32 in whole groups of 8 and with a tail; rows out not a
# multiple of the 16 each thread takes at a time.
SHAPES = [(40, 256), (33, 320), (96, 1056)]
ROWS = (1, 3, 4, 5, 9, 19)  # around the tile of 4 activation rows; from 8 (5 on AVX-512 VNNI) on, int4 panels


def activations(rows: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 3
    x[0, :32] = 0.0  # a block of zeros: scale 0
    x[-1, -32:] *= 1e-6  # a block of tiny values
    return x


def rounded(x: torch.Tensor) -> torch.Tensor:
    """d * round(x * (1 / d)) per block of 32, d = max|x| / 127, each step in float32 as the
    kernels compute it; the product in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).double() * d.double()).view_as(x)


def int4_weight(out: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nibbles, float16 scales and offsets, and the weight they make in float64."""
    q = quantize_int4(torch.randn(out, cols, generator=torch.Generator().manual_seed(out)) * 0.05)
    scales, offsets = q.scales.half(), q.offsets.half()
    values = q.int4_values().double().view(out, cols // 32, 32)
    weight = (values * scales.double()[..., None] + offsets.double()[..., None]).view(out, cols)
    return q.qweight, scales, offsets, weight


def mxfp4_weight(out: int, cols: int, seed: int = 0) -> QuantizedWeight:
    """Random weights as GGUF's MXFP4 blocks (the gguf package's encoder), read as kvcellar
    reads a file's; exponents spread over many powers of two, a block with exponent 0."""
    import gguf

    w = torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    powers = np.random.default_rng(seed).integers(-12, 4, size=(out, cols // 32, 1))
    w *= np.exp2(powers).repeat(32, 2).reshape(out, cols)
    q = mxfp4_from_blocks(gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.MXFP4))
    q.scales[0, 0] = 0  # 2^-127: a subnormal block scale
    return q


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 2e-6 * want.abs().max().item()


@needs_native
def test_activation_blocks_are_rounded_to_8_bits_with_their_scale():
    x = activations(3, 320)
    xq, xd, xs = native.quantize_activations(x, THREADS)
    blocks = x.view(3, 10, 32)
    assert torch.equal(xd, (blocks.abs().amax(dim=-1) / 127))
    q = xq.view(3, 10, 32).double()
    natural = torch.stack([q[..., :16], q[..., 16:]], dim=-1).reshape(3, 10, 32)  # even inputs first, then odd
    assert torch.allclose(natural * xd.double()[..., None], rounded(x).view(3, 10, 32), rtol=0, atol=1e-12)
    assert natural.abs().max() <= 127 and torch.all(natural[0, 0] == 0)
    assert torch.allclose(xs.double(), xd.double() * natural.sum(dim=-1), rtol=1e-6)
    ties = torch.cat([torch.tensor([127.0]), torch.arange(31) - 15.5]).view(1, 32)  # a scale of 1: every x.5
    xq, xd, xs = native.quantize_activations(torch.cat([ties, -ties], 1), THREADS)
    natural = torch.stack([xq[0, :16], xq[0, 16:32]], dim=-1).reshape(32)
    assert torch.equal(natural.float(), torch.round(ties[0])) and torch.equal(xq[0, :32], -xq[0, 32:])  # half to even
    assert xs[0, 0].item() == torch.round(ties[0]).sum().item()


@needs_native
@pytest.mark.parametrize(("out", "cols"), SHAPES)
def test_int4_matmul_is_the_8_bit_activations_times_the_weight(out, cols):
    nibbles, scales, offsets, weight = int4_weight(out, cols)
    for rows in ROWS:
        x = activations(rows, cols)
        assert_close(native.matmul_int4(x, nibbles, scales, offsets, THREADS), rounded(x) @ weight.T)
        assert_close(native.matmul_int4(x, nibbles, scales, offsets, 1), rounded(x) @ weight.T)


@needs_native
def test_int4_panels_give_each_row_the_same_numbers_in_any_chunk():
    """From ``panel_min_rows`` rows on, each output is its blocks' products summed in block
    order whatever the other rows: a prompt's KV does not depend on how it was chunked."""
    nibbles, scales, offsets, _ = int4_weight(96, 1056)
    x = activations(45, 1056)
    whole = native.matmul_int4(x, nibbles, scales, offsets, THREADS)
    first = native.panel_min_rows(96)
    for start, end in ((0, first), (first, 21), (21, 45)):
        assert torch.equal(native.matmul_int4(x[start:end], nibbles, scales, offsets, 1), whole[start:end])


@needs_native
@pytest.mark.parametrize(("out", "cols"), [(96, 1056), (40, 256), (33, 320), (13, 8192)])
def test_every_int4_kernel_gives_a_row_the_same_numbers_at_any_row_count(out, cols):
    """The row kernel (decode steps), the panels (prefill chunks) and a step of any size give
    each row's outputs the same bits: a cache hit's last tokens, computed in a small step,
    get the numbers the cold prompt's large step gave them. Outputs not a multiple of 8 (the
    row kernel's groups), blocks not a multiple of 8, rows longer than one pass's chunk."""
    nibbles, scales, offsets, _ = int4_weight(out, cols)
    x = activations(45, cols)
    kernels = ["kvc_gemm_q4"]
    if out % native.PANEL == 0:
        kernels.append("kvc_gemm_q4_panels")
    if out % native.WIDE_PANEL == 0 and native.wide_panels():
        kernels.append("kvc_gemm_q4_panels16")
    whole = native.matmul_int4(x, nibbles, scales, offsets, THREADS, kernels[-1])
    for kernel in kernels:
        assert torch.equal(native.matmul_int4(x, nibbles, scales, offsets, THREADS, kernel), whole), kernel
    for start, end in ((0, 1), (1, 3), (3, 7), (7, 8), (8, 21), (21, 45), (44, 45)):
        assert torch.equal(native.matmul_int4(x[start:end], nibbles, scales, offsets, 1), whole[start:end])
    if out % native.PANEL == 0:  # the weight kept as panels: the same bits at every row count
        panels = native.pack_int4(nibbles, scales, offsets, THREADS)
        assert panels[2] is not None  # this quantizer's offsets are its own
        rows_layout = (nibbles, scales, offsets)
        assert all(p.shape == t.shape and not torch.equal(p, t) for p, t in zip(panels, rows_layout, strict=True))
        assert all(torch.equal(u, t) for u, t in zip(native.unpack_int4(*panels, THREADS), rows_layout, strict=True))
        assert torch.equal(native.matmul_int4(x, *panels, THREADS, panels=True), whole)
        for start, end in ((0, 1), (1, 3), (3, 7), (7, 8), (8, 21), (21, 45), (44, 45)):
            assert torch.equal(native.matmul_int4(x[start:end], *panels, 1, panels=True), whole[start:end])


@needs_native
def test_a_bf16_models_activations_go_in_and_out_of_the_kernels_without_a_float32_copy():
    """bf16 activations are quantized as their float32 copy is, and weights kept as panels write
    bf16 results as ``.to`` rounds the float32 ones: a bf16 model's linears give the bits they
    gave through float32 copies, at every row count, grouped or alone."""
    nibbles, scales, offsets, _ = int4_weight(96, 1056)
    panels = native.pack_int4(nibbles, scales, offsets, THREADS)
    for rows in (1, 5, 8, 13, 45):
        x = activations(rows, 1056).bfloat16()
        assert all(torch.equal(a, b) for a, b in zip(native.quantize_activations(x, THREADS),
                                                      native.quantize_activations(x.float(), THREADS), strict=True))
        want = native.matmul_int4(x.float(), *panels, THREADS, panels=True).to(torch.bfloat16)
        assert torch.equal(native.matmul_int4(x, *panels, THREADS, panels=True, out_dtype=torch.bfloat16), want)
        assert torch.equal(native.matmul_int4(x, nibbles, scales, offsets, THREADS, out_dtype=torch.bfloat16), want)
        for y in native.Int4Group([panels, panels], panels=True)(x, THREADS, torch.bfloat16):
            assert torch.equal(y, want)
    # outputs that are exact integers (scale 1, offset 0; one block whose largest input is 127):
    # 127 q0 + q1 = 257 and 259 lie halfway between bf16 neighbours (to even: 256, 260); a NaN scale
    targets = [(2, 3), (2, 5), (2, 4), (15, 15)]
    nib = torch.zeros(16, 16, dtype=torch.uint8)
    for j, (q0, q1) in enumerate(targets):
        nib[j, 0] = q0 | q1 << 4  # input 0 in the low nibble, input 1 in the high one
    ones = torch.ones(16, 1, dtype=torch.float16)
    ones[15] = float("nan")
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([127.0, 1.0])
    got = native.matmul_int4(x, *native.pack_int4(nib, ones, torch.zeros_like(ones), 1), 1, panels=True,
                             out_dtype=torch.bfloat16)
    assert got[0, :4].tolist() == [256.0, 260.0, 258.0, 1920.0] and got[0, 15].isnan()


@needs_native
@pytest.mark.parametrize(("out", "cols"), SHAPES)
def test_the_int8_kernel_gives_a_row_the_same_numbers_at_any_row_count(out, cols):
    q = quantize_int8(torch.randn(out, cols, generator=torch.Generator().manual_seed(cols)) * 0.05)
    x = activations(23, cols)
    whole = native.matmul_int8(x, q.qweight, q.scales, THREADS)
    for start, end in ((0, 1), (1, 4), (4, 9), (9, 23)):
        assert torch.equal(native.matmul_int8(x[start:end], q.qweight, q.scales, 1), whole[start:end])


@needs_native
@pytest.mark.parametrize(("kind", "out", "cols"), [
    *((kind, out, cols) for kind in ("int4", "int8", "mxfp4") for out, cols in ((40, 256), (33, 320))),
    ("int4 panels", 40, 256), ("mxfp4 panels", 40, 256), ("mxfp4 panels", 24, 320),  # kept as panels (rows in 8s)
])
def test_routed_experts_in_one_call_are_each_experts_linear_to_the_bit(kind, out, cols):
    """``moe_matmul`` runs a MoE layer's experts in one call: each expert's rows (none, one,
    a tile and a tail, a panel's worth and more) get the bits its linear gives them alone,
    so a token's numbers do not depend on which other tokens share its step or its experts."""
    counts = [0, 1, 3, 0, 5, 8, 13, 0]
    x = activations(sum(counts), cols)
    if kind.startswith("int4"):
        quants = [quantize_int4(torch.randn(out, cols, generator=torch.Generator().manual_seed(e)) * 0.05)
                  for e in range(len(counts))]
        parts = [(q.qweight, q.scales.half(), q.offsets.half()) for q in quants]
        kept = [native.pack_int4(*p, THREADS) for p in parts] if kind == "int4 panels" else parts
        experts = native.expert_weights("int4", [p[0] for p in kept], [p[1] for p in kept], [p[2] for p in kept],
                                        panels=kind == "int4 panels")

        def alone(rows: torch.Tensor, e: int) -> torch.Tensor:
            return native.matmul_int4(rows, *parts[e], 1)
    elif kind == "int8":
        quants = [quantize_int8(torch.randn(out, cols, generator=torch.Generator().manual_seed(e)) * 0.05)
                  for e in range(len(counts))]
        experts = native.expert_weights("int8", [q.qweight for q in quants], [q.scales for q in quants])

        def alone(rows: torch.Tensor, e: int) -> torch.Tensor:
            return native.matmul_int8(rows, quants[e].qweight, quants[e].scales, 1)
    else:
        quants = [mxfp4_weight(out, cols, seed=e) for e in range(len(counts))]
        kept_mx = ([native.pack_mxfp4(q.qweight, q.scales, THREADS) for q in quants] if kind == "mxfp4 panels"
                   else [(q.qweight, q.scales) for q in quants])
        experts = native.expert_weights("mxfp4", [w for w, _ in kept_mx], [e for _, e in kept_mx],
                                        panels=kind == "mxfp4 panels")

        def alone(rows: torch.Tensor, e: int) -> torch.Tensor:
            return native.matmul_mxfp4(rows, quants[e].qweight, quants[e].scales, 1)
    starts = torch.tensor([0, *itertools.accumulate(counts)])
    got = native.moe_matmul(x, experts, starts, THREADS)
    assert got.shape == (sum(counts), out)
    for e in range(len(counts)):
        a, b = int(starts[e]), int(starts[e + 1])
        if b > a:
            assert torch.equal(got[a:b], alone(x[a:b], e)), e
            assert torch.equal(got[a:a + 1], alone(x[a:a + 1], e)), e  # its first row in a step of its own
    with pytest.raises(ValueError):
        native.moe_matmul(x, experts, starts[:-1], THREADS)


def clamped_glu(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's gating (transformers' ``GptOssExperts._apply_gate``)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def halves_glu(act):
    def glu(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up
    return glu


GATINGS = {"silu": halves_glu(torch.nn.functional.silu),
           "gelu_tanh": halves_glu(lambda g: torch.nn.functional.gelu(g, approximate="tanh")),
           "clamped": clamped_glu}


@needs_native
@pytest.mark.parametrize(("kind", "act"), [("int4", "silu"), ("int4", "gelu_tanh"), ("int8", "silu"),
                                           ("mxfp4", "clamped")])
def test_a_moe_block_in_one_call_is_its_experts_gated_and_summed_and_each_token_its_own(kind, act):
    """``moe_glu``: a MoE block's routed experts from input to output in one call. Each token's
    output is its experts' linears (plus their biases, gpt-oss's), gated, weighted and summed
    (within the rounding of its gating, which is the kernel's own, and of the 8-bit activations
    after it); the same bits alone as in any step, and with int4 and MXFP4 experts kept as panels
    as in the row layout."""
    cols, inner, n_experts, k, tokens = 64, 96, 6, 3, 13
    gen = torch.Generator().manual_seed(7)
    parts, biases = {}, {}
    for name, (out, width) in {"gate_up": (2 * inner, cols), "down": (cols, inner)}.items():
        if kind == "mxfp4":  # codes of every value, block scales 1/16 .. 1/2
            parts[name] = [(torch.randint(0, 256, (out, width // 2), dtype=torch.uint8, generator=gen),
                            torch.randint(123, 127, (out, width // 32), dtype=torch.uint8, generator=gen))
                           for _ in range(n_experts)]
            biases[name] = torch.randn(n_experts, out, generator=gen) * (1 if name == "gate_up" else 20)
        else:
            quantize = quantize_int4 if kind == "int4" else quantize_int8
            quants = [quantize(torch.randn(out, width, generator=gen) * 0.1) for _ in range(n_experts)]
            parts[name] = [(q.qweight, q.scales.half(), q.offsets.half()) if kind == "int4" else (q.qweight, q.scales)
                           for q in quants]
            biases[name] = None
    linear = {"int4": native.matmul_int4, "int8": native.matmul_int8, "mxfp4": native.matmul_mxfp4}[kind]

    def experts(name: str, panels: bool) -> native.ExpertWeights:
        pack = native.pack_int4 if kind == "int4" else native.pack_mxfp4
        kept = [pack(*p, THREADS) for p in parts[name]] if panels else parts[name]
        return native.expert_weights(kind, [p[0] for p in kept], [p[1] for p in kept],
                                     [p[2] for p in kept] if kind == "int4" else None, panels=panels)

    def biased(y: torch.Tensor, name: str, e: int) -> torch.Tensor:
        return y if biases[name] is None else y + biases[name][e]

    x = activations(tokens, cols)
    index = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(tokens)])
    index[:4] = torch.tensor([0, 1, 2])  # an expert chosen by many tokens: a panel's worth of its rows
    weights = torch.rand(tokens, k, generator=gen)
    want = torch.zeros(tokens, cols)
    for t in range(tokens):
        for j in range(k):
            e = int(index[t, j])
            gated = GATINGS[act](biased(linear(x[t:t + 1], *parts["gate_up"][e], 1), "gate_up", e))
            want[t] += weights[t, j] * biased(linear(gated, *parts["down"][e], 1), "down", e)[0]
    extra = {"alpha": 1.702, "limit": 7.0} if act == "clamped" else {}

    def block(gate_up: native.ExpertWeights, down: native.ExpertWeights, rows: slice, threads: int) -> torch.Tensor:
        return native.moe_glu(x[rows], index[rows], weights[rows], gate_up, down, act, threads, **extra,
                              gate_up_bias=biases["gate_up"], down_bias=biases["down"])

    results = []
    for panels in (False, True) if kind != "int8" else (False,):
        gate_up, down = experts("gate_up", panels), experts("down", panels)
        got = block(gate_up, down, slice(None), THREADS)
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * float(want.abs().max()))
        for t in (0, 5, 12):
            assert torch.equal(block(gate_up, down, slice(t, t + 1), 1), got[t:t + 1])
        results.append(got)
    assert all(torch.equal(r, results[0]) for r in results)
    with pytest.raises(ValueError):
        native.moe_glu(x, index + n_experts, weights, gate_up, down, act, THREADS)  # no such expert


@needs_native
@pytest.mark.parametrize(("out", "cols"), SHAPES)
def test_mxfp4_matmul_is_the_8_bit_activations_times_the_weight_at_any_row_count(out, cols):
    """The E2M1 codes, their blocks' powers of two (subnormal too) and the 8-bit activations:
    each row's numbers alone are the ones it gets in any step."""
    q = mxfp4_weight(out, cols, seed=cols)
    weight = dequantize_mxfp4(q.qweight, q.scales).double()
    assert torch.equal(weight.float(), q.dequantize(torch.float32))
    x = activations(23, cols)
    whole = native.matmul_mxfp4(x, q.qweight, q.scales, THREADS)
    assert_close(whole, rounded(x) @ weight.T)
    for start, end in ((0, 1), (1, 4), (4, 9), (9, 23)):
        assert torch.equal(native.matmul_mxfp4(x[start:end], q.qweight, q.scales, 1), whole[start:end])
    out_rows = torch.empty(3, cols)
    assert torch.equal(native.dequantize_mxfp4(q.qweight, q.scales, 2, 5, out_rows, THREADS), weight[2:5].float())
    if out % native.PANEL == 0:  # kept as panels: every row count, the same bits; the row layout back
        kept = native.pack_mxfp4(q.qweight, q.scales, THREADS)
        assert not torch.equal(kept[0], q.qweight)
        for start, end in ((0, 1), (1, 4), (4, 9), (9, 23), (0, 23)):
            assert torch.equal(native.matmul_mxfp4(x[start:end], *kept, 1, panels=True), whole[start:end])
        assert all(torch.equal(a, b) for a, b in zip(native.unpack_mxfp4(*kept, THREADS), (q.qweight, q.scales),
                                                      strict=True))
        assert torch.equal(native.dequantize_mxfp4(*kept, 2, 5, out_rows, THREADS, panels=True), weight[2:5].float())


@needs_native
def test_mxfp4_sums_the_largest_products_exactly():
    """Every code 6.0 (doubled: 12) or -6.0, activations at their blocks' maximum, in both layouts."""
    out, cols = 24, 4096
    nibbles = torch.full((out, cols // 2), 0x77, dtype=torch.uint8)
    nibbles[8:16] = 0xFF  # -6.0: the sign moved onto the activations
    exponents = torch.full((out, cols // 32), 127, dtype=torch.uint8)  # 2^0
    x = torch.ones(2, cols)
    x[1] = -1.0
    want = torch.full((2, out), 6.0 * cols)
    want[1] *= -1
    want[:, 8:16] *= -1
    assert torch.equal(native.matmul_mxfp4(x, nibbles, exponents, THREADS), want)
    assert torch.equal(native.matmul_mxfp4(x, *native.pack_mxfp4(nibbles, exponents, THREADS), THREADS, panels=True),
                       want)


@needs_native
def test_int4_panels_sum_the_largest_products_exactly():
    """Every nibble 15 and every activation at its block's maximum: the 16-bit partial sums
    reach 8 x 2 x 15 x 127 of the 32767 they hold."""
    out, cols = 16, 256
    nibbles = torch.full((out, cols // 2), 0xFF, dtype=torch.uint8)
    scales = torch.ones(out, cols // 32, dtype=torch.float16)
    offsets = torch.zeros(out, cols // 32, dtype=torch.float16)
    x = torch.ones(native.PANEL_MIN_ROWS, cols)
    x[1] = -1.0
    want = torch.full((native.PANEL_MIN_ROWS, out), 15.0 * cols)
    want[1] = -15.0 * cols
    for kernel in ("kvc_gemm_q4_panels", *(("kvc_gemm_q4_panels16",) if native.wide_panels() else ())):
        y = native.matmul_int4(x, nibbles, scales, offsets, THREADS, kernel)
        assert torch.allclose(y, want, rtol=1e-6, atol=0)


@needs_native
@pytest.mark.skipif(not native.wide_panels(), reason="this CPU has no AVX-512 8-bit dot product")
@pytest.mark.parametrize(("out", "cols"), [(96, 1056), (48, 1024)])
def test_wide_int4_panels_give_the_avx2_panels_numbers_to_the_bit(out, cols):
    """Blocks in whole transposes of 16 scales and with a tail; rows in whole tiles of 8
    and not: which panels a CPU runs never changes a number."""
    nibbles, scales, offsets, weight = int4_weight(out, cols)
    for rows in (5, 8, 13, 16, 45):
        x = activations(rows, cols)
        wide = native.matmul_int4(x, nibbles, scales, offsets, THREADS, "kvc_gemm_q4_panels16")
        assert torch.equal(wide, native.matmul_int4(x, nibbles, scales, offsets, 1, "kvc_gemm_q4_panels"))
        assert_close(wide, rounded(x) @ weight.T)


# The AVX-512 (AMX) forms' results, computed again by a process told not to run them.
_AVX2_RUN = """
import sys, torch
from tests.engine.test_native_kernels import avx512_cases
torch.save(avx512_cases(), sys.argv[1])
"""


def avx512_cases() -> dict[str, torch.Tensor]:
    """Results of every kernel with an AVX-512 form: int4 weights kept as panels (an even and an
    odd count of panels, derived and own offsets, grouped linears and routed experts) at rows
    around its tiles, int8 weights (an even and an odd count of blocks, a group; kept as panels), silu, and
    attention over bf16, float32, 8-bit and 4-bit blocks as prefill chunks and decode steps."""
    from kvcellar.cache.kv_pool import KVLayout, KVPool

    found: dict[str, torch.Tensor] = {}
    for out, cols in ((96, 1056), (40, 256)):
        nibbles, scales, offsets, _ = int4_weight(out, cols)
        own = native.pack_int4(nibbles, scales, offsets, THREADS)
        derived = native.pack_int4(nibbles, scales, (scales.float() * -8).half(), THREADS)
        for rows in (1, 5, 8, 9, 13, 32, 41, 45):  # 9, 41: a last pass of 9 rows; 32, 45: AMX tiles and past them
            x = activations(rows, cols)
            found[f"int4 {out} {rows}"] = native.matmul_int4(x, *own, THREADS, panels=True)
            found[f"q4_0 {out} {rows}"] = native.matmul_int4(x, *derived, THREADS, panels=True)
            found[f"group {out} {rows}"] = torch.cat(native.matmul_int4_many(x, [own, derived], THREADS, True), 1)
            found[f"bf16 {out} {rows}"] = native.matmul_int4(x.bfloat16(), *own, THREADS, panels=True,
                                                             out_dtype=torch.bfloat16)
    experts = native.expert_weights("int4", *map(list, zip(own, derived, strict=True)), panels=True)
    found["experts"] = native.moe_matmul(activations(19, 256), experts, torch.tensor([0, 10, 19]), THREADS)
    from kvcellar.engine.native.layer import silu_for

    silu = silu_for(torch.nn.functional.silu)
    assert silu is not None
    gate = torch.randn(9, 2 * 264, generator=torch.Generator().manual_seed(2)) * 8  # 16 lanes x 16, then 8
    gate[0, :6] = torch.tensor([1e30, float("inf"), -float("inf"), -90.0, 90.0, -0.0])
    for dtype in (torch.float32, torch.bfloat16):
        found[f"silu {dtype}"] = silu(gate.to(dtype)[:, :264])
    for cols in (1056, 256):  # 33 blocks (two a 512-bit load, then one alone) and 8
        q = quantize_int8(torch.randn(40, cols, generator=torch.Generator().manual_seed(cols)) * 0.05)
        for rows in (1, 5, 8, 13):
            found[f"int8 {cols} {rows}"] = native.matmul_int8(activations(rows, cols), q.qweight, q.scales, THREADS)
        other = quantize_int8(torch.randn(24, cols, generator=torch.Generator().manual_seed(1)))
        found[f"int8 group {cols}"] = torch.cat(native.matmul_int8_many(
            activations(6, cols), [(q.qweight, q.scales), (other.qweight, other.scales)], THREADS), 1)
        pw = native.pack_int8(quantize_int8(torch.randn(48, cols, generator=torch.Generator().manual_seed(2))).qweight,
                              THREADS)
        for rows in (1, 4, 5, 9, 17):  # passes of 8 rows on AVX-512, of 4 on AVX2
            found[f"int8 panels {cols} {rows}"] = native.matmul_int8(activations(rows, cols), pw, torch.ones(48),
                                                                     THREADS, panels=True)
    # head sizes of 4 and 8 vectors of 16 and of one that takes them one at a time
    for dtype, bits, dim in ((torch.bfloat16, 16, 64), (torch.float32, 16, 64), (torch.bfloat16, 8, 64),
                             (torch.bfloat16, 4, 64), (torch.bfloat16, 16, 128), (torch.float32, 16, 80)):
        layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=dim, block_size=16, dtype=dtype, kv_bits=bits,
                          kv_group_size=32 if bits < 16 else 64)
        pool = KVPool(layout, 40, torch.device("cpu"), gather_quantized=native.gather_kv,
                      attend_direct=native.attend_kv, write_quantized=native.write_kv)
        gen = torch.Generator().manual_seed(bits)
        slots = torch.arange(40 * 16)
        pool.write(0, slots // 16, slots % 16, (torch.randn(40 * 16, 2, dim, generator=gen) * 3).to(dtype),
                   torch.randn(40 * 16, 2, dim, generator=gen).to(dtype))
        tables = torch.stack([torch.randperm(40, generator=gen)[:36] for _ in range(3)])
        contexts, rows = torch.tensor([570, 301, 400]), torch.tensor([45, 1, 5])
        for gq in (3, 8, 10):  # query heads of a KV head: odd, a whole 8, past it
            q = (torch.randn(int(rows.sum()), 2, gq, dim, generator=gen) * 2).to(dtype)
            found[f"attend {dtype} {bits} {dim} {gq}"] = pool.attend(0, tables, contexts, q, 0.125, THREADS, rows)
    return found


def _cases_with(tmp_path, switch: str) -> dict[str, torch.Tensor]:
    """``avx512_cases`` computed by a process whose environment turns ``switch`` off."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    target = tmp_path / "cases.pt"
    env = {**os.environ, switch: "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", _AVX2_RUN, str(target)], check=True, env=env, timeout=300,
                   cwd=Path(__file__).parents[2])
    found: dict[str, torch.Tensor] = torch.load(target)
    return found


@needs_native
@pytest.mark.skipif(not native.wide_panels(), reason="this CPU has no AVX-512 8-bit dot product")
def test_the_avx512_kernels_give_the_avx2_kernels_numbers_to_the_bit(tmp_path):
    """KV one replica computes is served by another, whichever CPU each has: the AVX-512 forms
    (two panels a 512-bit dot product, paired keys in attention) change no bit."""
    narrow, wide = _cases_with(tmp_path, "KVCELLAR_AVX512"), avx512_cases()
    assert narrow.keys() == wide.keys()
    for name, got in wide.items():
        assert torch.equal(got, narrow[name]), name


@needs_native
@pytest.mark.skipif(not native.amx_tiles(), reason="this CPU (or its OS) gives no AMX tiles")
def test_the_amx_tiles_give_the_avx512_kernels_numbers_to_the_bit(tmp_path):
    """Prefill-sized steps of int4 panels on AMX tiles (16 rows a tile, the rows past the last
    whole tile by the AVX-512 kernel) give every output the bits the AVX-512 kernel gives it."""
    vectors, tiles = _cases_with(tmp_path, "KVCELLAR_AMX"), avx512_cases()
    assert vectors.keys() == tiles.keys()
    for name, got in tiles.items():
        assert torch.equal(got, vectors[name]), name


@needs_native
@pytest.mark.parametrize(("out", "cols"), SHAPES)
def test_int8_matmul_is_the_8_bit_activations_times_the_weight(out, cols):
    q = quantize_int8(torch.randn(out, cols, generator=torch.Generator().manual_seed(cols)) * 0.05)
    q.qweight[0, :4] = torch.tensor([-128, 127, -127, -128], dtype=torch.int8)  # the extremes the sign trick meets
    weight = q.qweight.double() * q.scales.double()[:, None]
    for rows in ROWS:
        x = activations(rows, cols)
        assert_close(native.matmul_int8(x, q.qweight, q.scales, THREADS), rounded(x) @ weight.T)


@needs_native
@pytest.mark.parametrize(("out", "cols"), [(48, 256), (32, 1056), (96, 320)])
def test_int8_panels_are_the_8_bit_activations_times_the_weight_at_every_row_count(out, cols):
    """int8 weights kept as panels (an LM head's): within float rounding of the 8-bit activations
    times the weight, the extremes of int8 included; a row's outputs the same bits whatever the
    step's rows (tiles of 8 and their remainders) and threads, alone or in a group (``kvc_linear``)."""
    q = quantize_int8(torch.randn(out, cols, generator=torch.Generator().manual_seed(cols)) * 0.05)
    q.qweight[0, :4] = torch.tensor([-128, 127, -127, -128], dtype=torch.int8)
    q.qweight[1, :] = -128  # every lane of a block at its most negative: the unsigned bias at its largest
    pw = native.pack_int8(q.qweight, THREADS)
    assert pw.shape == q.qweight.shape and pw.dtype == torch.uint8
    weight = q.qweight.double() * q.scales.double()[:, None]
    x = activations(27, cols)
    whole = native.matmul_int8(x, pw, q.scales, THREADS, panels=True)
    assert_close(whole, rounded(x) @ weight.T)
    for start, end in ((0, 1), (1, 3), (3, 12), (12, 27)):  # 1, 2, 9 (5 + 4) and 15 (8 + 7) rows a step
        assert torch.equal(native.matmul_int8(x[start:end], pw, q.scales, 1, panels=True), whole[start:end])
    other = quantize_int8(torch.randn(16, cols, generator=torch.Generator().manual_seed(1)) * 0.05)
    both = native.matmul_int8_many(x[:9], [(pw, q.scales), (native.pack_int8(other.qweight, 1), other.scales)],
                                   THREADS, panels=True)
    assert torch.equal(both[0], whole[:9])
    assert_close(both[1], rounded(x[:9]) @ (other.qweight.double() * other.scales.double()[:, None]).T)
    with pytest.raises(ValueError, match="no int8 panel layout"):
        native.pack_int8(q.qweight[: out - 8], THREADS)


@needs_native
def test_an_int8_lm_head_is_kept_as_panels_and_its_numbers_are_theirs():
    """``prepare_model`` keeps a model's int8 LM head as panels (its numbers reach no KV block);
    its other int8 linears stay in the row layout, their numbers unchanged."""
    from kvcellar.engine.linears import prepare_model

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(256, 64, bias=False)
            self.lm_head = torch.nn.Linear(256, 96, bias=False)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

    model = Tiny()
    quants = {name: quantize_int8(m.weight.detach()) for name, m in (("proj", model.proj), ("lm_head", model.lm_head))}
    prepared = prepare_model(model, dict(quants), kernel_dtype=torch.int8)
    assert prepared.head is model.lm_head and model.lm_head.panels and not model.proj.panels
    x = activations(9, 256)
    with torch.inference_mode():
        assert torch.equal(model.lm_head(x), native.matmul_int8(x, native.pack_int8(quants["lm_head"].qweight, 1),
                                                                quants["lm_head"].scales.float(), 1, panels=True))
        proj = quants["proj"]
        assert torch.equal(model.proj(x), native.matmul_int8(x, proj.qweight, proj.scales.float(), 1))
    with pytest.raises(RuntimeError, match="no row layout"):
        model.lm_head.dequantized()


@needs_native
def test_q4_0s_offsets_are_not_kept_as_panels_and_derived_to_the_same_bits():
    """A Q4_0 source's offsets are -8 x its scales: kept as panels, the weight holds none (a
    tenth of its bytes), and every kernel that reads the panels derives them, to the bits of the
    row layout with its offsets: a linear alone, linears together, routed experts, unpacking."""
    nibbles, scales, _, _ = int4_weight(96, 1056)
    offsets = (scales.float() * -8).half()
    pw, ps, po = native.pack_int4(nibbles, scales, offsets, THREADS)
    assert po is None
    x = activations(21, 1056)
    whole = native.matmul_int4(x, nibbles, scales, offsets, THREADS)
    for start, end in ((0, 1), (1, 5), (5, 21)):
        assert torch.equal(native.matmul_int4(x[start:end], pw, ps, None, 1, panels=True), whole[start:end])
    ys = native.matmul_int4_many(x[:3], [(pw, ps, None), native.pack_int4(nibbles, scales, offsets + 1, THREADS)],
                                 THREADS, panels=True)
    assert torch.equal(ys[0], whole[:3])
    assert torch.equal(ys[1], native.matmul_int4(x[:3], nibbles, scales, offsets + 1, 1))
    experts = native.expert_weights("int4", [pw, pw], [ps, ps], [None, None], panels=True)
    assert torch.equal(native.moe_matmul(x[:5], experts, torch.tensor([0, 2, 5]), THREADS), whole[:5])
    assert all(torch.equal(u, t) for u, t in zip(native.unpack_int4(pw, ps, None, THREADS),
                                                 (nibbles, scales, offsets), strict=True))
    with pytest.raises(ValueError, match="offsets"):
        native.matmul_int4(x, nibbles, scales, None, 1)


@needs_native
def test_int4_dequantization_is_exact():
    nibbles, scales, offsets, weight = int4_weight(96, 1056)
    out = torch.empty(90 - 7, 1056)
    native.dequantize_int4(nibbles, scales, offsets, 7, 90, out, THREADS)
    assert torch.equal(out, weight[7:90].float())  # one rounding of q * scale + offset
    bf16 = torch.empty(90 - 7, 1056, dtype=torch.bfloat16)
    native.dequantize_int4(nibbles, scales, offsets, 7, 90, bf16, THREADS)
    assert torch.equal(bf16, out.to(torch.bfloat16))  # rounded to nearest even, as torch rounds
    kept = torch.empty_like(out)
    native.dequantize_int4(*native.pack_int4(nibbles, scales, offsets, THREADS), 7, 90, kept, THREADS, panels=True)
    assert torch.equal(kept, out)


@needs_native
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_on_native_kernels_is_lean_and_runs_its_kernel_at_every_row_count(kind, dtype):
    """No dense copy, and every step through the kernel: a row's outputs are the same bits in
    a one-row step and in a 300-row one (bias added after, in the model's dtype)."""
    q = (quantize_int4 if kind == "int4" else quantize_int8)(torch.randn(200, 320) * 0.05)
    bias = torch.randn(200).to(dtype)
    layer = FastLinear(q.dequantize(dtype), bias, q, KernelTable(kernel_dtype=torch.int8))
    assert layer.native and layer.lean and layer.quant_kind == kind and layer._dense is None
    with pytest.raises(RuntimeError):
        layer.dense(torch.randn(2, 320))
    x = activations(300, 320).to(dtype)
    whole = layer(x)
    assert whole.dtype == dtype
    for rows in (1, 3, 8, 37):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
    want = (rounded(x.float()) @ q.dequantize(torch.float32).double().T).float() + bias.float()
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: the output and the bias rounded
    assert (whole.float() - want).abs().max() <= rtol * want.abs().max()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_of_one_input_called_together_give_each_its_own_calls_bits(dtype):
    """q/k/v-like linears (outputs not multiples of 8 or 16, one with a bias) in one call over the
    input quantized once at decode-sized steps, and apart at prefill-sized ones; those kept as
    panels together at every step: each output the same bits as the linear called alone; a
    group the kernel cannot take runs apart."""
    from kvcellar.engine.linears import call_together

    shapes = [(40, 320), (13, 320), (96, 320), (1, 320)]
    linears = []
    for i, (out, cols) in enumerate(shapes):
        q = quantize_int4(torch.randn(out, cols, generator=torch.Generator().manual_seed(i)) * 0.05)
        bias = torch.randn(out).to(dtype) if i == 1 else None
        linears.append(FastLinear(q.dequantize(dtype), bias, q, KernelTable(kernel_dtype=torch.int8)))
    together = call_together(linears)
    x = activations(37, 320).to(dtype).view(1, 37, 320)
    for rows in (1, 3, 4, 7, 8, 37):
        got = together(x[:, :rows])
        assert len(got) == len(linears)
        for layer, y in zip(linears, got, strict=True):
            assert y.shape == (1, rows, layer.out_features) and y.dtype == dtype
            assert torch.equal(y, layer(x[:, :rows])), (rows, layer.out_features)
    for panels in (False, True):  # the layouts apart: outputs in 8s are kept as panels where stores_panels
        group = [m for m in linears if m.panels == panels]
        ys = native.matmul_int4_many(x[0, :3].float(), [(m._q, m._scale, m._zero) for m in group], THREADS, panels)
        for layer, y in zip(group, ys, strict=True):
            assert torch.equal(y, native.matmul_int4(x[0, :3].float(), layer._q, layer._scale, layer._zero, 1,
                                                     panels=panels))
    assert [m.panels for m in linears] == [native.stores_panels(m.out_features) for m in linears]
    kept = call_together([linears[0], linears[2]])  # 40 and 96 outputs: both kept as panels
    for rows in (1, 8, 37):
        assert all(torch.equal(y, m(x[:, :rows])) for y, m in zip(kept(x[:, :rows]), linears[::2], strict=True))
    mixed = call_together([linears[0], torch.nn.Linear(320, 8).to(dtype)])  # not all int4: each its own call
    assert [y.shape[-1] for y in mixed(x[:, :2])] == [40, 8]


@needs_native
def test_int8_linears_of_one_input_called_together_give_each_its_own_calls_bits():
    """q/k/v-like int8 linears (a Q8_0 file's) in one call over the input quantized once, at every
    row count: each output the same bits as the linear called alone."""
    from kvcellar.engine.linears import call_together

    linears = []
    for i, out in enumerate((40, 13, 1)):
        q = quantize_int8(torch.randn(out, 320, generator=torch.Generator().manual_seed(i)) * 0.05)
        linears.append(FastLinear(q.dequantize(torch.float32), torch.randn(out) if i == 1 else None, q,
                                  KernelTable(kernel_dtype=torch.int8)))
    together = call_together(linears)
    assert together.__name__ == "together"  # one call, not each its own
    x = activations(37, 320).view(1, 37, 320)
    for rows in (1, 5, 37):
        for layer, y in zip(linears, together(x[:, :rows]), strict=True):
            assert torch.equal(y, layer(x[:, :rows])), (rows, layer.out_features)
    ys = native.matmul_int8_many(x[0, :9], [(m._q, m._scale) for m in linears], THREADS)
    for layer, y in zip(linears, ys, strict=True):
        assert torch.equal(y, native.matmul_int8(x[0, :9], layer._q, layer._scale, 1))


def test_without_the_kernels_int8_activations_run_nothing(monkeypatch):
    without_native_kernels(monkeypatch)
    assert not native.available() and not quant_kernels_run(torch.int8, torch.device("cpu"))
    q = quantize_int4(torch.randn(64, 256) * 0.05)
    layer = FastLinear(q.dequantize(torch.float32), None, q, KernelTable(kernel_dtype=torch.int8))
    assert layer.quant_kind is None and not layer.lean  # the dequantized weight, dense
    x = torch.randn(2, 256)
    assert torch.allclose(layer(x), x @ q.dequantize(torch.float32).T, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group"), [(8, 64), (8, 16), (4, 64), (4, 32)])
def test_the_pools_quantized_gather_is_dequantize_kv_bit_for_bit(dtype, bits, group):
    """The C gather of quantized KV blocks against the pool's own (index_select, then
    ``dequantize_kv``): the same numbers in float32 and in bf16, any block order, repeats."""
    from kvcellar.cache.kv_pool import KVLayout, KVPool

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_size=4, dtype=dtype, kv_bits=bits,
                      kv_group_size=group)
    assert native.gathers_kv(layout, torch.device("cpu"))
    pools = [KVPool(layout, 9, torch.device("cpu")),
             KVPool(layout, 9, torch.device("cpu"), gather_quantized=native.gather_kv)]
    gen = torch.Generator().manual_seed(bits * group)
    slots = torch.arange(9 * 4)
    for layer in range(3):
        key, value = (torch.randn(36, 2, 64, generator=gen) * 4).to(dtype), torch.randn(36, 2, 64, generator=gen)
        key[5] = 0.0  # a group of zeros: scale 0
        for pool in pools:
            pool.write(layer, slots // 4, slots % 4, key, value.to(dtype))
    table = torch.tensor([[3, 1, 8, 1], [0, 5, 5, 2]])
    for layer in range(3):
        want, got = pools[0].gather(layer, table), pools[1].gather(layer, table)
        for w, g in zip(want, got, strict=True):
            assert g.dtype == dtype and g.shape == w.shape == (2, 2, 16, 64)
            assert torch.equal(g, w)
    with pytest.raises(IndexError):
        pools[1].gather(0, torch.tensor([[9]]))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group", "groups", "dim"),
                         [(8, 64, 3, 64), (8, 16, 1, 64), (4, 64, 7, 64), (4, 32, 2, 64), (16, 64, 3, 64),
                          (16, 64, 1, 64), (8, 32, 4, 128), (16, 64, 4, 128)])
def test_attention_over_blocks_where_they_lie_is_sdpa_over_the_gather(dtype, bits, group, groups, dim):
    """``KVPool.attend`` (the C kernel reading float32, bf16 or packed blocks) against SDPA
    over the gathered (dequantized) context with a key-length mask: contexts of one token,
    inside a block, across the kernel's chunks of 256 tokens, of different lengths in one
    batch; tables with repeats."""
    import dataclasses

    import torch.nn.functional as F

    from kvcellar.cache.kv_pool import KVLayout, KVPool

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=dim, block_size=16, dtype=dtype, kv_bits=bits,
                      kv_group_size=group)
    pool = KVPool(layout, 80, torch.device("cpu"), gather_quantized=native.gather_kv,
                  attend_direct=native.attend_kv)
    assert native.attends_kv(layout, torch.device("cpu"))
    assert pool.attends and not KVPool(layout, 2, torch.device("cpu")).attends
    gen = torch.Generator().manual_seed(bits * group + groups)
    slots = torch.arange(80 * 16)
    for layer in range(2):
        key = torch.randn(80 * 16, 2, dim, generator=gen) * 3
        key[7] = 0.0  # a token of zeros: scale 0
        pool.write(layer, slots // 16, slots % 16, key.to(dtype), torch.randn(80 * 16, 2, dim, generator=gen).to(dtype))
    contexts = torch.tensor([1, 13, 1100, 16 * 75])
    tables = torch.stack([torch.randint(0, 80, (75,), generator=gen) for _ in contexts])
    tables[2, 3] = tables[2, 40]
    q = (torch.randn(len(contexts), 2, groups, dim, generator=gen) * 2).to(dtype)
    mask = (torch.arange(75 * 16)[None, :] < contexts[:, None])[:, None, None, :]
    # The reference reads the same packed bytes dequantized in float32, as the kernel computes.
    wide = pool
    if bits < 16:
        wide = KVPool(dataclasses.replace(layout, dtype=torch.float32), 80, torch.device("cpu"))
        wide.data.copy_(pool.data)
    for layer in range(2):
        got = pool.attend(layer, tables, contexts, q, 0.125)
        # each chunk's sums and their merge run in one order whatever the thread count
        assert torch.equal(pool.attend(layer, tables, contexts, q, 0.125, 1), got)
        assert torch.equal(pool.attend(layer, tables, contexts, q, 0.125, 3), got)
        k, v = wide.gather(layer, tables)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125)
        assert got.dtype == dtype and got.shape == q.shape
        # float32: sums in another order (~50 ulp over 128 dims); bf16: the output is rounded
        # to bf16 (8 bits of mantissa)
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-3, 8e-3)
        assert torch.allclose(got.float(), want, atol=atol, rtol=rtol), (got.float() - want).abs().max()
    with pytest.raises(IndexError):
        pool.attend(0, torch.tensor([[80]]), torch.tensor([1]), q[:1], 0.125)
    with pytest.raises(IndexError):
        pool.attend(0, tables[:1, :1], torch.tensor([17]), q[:1], 0.125)


@needs_native
@pytest.mark.parametrize("window", [40, 300])
@pytest.mark.parametrize("sinks", [False, True])
def test_sliding_windows_and_sinks_attend_in_the_kernel(window, sinks):
    """A sliding-window layer (each position sees its last ``window`` keys) and gpt-oss's sinks
    (a logit per query head in each softmax) in the kernel: a position gets, to the bit, what
    it gets alone; the result is windowed attention with the sink's share (float rounding)."""
    from kvcellar.cache.kv_pool import KVLayout, KVPool
    from kvcellar.engine.attention import _attend_with_sinks

    dim, groups = 32, 3
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=dim, block_size=16, dtype=torch.float32)
    pool = KVPool(layout, 48, torch.device("cpu"), attend_direct=native.attend_kv)
    gen = torch.Generator().manual_seed(window)
    slots = torch.arange(48 * 16)
    pool.write(0, slots // 16, slots % 16, torch.randn(48 * 16, 2, dim, generator=gen) * 3,
               torch.randn(48 * 16, 2, dim, generator=gen))
    # a prefill chunk, a decode, a shorter chunk, and verified drafts of 12 and 5 rows (split by chunk)
    contexts, rows = torch.tensor([600, 37, 300, 520, 290]), torch.tensor([75, 1, 29, 12, 5])
    tables = torch.stack([torch.randperm(48, generator=gen)[:40] for _ in range(len(rows))])
    q = torch.randn(int(rows.sum()), 2, groups, dim, generator=gen) * 2
    sink = torch.randn(2 * groups, generator=gen) * 3 if sinks else None
    got = pool.attend(0, tables, contexts, q, 0.125, 2, rows, sink, window)
    assert torch.equal(pool.attend(0, tables, contexts, q, 0.125, 1, rows, sink, window), got)
    k, v = pool.gather(0, tables)
    none = torch.full((1, 2 * groups, 1, 1), float("-inf"))
    first = 0
    for s in range(len(rows)):
        n, context = int(rows[s]), int(contexts[s])
        for r in range(n):
            alone = pool.attend(0, tables[s : s + 1], torch.tensor([context - n + 1 + r]), q[first + r : first + r + 1],
                                0.125, sinks=sink, window=window)
            assert torch.equal(got[first + r], alone[0]), (s, r)
        q_pos = torch.arange(context - n, context)[:, None]
        k_pos = torch.arange(context)[None, :]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
        want = _attend_with_sinks(q[first : first + n].reshape(1, n, 2 * groups, dim).transpose(1, 2),
                                  k[s : s + 1, :, :context].repeat_interleave(groups, dim=1),
                                  v[s : s + 1, :, :context].repeat_interleave(groups, dim=1), visible, 0.125,
                                  none if sink is None else sink.view(1, -1, 1, 1), causal=False)
        torch.testing.assert_close(got[first : first + n], want[0].transpose(0, 1).reshape(n, 2, groups, dim),
                                   rtol=1e-5, atol=1e-5)
        first += n


@needs_native
@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 8),
                                             (torch.bfloat16, 4)])
def test_attention_gives_a_position_the_same_numbers_in_any_step(dtype, bits):
    """A prefill chunk's positions attended together (``rows``) get, to the bit, what each gets
    alone as a decode step over the same blocks: across the kernel's chunks of 256 tokens and
    its groups of rows, chunks starting inside a block and on top of earlier tokens, sequences of
    many rows, of a few (a verified draft: a task per chunk) and of one in one call, at any thread
    count. And
    the result is causal attention (SDPA over the gathered context, to float rounding)."""
    import dataclasses

    import torch.nn.functional as F

    from kvcellar.cache.kv_pool import KVLayout, KVPool

    dim, groups = 64, 3
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=dim, block_size=16, dtype=dtype, kv_bits=bits,
                      kv_group_size=32 if bits < 16 else 64)
    pool = KVPool(layout, 48, torch.device("cpu"), gather_quantized=native.gather_kv, attend_direct=native.attend_kv)
    gen = torch.Generator().manual_seed(bits)
    slots = torch.arange(48 * 16)
    pool.write(0, slots // 16, slots % 16, (torch.randn(48 * 16, 2, dim, generator=gen) * 3).to(dtype),
               torch.randn(48 * 16, 2, dim, generator=gen).to(dtype))
    # a prefill chunk, a decode, a shorter chunk, and verified drafts of 12 and 5 rows (split by chunk)
    contexts, rows = torch.tensor([600, 37, 300, 520, 290]), torch.tensor([75, 1, 29, 12, 5])
    tables = torch.stack([torch.randperm(48, generator=gen)[:40] for _ in range(len(rows))])
    q = (torch.randn(int(rows.sum()), 2, groups, dim, generator=gen) * 2).to(dtype)
    got = pool.attend(0, tables, contexts, q, 0.125, 2, rows)
    assert torch.equal(pool.attend(0, tables, contexts, q, 0.125, 1, rows), got)
    wide = pool
    if bits < 16:
        wide = KVPool(dataclasses.replace(layout, dtype=torch.float32), 48, torch.device("cpu"))
        wide.data.copy_(pool.data)
    k, v = wide.gather(0, tables)
    first = 0
    for s in range(len(rows)):
        for r in range(int(rows[s])):
            context = int(contexts[s]) - int(rows[s]) + 1 + r
            alone = pool.attend(0, tables[s : s + 1], torch.tensor([context]), q[first + r : first + r + 1], 0.125)
            assert torch.equal(got[first + r], alone[0]), (s, r)
        n = int(rows[s])
        want = F.scaled_dot_product_attention(
            q[first : first + n].float().reshape(1, n, 2 * groups, dim).transpose(1, 2),
            k[s : s + 1, :, : int(contexts[s])].float().repeat_interleave(groups, dim=1),
            v[s : s + 1, :, : int(contexts[s])].float().repeat_interleave(groups, dim=1),
            attn_mask=torch.ones(n, int(contexts[s]), dtype=torch.bool).tril(int(contexts[s]) - n), scale=0.125)
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-3, 8e-3)
        assert torch.allclose(got[first : first + n].float(), want[0].transpose(0, 1).reshape(n, 2, groups, dim),
                              atol=atol, rtol=rtol)
        first += n
    with pytest.raises(IndexError):  # more rows than the context has positions
        pool.attend(0, tables[:1], torch.tensor([3]), q[:5], 0.125, 2, torch.tensor([5]))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group"), [(8, 64), (8, 16), (8, 128), (4, 64), (4, 32), (4, 128)])
def test_the_pools_quantized_write_is_quantize_kv_bit_for_bit(dtype, bits, group):
    """The C write of quantized KV rows against the pool's own (``quantize_kv``, then indexed
    stores): the same bytes, over magnitudes from 1e-6 to 1e5, zeros, values past float16's
    range, in any slot order."""
    from kvcellar.cache.kv_pool import KVLayout, KVPool

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=128, block_size=8, dtype=dtype, kv_bits=bits,
                      kv_group_size=group)
    pools = [KVPool(layout, 20, torch.device("cpu")),
             KVPool(layout, 20, torch.device("cpu"), write_quantized=native.write_kv)]
    gen = torch.Generator().manual_seed(bits + group)
    slots = torch.randperm(160, generator=gen)[:100]
    x = torch.randn(100, 2, 128, generator=gen) * torch.logspace(-6, 5, 100)[:, None, None]
    x[3] = 0.0
    x[5, 1] = 7e4
    x[6, 0, 5] = -9e4
    for layer in range(3):
        for pool in pools:
            pool.write(layer, slots // 8, slots % 8, x.to(dtype), (x * -2).to(dtype))
    assert torch.equal(pools[0].data, pools[1].data)
    with pytest.raises(IndexError):
        native.write_kv(pools[1].data, layout, 0, 0, torch.tensor([20]), torch.tensor([0]), x[:1].to(dtype))


@pytest.mark.skipif(not native.folds_crc32(), reason="no carry-less multiplication (or no kernels) here")
def test_crc32_is_zlibs_at_every_length_and_start():
    """Lengths around the 64-byte folds and 16-byte steps, and the byte-wise tail; from any
    running value; from bytes, bytearrays and a tensor's bytes (block payloads)."""
    rng = random.Random(7)
    for n in [*range(0, 200), 4096, 4096 + 15, 4096 + 48, 65536 + 7, 190080]:
        data = rng.randbytes(n)
        lib = native.library()
        assert lib is not None
        for start in (0, 0xFFFFFFFF, rng.getrandbits(32)):
            want = zlib.crc32(data, start)
            assert lib.kvc_crc32(data, n, start) == want
            assert native.crc32(data, start) == native.crc32(bytearray(data), start) == want
    t = torch.randint(0, 256, (30, 2, 3168), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    view = memoryview(t.numpy().data)
    assert native.crc32(view) == zlib.crc32(view)


@pytest.mark.skipif(not native.folds_crc32(), reason="no carry-less multiplication (or no kernels) here")
def test_an_engine_given_a_tier_checksums_its_blocks_on_the_kernel(model, tmp_path, monkeypatch):
    """Storage does not import the engine: block checksums are zlib's until an engine that
    takes a tier installs the kernel (the same values)."""
    monkeypatch.setattr(block_format, "_crc32", block_format._zlib_crc32)
    engine = make_engine(model)
    try:
        engine.attach_tier(DiskTier(tmp_path, engine.fingerprint, engine.block_spec, DiskConfig(min_free_bytes=0),
                                    descriptor=engine.descriptor))
        assert block_format._crc32 is native.crc32
    finally:
        engine.shutdown(timeout=10)


@needs_native
def test_a_call_the_kernels_cannot_take_is_refused_before_any_runs() -> None:
    """By Python itself (a function's arguments are its prototype's in kvc.h) or by an
    explicit check, which ``python -O`` keeps: never memory read past a tensor."""
    from kvcellar.cache.kv_pool import KVLayout
    from kvcellar.engine.native import lib

    params = [name for name, _ in lib.signatures()["kvc_gemm_q8"].params]
    assert params == ["w", "scales", "out", "cols", "xq", "xd", "rows", "y", "threads"]
    with pytest.raises(TypeError, match="len"):
        lib.call("kvc_crc32", buf=0, crc=0)
    weight = quantize_int8(torch.randn(64, 64))
    with pytest.raises(ValueError, match="activations"):
        native.matmul_int8(torch.randn(2, 32), weight.qweight, weight.scales, 1)  # too few inputs
    with pytest.raises(ValueError, match="scales"):
        native.matmul_int8(torch.randn(2, 64), weight.qweight, weight.scales[:32], 1)  # scales of half the rows
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32)
    pool = torch.zeros(3, *layout.storage_shape)
    q = torch.randn(1, 2, 2, 32)
    with pytest.raises(IndexError):
        native.attend_kv(pool, layout, 2, torch.tensor([[0]]), torch.tensor([1]), q, 1.0)  # no layer 2
    with pytest.raises(IndexError):
        native.attend_kv(pool, layout, 0, torch.tensor([[5]]), torch.tensor([1]), q, 1.0)  # no block 5


# Run in a fresh interpreter on a cache dir of its own: the library is loaded once per process.
# ``_compile`` is replaced by a copy of this session's build (a real compile takes a minute on
# 2 cores); what is checked is when the loader builds again and what it loads.
_LOADER_CHILD = """
import hashlib, json, shutil, sys
from pathlib import Path
from kvcellar.engine.native import lib
good = Path(sys.argv[1])
built = []
def compile_(cc, folder, target):
    built.append(target.name)
    shutil.copyfile(good, target)
    lib._record_of(target).write_text(hashlib.sha256(good.read_bytes()).hexdigest())
lib._compile = compile_
loaded = lib.library()
print(json.dumps({"loaded": loaded is not None, "built": built,
                  "same": loaded is not None and Path(loaded._name).read_bytes() == good.read_bytes()}))
"""


@pytest.mark.skipif(not native.available(), reason="kvcellar's CPU kernels")
def test_a_library_that_is_not_the_one_recorded_is_built_again_and_a_shared_folder_refused(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from kvcellar.engine.native import lib
    from tests.storage.helpers import child_env

    good = Path(lib.library()._name)

    def load() -> dict:
        env = {**child_env(), "KVCELLAR_CACHE_DIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", _LOADER_CHILD, str(good)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert load() == {"loaded": True, "built": [good.name], "same": True}  # nothing there: built
    assert load() == {"loaded": True, "built": [], "same": True}  # recorded: loaded as it is
    target = tmp_path / "native" / good.name
    target.write_bytes(target.read_bytes() + b"planted")  # another library under its name
    assert load() == {"loaded": True, "built": [good.name], "same": True}
    (tmp_path / "native").chmod(0o777)
    assert load() == {"loaded": False, "built": [], "same": False}  # anyone could plant one: refused


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_first", [False, True])
def test_rms_norm_on_the_kernels_is_torchs_within_rounding_and_each_rows_own(dtype, weight_first):
    """The hidden states' RMSNorm on the kernels: within one rounding of transformers' own
    operations (its own order of sums), and every row the same bits alone as in a step of 37
    rows or of 300 (the rows then split between threads); other inputs get torch's."""
    from kvcellar.engine.native.norm import rms_norm_for

    cols, eps = 3584, 1e-6
    weight = (torch.rand(cols, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)

    def torchs(x: torch.Tensor) -> torch.Tensor:
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (weight.float() * h).to(x.dtype) if weight_first else weight * h.to(x.dtype)

    norm = rms_norm_for(weight, eps, weight_first, torchs)
    assert norm is not None
    x = (activations(300, cols) * 3).to(dtype)
    want = torchs(x)
    got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    assert float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max()) <= 2 * ulp
    assert torch.equal(norm(x * 2), got) and not torch.equal(norm(x + 1), got)  # scale-free, as RMSNorm is
    for rows in (1, 37):
        assert torch.equal(norm(x[:rows]), got[:rows])
    assert all(torch.equal(norm(x[r:r + 1]), got[r:r + 1]) for r in (0, 5, 299))
    assert torch.equal(norm(x.view(3, 100, cols)).view(300, cols), got)
    if not weight_first:  # an input the kernel does not take: torch's operations
        assert torch.equal(norm(x[:4].half()), torchs(x[:4].half()))
    assert rms_norm_for(weight[:12], eps, weight_first, torchs) is None  # not in 8s


@needs_native
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_linear_on_the_kernels_takes_a_step_of_no_rows(kind):
    """A linear's one foreign call (``kvc_linear``) with no activation rows: empty outputs, no
    allocation to fail."""
    q = (quantize_int4 if kind == "int4" else quantize_int8)(torch.randn(64, 256) * 0.05)
    layer = FastLinear(q.dequantize(torch.float32), None, q, KernelTable(kernel_dtype=torch.int8))
    assert layer._group is not None  # the linear runs through kvc_linear
    assert layer(torch.empty(0, 256)).shape == (0, 64)
    x = torch.randn(3, 256)
    assert torch.equal(layer(x)[1:2], layer(x[1:2]))


@needs_native
@pytest.mark.parametrize("cols", [1, 7, 8, 33, 1000, 49152])
def test_the_logits_argmax_is_torchs_first_greatest_and_a_nan_wins(cols):
    """A greedy step's token: the first of equal greatest values, a NaN before any number, -0.0
    equal to 0.0, a row of -inf its first, as torch.argmax picks them."""
    gen = torch.Generator().manual_seed(cols)
    for trial in range(12):
        x = torch.randn(7, cols, generator=gen) * 4
        if trial % 2:
            x = x.round()  # ties everywhere
        x[0, cols // 3] = x[0, (2 * cols) // 3] = x[0].max() + 1  # a tie for the greatest
        x[1, cols - 1] = float("nan")
        x[2, cols // 2] = x[2, cols - 1] = float("nan")
        x[3] = -float("inf")
        x[4] = 0.0
        x[4, cols // 2:] = -0.0
        x[5, cols - 1] = float("inf")
        assert native.argmax_rows(x) == x.argmax(dim=-1).tolist(), trial
    assert native.argmax_rows(x[1:3]) == x[1:3].argmax(dim=-1).tolist()  # rows that are a view's


@needs_native
def test_logits_rounded_to_bf16_are_the_bf16_values():
    x = torch.randn(5, 1003, generator=torch.Generator().manual_seed(3)) * 1e3
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), 3.4e38, -0.0, 1e-40, float("nan")])
    want = x.bfloat16().float()
    got = native.round_bf16_(x.clone())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))


@needs_native
@pytest.mark.parametrize(("n", "k"), [(49152, 64), (49152, 256), (300, 300), (1000, 1), (7, 3)])
def test_the_top_k_of_a_row_is_torchs_with_equal_values_in_index_order(n, k):
    """Top-k and top-p sampling's selection: the k greatest, greatest first, of equal values the
    lower index first; a row with a NaN is torch's."""
    gen = torch.Generator().manual_seed(n + k)
    for trial in range(6):
        x = torch.randn(n, generator=gen) * 3
        if trial % 2:
            x = x.round()  # many equal values, at the k-th among them
        values, ids = native.topk_row(x, k)
        assert torch.equal(values, torch.topk(x, k).values), trial
        assert ids.tolist() == sorted(range(n), key=lambda j: (-x[j].item(), j))[:k], trial
    x[n // 2] = float("nan")
    values, ids = native.topk_row(x, k)
    want = torch.topk(x, k)
    assert torch.equal(values.nan_to_num(1e30), want.values.nan_to_num(1e30)) and ids[0].item() == n // 2
