"""Weight-only quantized linears (``--weights int8|int4``) on the embedded model.

The reference is computed without the engine: plain transformers ``generate`` (SDPA, its
own cache, ``nn.Linear`` modules) on a freshly loaded copy of the model whose linears hold
the dequantized weights of the same quantized tensors. The engine runs torch's int8/int4
kernels for decode steps (bf16 on a CPU with native bf16) and the dequantized weights,
prepacked, for prefill chunks."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from kvcellar.artifacts.store import ArtifactCache
from kvcellar.engine import SamplingParams, native
from kvcellar.engine.linears import (
    FastLinear,
    KernelTable,
    int4_pack_block,
    prepare_model,
    quant_kernels_run,
    row_layout,
)
from kvcellar.quantization import INT4_GROUP, QuantizedWeight, quantize_int4, quantize_int8
from kvcellar.runtime import prepare_and_load
from tests._models import (
    assert_equivalent_output,
    assert_identical_output,
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    reference_greedy,
    shared_models_dir,
    uncached_runner,
    without_native_kernels,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)
SYSTEM = "You are a careful assistant for a library. Answer in one sentence and name the shelf. " * 4
KERNELS = quant_kernels_run(torch.bfloat16, torch.device("cpu"))
needs_kernels = pytest.mark.skipif(not KERNELS, reason="this CPU has no native bf16: the quantized kernels never run")
# bf16: the logits come out of the LM head in bf16, where one ulp of a logit of 16-32 is
# 0.125: a prompt prefilled in other chunks moved a logprob by 0.166 here (full weights too).
BF16_LOGPROB_TOL = 0.3


def load(mode: str, dtype: str = "bfloat16"):
    return prepare_and_load(None, dtype=dtype, device="cpu", artifacts=ArtifactCache(shared_models_dir()),
                            weights=mode)


@functools.cache
def quantized(mode: str, dtype: str = "bfloat16"):
    """One load per mode and dtype, shared by the tests that build engines on it (an engine
    takes over its quantized weights: ``loaded.quantized`` is empty after; ``load`` gives a
    fresh one)."""
    return load(mode, dtype)


def dequantized_reference(mode: str, dtype: str = "bfloat16") -> nn.Module:
    """A fresh, unprepared load of the model with each quantized linear's dequantized
    weight in a plain ``nn.Linear``: what the kernels must compute."""
    fresh = prepare_and_load(None, dtype=dtype, device="cpu", weights="full",
                             artifacts=ArtifactCache(shared_models_dir()))
    model = fresh.model
    for name, q in load(mode, dtype).quantized.items():
        linear = model.get_submodule(name)
        assert type(linear) is nn.Linear
        linear.weight = nn.Parameter(row_layout(q).dequantize(linear.weight.dtype), requires_grad=False)
    return model


def test_int8_rounds_to_the_nearest_step():
    w = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and int(q.qweight.abs().max()) <= 127
    err = (q.dequantize(torch.float32) - w).abs()
    assert bool((err <= q.scales[:, None] / 2 + 1e-6).all())


def test_int4_rounds_to_the_nearest_step_and_gives_q4_1_blocks_back():
    torch.manual_seed(0)
    w = torch.randn(24, 4 * INT4_GROUP) * torch.linspace(0.01, 2.0, 24)[:, None]
    q = quantize_int4(w)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (24, 2 * INT4_GROUP)
    values = q.int4_values()
    assert int(values.min()) == 0 and int(values.max()) == 15
    err = (q.dequantize(torch.float32) - w).abs().view(24, 4, INT4_GROUP)
    assert bool((err <= q.scales[:, :, None] / 2 + 1e-5).all())
    # A tensor that is on a Q4_1 grid already (GGUF's blocks, dequantized) quantizes to itself.
    grid = q.dequantize(torch.float32)
    again = quantize_int4(grid)
    assert torch.equal(again.int4_values(), values)
    assert torch.allclose(again.dequantize(torch.float32), grid, atol=1e-6)


def test_quantized_weights_round_trip_through_named_tensors_and_fuse():
    a, b = quantize_int4(torch.randn(16, 64)), quantize_int4(torch.randn(8, 64))
    back = QuantizedWeight.from_tensors("x", a.to_tensors("x"))
    assert (back.kind, back.group_size) == ("int4", INT4_GROUP)
    assert torch.equal(back.dequantize(torch.float32), a.dequantize(torch.float32))
    both = QuantizedWeight.concat([a, b])
    assert torch.equal(both.dequantize(torch.float32),
                       torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)]))
    i8 = quantize_int8(torch.randn(8, 64))
    assert QuantizedWeight.from_tensors("y", i8.to_tensors("y")).kind == "int8"
    with pytest.raises(ValueError, match="fuse"):
        QuantizedWeight.concat([a, i8])


@needs_kernels
@pytest.mark.parametrize(("kind", "out"), [("int8", 96), ("int4", 128), ("int4", 96)])
def test_kernels_compute_the_dequantized_weights(kind, out):
    """torch's kernels against ``x @ dequantized.T`` in float32 at the row counts of decode
    steps and prefill chunks, and each row's outputs the same bits at every row count: a
    quantized linear runs its kernel for every step, so its numbers must not depend on it."""
    torch.manual_seed(0)
    weight = torch.randn(out, 128) * 0.05
    bias = torch.randn(out) * 0.1
    q = quantize_int8(weight) if kind == "int8" else quantize_int4(weight)
    deq = q.dequantize(torch.bfloat16)
    layer = FastLinear(deq, bias.to(torch.bfloat16), q, KernelTable())
    assert layer.quant_kind == kind and layer.lean and layer._dense is None  # no dense copy
    block = int4_pack_block()  # rows per block of torch's packing: 64 on AVX-512, 32 on AVX2
    if kind == "int8" or (block and out % block == 0):
        assert torch.equal(layer.dequantized(), deq)  # exactly the numbers of the reference
    x = torch.randn(300, 128).to(torch.bfloat16)
    whole = layer(x.view(1, 300, 128)).view(300, -1)
    for rows in (1, 2, 3, 5, 8, 16, 40, 300):
        want = torch.nn.functional.linear(x[:rows].float(), deq.float(), bias.to(torch.bfloat16).float())
        tol = 0.02 * float(want.abs().max())  # bf16 output: 2^-8 relative, plus accumulation order
        got = layer(x[:rows].view(1, rows, 128)).view(rows, -1)
        assert got.dtype == torch.bfloat16 and float((got.float() - want).abs().max()) <= tol
        assert torch.equal(got, whole[:rows]), rows


def test_every_linear_is_quantized_and_the_identity_says_so():
    full = embedded("bfloat16")
    for mode in ("int8", "int4"):
        loaded = load(mode)
        linears = [n for n, m in loaded.model.named_modules() if isinstance(m, nn.Linear)]
        assert sorted(loaded.quantized) == sorted(linears)
        assert len(linears) == 1 + 7 * loaded.config.num_hidden_layers  # LM head + 7 per layer
        kinds = {n: q.kind for n, q in loaded.quantized.items()}
        assert kinds.pop("lm_head") == "int8"  # the logits' matrix keeps 8 bits in both modes
        assert set(kinds.values()) == {mode}
        kernels = "|kernels=int8" if loaded.kernel_dtype == torch.int8 else ""  # kvcellar's kernels
        assert loaded.weights_id == full.weights_id + f"|weights={mode}{kernels}"  # another KV namespace
    fingerprints = {make_engine(x).fingerprint for x in (full, quantized("int8"), quantized("int4"))}
    assert len(fingerprints) == 3
    assert quantized("int4").quantized == {}  # the engine took them over: no second copy kept


@needs_kernels
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_engine_matches_the_dequantized_reference(mode):
    """Greedy tokens of the engine (quantized kernels for decode) equal those of plain
    transformers over the dequantized weights, with logprobs within bf16 tolerance, up to a
    token where the reference has a near-tie (within that tolerance: one bf16 ulp of a logit
    decides it, and CPUs without native bf16 round otherwise); the engine's pick there is one
    of the tied tokens."""
    loaded = quantized(mode)
    engine = make_engine(loaded)
    reference = dequantized_reference(mode)
    prompts = [chat_ids(loaded, "Where are the atlases?", SYSTEM), chat_ids(loaded, "Do you lend e-readers?")]
    for prompt in prompts:
        got = engine.generate([prompt], GREEDY)[0]
        tokens, logprobs = reference_greedy(reference, prompt, GREEDY.max_tokens)
        n = len(got.token_ids)
        first = next((i for i in range(n) if got.token_ids[i] != tokens[i]), n)
        ref = logprobs[torch.arange(n), torch.tensor(got.token_ids)]
        assert torch.allclose(torch.tensor(got.logprobs[: first + 1]), ref[: first + 1], atol=BF16_LOGPROB_TOL)
        if first < n:
            assert float(ref[first]) >= float(logprobs[first].max()) - BF16_LOGPROB_TOL, f"token {first}: no near-tie"
        assert first >= 2, "the first tokens agree"
    assert_no_leaks(engine)


@pytest.mark.parametrize(("mode", "dtype", "native_kernels"),
                         [("int4", "bfloat16", True), ("int8", "bfloat16", True), ("int8", "float32", True),
                          ("int4", "float32", True), ("int8", "float32", False)])
def test_prefix_cache_paths_agree_with_quantized_weights(mode, dtype, native_kernels, monkeypatch):
    """Full, partial and batched prefix hits give what a cache-disabled engine gives: to the
    bit where kvcellar's kernels attend (every position by the same arithmetic, and every
    quantized linear one kernel at every row count); with torch's attention (SDPA, whose
    sums depend on the step's shape) exactly in float32 with no kernel, and up to rounding
    (``assert_equivalent_output``) in bf16."""
    if not native_kernels:
        without_native_kernels(monkeypatch)
    loaded = load(mode, dtype)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5)
    uncached = uncached_runner(loaded, params)
    direct = native_kernels and native.available()

    def check(got, prompt):
        if direct:
            assert_identical_output(got, uncached(prompt))
        elif dtype == "float32" and loaded.kernel_dtype is None:
            assert_same_output(got, uncached(prompt))
        else:
            assert_equivalent_output(got, uncached(prompt), BF16_LOGPROB_TOL)

    engine = make_engine(loaded, max_step_tokens=64)  # chunked prefill too
    first = chat_ids(loaded, "Where are the atlases?", SYSTEM)
    check(engine.generate([first], params)[0], first)
    again = engine.generate([first], params)[0]  # full hit: only the last token computed
    assert again.num_cached_tokens == expected_cached(len(first), len(first))
    check(again, first)
    others = [chat_ids(loaded, q, SYSTEM) for q in ("Is there a quiet room?", "How long can I keep a DVD?")]
    for got, prompt in zip(engine.generate(others, params), others, strict=True):  # partial hits, batched
        assert got.num_cached_tokens > 0
        check(got, prompt)
    assert_no_leaks(engine)


def test_a_model_is_prepared_once_and_shared_by_its_engines():
    loaded = quantized("int4")
    a, b = make_engine(loaded), make_engine(loaded, lean_forward=False)
    assert a.runner.linears is b.runner.linears is prepare_model(loaded.model)
    fused = a.runner.linears.fused
    if a.runner.linears.table.kernel_dtype == torch.int8:
        # kvcellar's kernels read each linear where the entry maps it: fusing would copy them
        assert not fused and all(m.lean and m._q is not None for m in a.runner.linears.quantized)
    else:
        assert len(fused) == 2 * loaded.config.num_hidden_layers  # QKV and gate-up of every layer


def test_with_torchs_kernels_qkv_and_gate_up_are_fused(monkeypatch):
    without_native_kernels(monkeypatch)
    loaded = load("int4")
    engine = make_engine(loaded)
    assert engine.runner.linears.table.kernel_dtype != torch.int8
    assert len(engine.runner.linears.fused) == 2 * loaded.config.num_hidden_layers


def test_int4_of_the_embedded_gguf_is_its_own_q4_1_blocks():
    """The embedded SmolLM2 ships as Q4_1 (groups of 32, a scale and a minimum each): its
    int4 weights are those blocks, value for value, not a second rounding of them."""
    import gguf
    import numpy as np

    from kvcellar.model_source import find_embedded_gguf

    reader = gguf.GGUFReader(str(find_embedded_gguf()))
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert raw.tensor_type == gguf.GGMLQuantizationType.Q4_1
    ours = row_layout(load("int4").quantized["model.layers.0.mlp.down_proj"])  # stored as panels
    out, cols = ours.shape
    blocks = np.asarray(raw.data).reshape(out, cols // 32, 20)  # per block: fp16 d, fp16 m, 16 bytes
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    values = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(out, cols)  # element j, then j + 16
    assert torch.equal(ours.int4_values(), torch.from_numpy(values.astype(np.int32)))
    assert torch.equal(ours.scales.float(), torch.from_numpy(d))  # its own float16 numbers
    assert torch.equal(ours.offsets.float(), torch.from_numpy(m))


def test_auto_serves_a_4bit_gguf_in_int4_where_the_kernel_runs(tmp_path):
    from kvcellar.engine.loader import gguf_weights_mode, quantized_mode_pays, resolve_weights
    from kvcellar.gguf_info import read_gguf_info
    from kvcellar.model_source import resolve_source
    from tests.artifacts.helpers import write_tiny_gguf

    embedded_source = resolve_source(None)  # Q4_1 linears
    tiny = resolve_source(str(write_tiny_gguf(tmp_path / "tiny.gguf")))  # Q8_0 linears
    assert gguf_weights_mode(read_gguf_info(embedded_source.path)) == "int4"
    assert gguf_weights_mode(read_gguf_info(tiny.path)) == "int8"
    cpu = torch.device("cpu")
    # Where the kernel runs, ``auto`` takes it if a probe measures it faster (cached per process,
    # so this reads the measurement resolve_weights acts on).
    int4_pays = quantized_mode_pays("int4", torch.bfloat16, cpu)
    assert int4_pays <= KERNELS
    assert resolve_weights("auto", embedded_source, torch.bfloat16, cpu) == ("int4" if int4_pays else "full")
    assert resolve_weights("auto", embedded_source, torch.float32, cpu) == "full"  # no fast fp32 kernel
    int8_pays = quantized_mode_pays("int8", torch.bfloat16, cpu)
    assert resolve_weights("auto", tiny, torch.bfloat16, cpu) == ("int8" if int8_pays else "full")
    assert resolve_weights("int8", tiny, torch.float32, cpu) == "int8"  # asked for: served as asked
    with pytest.raises(ValueError, match="weights mode"):
        resolve_weights("int3", tiny, torch.float32, cpu)
    assert embedded("float32").weights == "full" and quantized("int4").weights == "int4"


def test_auto_dtype_without_native_bf16_keeps_float32_and_runs_the_kernels_on_bf16():
    """``--dtype auto``: bf16 where the CPU computes it natively; elsewhere float32, whose
    quantized linears run torch's kernels on bf16 activations (the only ones they take fast)
    where that is measured faster than float32 dense weights, so a 4-bit GGUF is served
    quantized there too. An explicit dtype is served as asked. The kernel precision is part
    of the weights identity (other KV)."""
    from kvcellar.engine.linears import native_bf16_cpu
    from kvcellar.engine.loader import native_kernels_pay, quantized_mode_pays, resolve_serving
    from kvcellar.model_source import resolve_source

    cpu = torch.device("cpu")
    source = resolve_source(None)  # Q4_1 linears
    auto = resolve_serving("auto", "auto", source, cpu)
    if native_bf16_cpu():
        assert auto.dtype == torch.bfloat16 and auto.kernel_dtype in (None, torch.int8)
    elif native_kernels_pay("int4", torch.float32, torch.bfloat16, cpu):  # kvcellar's kernels: below
        assert (auto.dtype, auto.weights, auto.kernel_dtype) == (torch.float32, "int4", torch.int8)
    elif quantized_mode_pays("int4", torch.bfloat16, cpu, dense_dtype=torch.float32):
        assert (auto.dtype, auto.weights, auto.kernel_dtype) == (torch.float32, "int4", torch.bfloat16)
        assert auto.weights_suffix == "|weights=int4|kernels=bfloat16"
        asked = resolve_serving("auto", "int8", source, cpu)
        # int8's own probes (cached: the ones resolve_serving acted on) pick its kernels, as
        # int4's did; a busy CPU can make them pick otherwise than int4's
        if native_kernels_pay("int8", torch.float32, torch.bfloat16, cpu):
            kernel: torch.dtype | None = torch.int8
        elif quantized_mode_pays("int8", torch.bfloat16, cpu, dense_dtype=torch.float32):
            kernel = torch.bfloat16
        else:
            kernel = None
        assert (asked.dtype, asked.weights, asked.kernel_dtype) == (torch.float32, "int8", kernel)
    explicit = resolve_serving("float32", "auto", source, cpu)
    if native_kernels_pay("int4", torch.float32, None, cpu):
        assert (explicit.dtype, explicit.weights, explicit.kernel_dtype) == (torch.float32, "int4", torch.int8)
        assert resolve_serving("float32", "int4", source, cpu).weights_suffix == "|weights=int4|kernels=int8"
    else:
        assert (explicit.dtype, explicit.weights, explicit.kernel_dtype) == (torch.float32, "full", None)
        assert resolve_serving("float32", "int4", source, cpu).weights_suffix == "|weights=int4"
    if not native_kernels_pay("int4", torch.bfloat16, torch.bfloat16, cpu):
        assert resolve_serving("bfloat16", "int4", source, cpu).weights_suffix == "|weights=int4"


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_float32_model_with_bf16_kernels_is_lean_and_every_prefix_path_agrees(mode):
    """The float32 model of a CPU without native bf16 (``resolve_serving``), built here on any
    CPU: its quantized linears keep no dense copy and run the kernels on bf16 activations for
    every step; cached runs give what a cache-disabled engine gives (to the bit where
    kvcellar's kernels attend), and greedy tokens agree with plain float32 transformers over
    the dequantized weights up to a near-tie."""
    loaded = load(mode, "float32")
    loaded.kernel_dtype = torch.bfloat16
    engine = make_engine(loaded, max_step_tokens=64)  # chunked prefill too
    prepared = engine.runner.linears
    assert prepared.table.kernel_dtype == torch.bfloat16
    assert all(m.quant_kind == ("int8" if m is prepared.linears[-1] else mode) for m in prepared.linears)
    lean = [m for m in prepared.linears if m.lean]
    assert lean and all(m._dense is None and m.kernel_dtype == torch.bfloat16 for m in lean)
    x = torch.randn(3, lean[0].in_features)
    assert lean[0].quantized_kernel(x).dtype == torch.float32 and lean[0](x).dtype == torch.float32

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5)
    uncached = uncached_runner(loaded, params)
    first = chat_ids(loaded, "Where are the atlases?", SYSTEM)

    def check(result, prompt):
        if engine.runner.pool.attends:
            assert_identical_output(result, uncached(prompt))
        else:
            assert_equivalent_output(result, uncached(prompt), BF16_LOGPROB_TOL)
    got = engine.generate([first], params)[0]
    check(got, first)
    tokens, _ = reference_greedy(dequantized_reference(mode, "float32"), first, params.max_tokens)
    agree = next((i for i in range(len(got.token_ids)) if got.token_ids[i] != tokens[i]), len(got.token_ids))
    assert agree >= 3
    again = engine.generate([first], params)[0]  # full hit: only the last token computed, by the kernel
    assert again.num_cached_tokens == expected_cached(len(first), len(first))
    check(again, first)
    others = [chat_ids(loaded, q, SYSTEM) for q in ("Is there a quiet room?", "How long can I keep a DVD?")]
    for result, prompt in zip(engine.generate(others, params), others, strict=True):  # partial hits, batched
        assert result.num_cached_tokens > 0
        check(result, prompt)
    assert_no_leaks(engine)


def test_an_unknown_weights_mode_in_the_settings_is_a_clear_error(tmp_path):
    from kvcellar.settings import load_settings

    bad = tmp_path / "kvcellar.toml"
    bad.write_text('[engine]\nweights = "int3"\n')
    with pytest.raises(ValueError, match="weights must be one of auto, full, int8, int4"):
        load_settings(str(bad))


@needs_kernels
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_linears_keep_no_dense_copy(mode):
    """Serving int4/int8 holds the quantized weights only: every linear of the embedded model
    is lean and holds what its kind needs (int4: half a byte a weight and a bf16 scale and
    zero per 32 (kvcellar's kernels: a float16 scale and offset); int8: a byte a weight and a
    scale per row, bf16 (float32)), no dense weight beside it."""
    engine = make_engine(load(mode))
    linears = engine.runner.linears.linears
    assert linears and all(m.lean and m._dense is None for m in linears)
    per_weight = {"int4": 0.5 + 4 / 32, "int8": 1.0}
    for m in linears:
        bias = 0 if m.bias is None else m.bias.numel() * m.bias.element_size()
        scales = (4 if m.native else 2) * m.out_features if m.quant_kind == "int8" else 0
        assert m.nbytes == int(per_weight[m.quant_kind] * m.out_features * m.in_features) + scales + bias


@needs_kernels
def test_an_int8_weight_read_at_an_unaligned_address_is_copied_for_the_kernel():
    """safetensors places tensors 8-byte aligned; torch's int8 kernel crashed (SIGSEGV) on a
    7B model's LM head read that way."""
    torch.manual_seed(0)
    q = quantize_int8(torch.randn(128, 256) * 0.05)
    raw = torch.empty(q.qweight.numel() + 64, dtype=torch.int8)
    offset = next(i for i in range(1, 64) if (raw.data_ptr() + i) % 64 == 24)
    unaligned = raw[offset: offset + q.qweight.numel()].view(128, 256)
    unaligned.copy_(q.qweight)
    assert unaligned.data_ptr() % 64 != 0
    layer = FastLinear(q.dequantize(torch.bfloat16), None, QuantizedWeight("int8", unaligned, q.scales),
                       KernelTable())
    assert layer._q is not None and layer._q.data_ptr() % 64 == 0
    x = torch.randn(3, 256).to(torch.bfloat16)
    want = x.float() @ q.dequantize(torch.float32).T
    assert torch.allclose(layer.quantized_kernel(x).float(), want, atol=0.05)
