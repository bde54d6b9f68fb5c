"""Weight-only int8 linears (``--weights int8``) on the embedded model, fp32 activations.

The reference is computed without the engine: plain transformers ``generate`` (SDPA, its
own cache) on a copy of the model whose linears hold the dequantized int8 weights
(``q * scale``) as ordinary ``nn.Linear`` weights."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from kvcellar.artifacts.store import ArtifactCache
from kvcellar.engine import SamplingParams
from kvcellar.engine.quantization import WeightOnlyInt8Linear, quantize_int8
from kvcellar.runtime import prepare_and_load
from tests._models import (
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    reference_greedy,
    shared_models_dir,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True)
SYSTEM = "You are a careful assistant for a library. Answer in one sentence and name the shelf. " * 4


@functools.cache
def int8_model():
    return prepare_and_load(None, dtype="float32", device="cpu", artifacts=ArtifactCache(shared_models_dir()),
                            weights="int8")


@pytest.fixture(scope="module")
def model():
    return int8_model()


def dequantized_copy(model) -> nn.Module:
    """The same weights as plain linears: what the int8 kernels must compute."""
    ref = copy.deepcopy(model)
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, WeightOnlyInt8Linear):
            linear = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            linear.weight = nn.Parameter(mod.dequantized(), requires_grad=False)
            if mod.bias is not None:
                linear.bias = nn.Parameter(mod.bias.clone(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, linear)
    return ref


def test_quantize_int8_rounds_to_the_nearest_step():
    w = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())


def test_every_linear_is_int8_and_the_identity_says_so(model):
    full = embedded("float32")
    linears = [m for m in model.model.modules() if isinstance(m, nn.Linear)]
    quant = [m for m in model.model.modules() if isinstance(m, WeightOnlyInt8Linear)]
    assert not linears and len(quant) == 1 + 7 * model.config.num_hidden_layers  # LM head + 7 per layer
    assert model.weights_id == full.weights_id + "|weights=int8"  # another KV namespace
    assert make_engine(model).fingerprint != make_engine(full).fingerprint


def test_engine_matches_the_dequantized_reference(model):
    ref_model = dequantized_copy(model.model)
    engine = make_engine(model)
    prompts = [chat_ids(model, "Where are the atlases?", SYSTEM), chat_ids(model, "Do you lend e-readers?")]
    for prompt in prompts:
        got = engine.generate([prompt], GREEDY)[0]
        tokens, logprobs = reference_greedy(ref_model, prompt, GREEDY.max_tokens)
        assert got.token_ids == tokens[: len(got.token_ids)]
        ref = logprobs[torch.arange(len(got.token_ids)), torch.tensor(got.token_ids)]
        assert torch.allclose(torch.tensor(got.logprobs), ref, atol=2e-3)
    assert_no_leaks(engine)


def test_int8_kernel_matches_the_dequantized_weights():
    """Where the int8 kernel runs (bf16 on AVX-512 BF16) and where it doesn't, a layer computes
    ``x @ (q * scale).T``; run here with the kernel forced on, whatever this CPU prefers."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    layer = WeightOnlyInt8Linear.from_linear(linear)
    x = torch.randn(3, 5, 96)
    want = torch.nn.functional.linear(x, layer.dequantized(), layer.bias)
    for max_rows in (0, 64):  # dequantizing path, then the int8 kernel
        layer.kernel_max_rows = max_rows
        assert torch.allclose(layer(x), want, atol=1e-4)


def test_prefix_cache_paths_are_exact_with_int8(model, uncached):
    """Full, partial and batched prefix hits give what a cache-disabled int8 engine gives."""
    engine = make_engine(model, max_step_tokens=64)  # chunked prefill too
    first = chat_ids(model, "Where are the atlases?", SYSTEM)
    assert_same_output(engine.generate([first], GREEDY)[0], uncached(first))
    again = engine.generate([first], GREEDY)[0]  # full hit: only the last token computed
    assert again.num_cached_tokens == expected_cached(len(first), len(first))
    assert_same_output(again, uncached(first))
    others = [chat_ids(model, q, SYSTEM) for q in ("Is there a quiet room?", "How long can I keep a DVD?")]
    for got, prompt in zip(engine.generate(others, GREEDY), others, strict=True):  # partial hits, batched
        assert got.num_cached_tokens > 0
        assert_same_output(got, uncached(prompt))
    assert_no_leaks(engine)
