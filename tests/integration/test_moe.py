"""Mixture-of-experts models (qwen3_moe / GGUF qwen3moe: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B).

kvcellar runs a MoE block as its own ``engine/experts.py``: each expert's projections as
linears (quantized, on kvcellar's kernels, mapped from the artifact cache), a step's rows
grouped by expert, the router's logits in float64. Checked here: the block against
transformers' own modules; the router's choice and an expert's rows independent of the step;
tiny models from HF folders and from GGUFs (Q4_K/Q6_K experts) against transformers; and,
under ``--weights auto|int4|int8`` with the kernels on, every cache path giving the uncached
engine's bits: chunked prefill, RAM full and partial hits, a batch, the same prompt twice,
preemption, 8-bit KV and an SSD hit after a restart (Redis: tests/remote)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kvcellar.artifacts import prepare
from kvcellar.engine import SamplingParams, native
from kvcellar.engine.experts import RoutedExperts, Router, runs_moe_kernels, split_experts
from kvcellar.engine.linears import FastLinear, prepare_model
from kvcellar.quantization import quantize_model
from tests._models import (
    TEST_DEVICE,
    assert_generates_like_reference,
    assert_identical_output,
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    moe_gguf,
    needs_native,
    reference_greedy,
    served_moe,
    tiered,
    uncached_runner,
)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
SYSTEM = ("You review pull requests. The repository is a storage engine in C; tests run with `make check`. "
          "Answer with the file and the line. ") * 6
QUESTIONS = ("Which file defines the page cache?", "Where is fsync called?", "What does make check run?")


def moe_config(**extra):
    from transformers import AutoConfig

    base = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                norm_topk_prob=True, tie_word_embeddings=False)
    return AutoConfig.for_model("qwen3_moe", **{**base, **extra})


def moe_block(seed: int = 0, **extra):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(moe_config(**extra)).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


@pytest.mark.parametrize("normalize", [True, False])
def test_the_block_computes_what_transformers_computes(normalize):
    block = moe_block(norm_topk_prob=normalize)
    ours = copy.deepcopy(block)
    assert split_experts(ours) == 1
    assert isinstance(ours.experts, RoutedExperts) and isinstance(ours.gate, Router)
    for tokens in (1, 3, 40):
        h = torch.randn(1, tokens, 128)
        with torch.no_grad():
            want, got = block(h), ours(h)
            assert torch.equal(block.gate(h.view(-1, 128))[2], ours.gate(h.view(-1, 128))[2])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_unknown_experts_module_is_refused_not_run_by_transformers():
    block = moe_block()

    class MysteryExperts(torch.nn.Module):
        pass

    block.experts = MysteryExperts()
    with pytest.raises(ValueError, match="MysteryExperts"):
        split_experts(block)


def test_the_router_picks_the_same_experts_for_a_row_whatever_the_step():
    """Logits of a row alone (a decode step: a matrix-vector product) and among 64 (a prefill
    step) are the same bits, so a near-tie between two experts cannot flip with the step."""
    router = moe_block().gate
    split = Router(router.weight, None, router.top_k, "softmax_topk", True)
    rows = torch.randn(64, 128)
    together = split.logits(rows)
    for i in range(0, 64, 7):
        assert torch.equal(split.logits(rows[i:i + 1]), together[i:i + 1])
    # The whole choice (on kvcellar's kernel where it is built: native.route): the same logits,
    # the same experts as torch's softmax and top k, their weights within float32 rounding, and
    # every row's numbers alone the bits it gets among 64.
    logits, weights, index = split(rows)
    assert torch.equal(logits, together)
    top, want = torch.topk(torch.softmax(together, dim=-1), router.top_k, dim=-1)
    assert torch.equal(index, want)
    torch.testing.assert_close(weights, top / top.sum(dim=-1, keepdim=True), rtol=1e-6, atol=1e-7)
    for i in range(0, 64, 9):
        assert all(torch.equal(a, b[i:i + 1]) for a, b in zip(split(rows[i:i + 1]), (logits, weights, index),
                                                                strict=True))
    # A tie to within float32 rounding: both experts' logits equal, and the pick stays put.
    tie = rows[:1].clone()
    with torch.no_grad():  # an in-place write the router sees (its float64 copy is remade)
        split.weight[1] = split.weight[0]
    logits, _, index = split(torch.cat([tie, rows[1:9]]))
    alone = split(tie)[2]
    assert logits[0, 0] == logits[0, 1] and torch.equal(index[:1], alone)


@needs_native
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_an_experts_rows_do_not_depend_on_who_else_chose_it(mode):
    """Quantized experts on kvcellar's kernels: a token's output is the same bits alone as in
    a step of 40 whose other tokens crowd its experts."""
    block = moe_block()
    split_experts(block)
    prepare_model(block, quantize_model(block, mode, materialize=False), kernel_dtype=torch.int8)
    assert all(m.native and m.quantized for m in block.experts.gate_up) and block.experts.down[0].lean
    assert block.experts._fused().act == "silu"  # the whole block in one kernel call
    assert runs_moe_kernels(block) and block.gate.routes_natively(torch.zeros(1, 128))
    h = torch.randn(1, 40, 128)
    with torch.no_grad():
        together = block(h)
        for i in (0, 17, 39):
            assert torch.equal(block(h[:, i:i + 1]), together[:, i:i + 1])


@needs_native
def test_a_model_too_big_for_panels_keeps_its_int4_weights_mapped_with_the_same_bits(monkeypatch):
    """Where a model's int4 weights would take more than ``PANEL_RAM_SHARE`` of the machine's
    memory as panels, every linear stays in the row layout (the artifact cache's mapped pages):
    the same outputs, to the bit, experts and all."""
    block = moe_block()
    split_experts(block)
    quants = quantize_model(block, "int4", materialize=False)
    roomy = copy.deepcopy(block)
    prepare_model(roomy, quants, kernel_dtype=torch.int8)
    monkeypatch.setattr(native.matmul, "PANEL_RAM_SHARE", 0.0)
    tight = copy.deepcopy(block)
    prepare_model(tight, quants, kernel_dtype=torch.int8)
    linears = [m for m in tight.modules() if isinstance(m, FastLinear)]
    assert linears and not any(m.panels for m in linears)
    assert [m.panels for m in roomy.modules() if isinstance(m, FastLinear)] == [
        native.stores_panels(m.out_features) for m in linears]
    assert tight.experts._fused().act == "silu"  # the whole block in one call, in the row layout too
    h = torch.randn(1, 21, 128)
    with torch.no_grad():
        assert torch.equal(tight(h), roomy(h))


@pytest.mark.parametrize(("extra", "what"), [
    ({}, "every layer sparse"),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [2], "num_hidden_layers": 4}, "dense layers between"),
    ({"norm_topk_prob": False, "num_experts_per_tok": 3}, "weights not renormalized, 3 experts"),
])
def test_a_tiny_hf_model_generates_what_transformers_generates(extra, what):
    from transformers import AutoModelForCausalLM

    from kvcellar.engine.loader import wrap_model

    tokenizer = embedded("float32").tokenizer
    config = moe_config(vocab_size=len(tokenizer), **extra)
    torch.manual_seed(3)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        reference.lm_head.weight.mul_(8.0)
    reference.generation_config.eos_token_id = None
    ours = wrap_model(copy.deepcopy(reference), tokenizer, name=f"tiny-moe-{what}")
    assert not any(type(m).__name__ == "Qwen3MoeExperts" for m in ours.model.modules())
    prompt = chat_ids(ours, QUESTIONS[0], SYSTEM[:200])
    engine = make_engine(ours, max_step_tokens=16, block_size=8)
    result = engine.generate([prompt], PARAMS)[0]
    tokens, logprobs = reference_greedy(reference, prompt, PARAMS.max_tokens)
    assert result.token_ids == tokens
    got = torch.tensor([lp for lp in result.logprobs])
    want = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    engine.shutdown(10)


def test_a_gguf_served_equals_transformers_own_load_of_it():
    """The GGUF loaded whole by transformers (dequantized, its own MoE modules) and as
    kvcellar serves it: with ``--weights full`` the same tokens and logprobs; with int4 the
    experts taken from their Q4_K blocks (value for value), the entry holding no expert
    weight and the model no dense one."""
    reference = prepare._load_gguf(moe_gguf(), torch.float32)
    assert type(reference).__name__ == "Qwen3MoeForCausalLM" and reference.config.moe_intermediate_size == 256
    full = served_moe("full")
    prompt = chat_ids(full, QUESTIONS[1], SYSTEM)
    assert_generates_like_reference(reference, full, prompt, PARAMS)
    tokens, _ = reference_greedy(reference, prompt, PARAMS.max_tokens)

    lean = served_moe("int4")
    experts = [m for m in lean.model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 3 and all(e.num_experts == 8 for e in experts)
    assert lean.artifact is not None
    entry = {k for f in lean.artifact.path.glob("*.safetensors") for k in _keys(f)}
    assert not any("experts" in k for k in entry) and any(k.endswith("mlp.gate.weight") for k in entry)
    engine = make_engine(lean)
    if native.available() and TEST_DEVICE == "cpu":
        assert all(m.lean and m.quantized for e in experts for m in (*e.gate_up, *e.down))
        stacked = reference.model.layers[1].mlp.experts  # layer 1: Q4_K experts
        for linear, weight in ((experts[1].gate_up[5], stacked.gate_up_proj[5]),
                               (experts[1].down[5], stacked.down_proj[5])):
            # Q4_K scales' products rounded to float16 (as int4 keeps them): within that rounding.
            torch.testing.assert_close(linear.dequantized().clone(), weight, rtol=0, atol=2e-3)
    result = engine.generate([prompt], PARAMS)[0]
    # int4/int8 attention and head requantized, activations rounded to 8 bits by the kernels.
    assert result.token_ids[:4] == tokens[:4]
    engine.shutdown(10)


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


@needs_native
@pytest.mark.parametrize("weights", ["auto", "int4", "int8"])
def test_every_step_shape_and_hit_gives_the_uncached_bits(weights):
    loaded = served_moe(weights)
    if weights == "int4" and served_moe("auto").weights == "int4":
        pytest.skip("--weights auto serves int4 here: its case ran these steps")
    assert loaded.weights in ("int4", "int8")
    uncached = uncached_runner(loaded, PARAMS)
    prompts = [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS]
    assert all(len(p) > 300 for p in prompts)
    for chunk in (13, 64):
        engine = make_engine(loaded, max_step_tokens=chunk)
        # the router and int4 experts on kvcellar's kernels, whose rounding the namespace names
        assert engine.descriptor.get("experts") == native.MOE_ARITHMETIC
        assert_identical_output(engine.generate([prompts[0]], PARAMS)[0], uncached(prompts[0]))
        full = engine.generate([prompts[0]], PARAMS)[0]
        assert full.num_cached_tokens == expected_cached(len(prompts[0]), len(prompts[0]))
        assert_identical_output(full, uncached(prompts[0]))
        twice = [prompts[1], prompts[2], prompts[2]]  # partial hits, batched; one prompt twice (n = 2)
        for got, prompt in zip(engine.generate(twice, PARAMS), twice, strict=True):
            assert got.num_cached_tokens > 0
            assert_identical_output(got, uncached(prompt))
        assert_no_leaks(engine)
        engine.shutdown(10)


@needs_native
def test_preemption_and_8bit_kv_give_the_uncached_bits():
    loaded = served_moe("auto")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    prompts = [chat_ids(loaded, f"Question {i}: which test covers bug {i}?") for i in range(6)]
    roomy = make_engine(loaded, block_size=8).generate(prompts, params)
    tight = make_engine(loaded, kv_cache_blocks=30, block_size=8)
    for got, want in zip(tight.generate(prompts, params), roomy, strict=True):
        assert_identical_output(got, want)
    assert tight.scheduler.stats.preemptions > 0
    assert_no_leaks(tight)
    tight.shutdown(10)
    uncached = uncached_runner(loaded, PARAMS, kv_bits=8)
    engine = make_engine(loaded, kv_bits=8, max_step_tokens=64)
    prompt = chat_ids(loaded, QUESTIONS[0], SYSTEM)
    for _ in range(2):  # cold, then a full hit over 8-bit blocks
        assert_same_output(engine.generate([prompt], PARAMS)[0], uncached(prompt))
    engine.shutdown(10)


@needs_native
def test_a_restart_serves_from_ssd_the_uncached_bits(tmp_path: Path):
    loaded = served_moe("auto")
    uncached = uncached_runner(loaded, PARAMS)
    prompts = [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS[:2]]

    first = tiered(loaded, tmp_path, max_step_tokens=64)
    first.generate([prompts[0]], PARAMS)
    assert first.shutdown(30)
    second = tiered(loaded, tmp_path, max_step_tokens=64)
    got = second.generate([prompts[0]], PARAMS)[0]
    assert got.cached_tokens_by_tier.get("ssd", 0) == expected_cached(len(prompts[0]), len(prompts[0]))
    assert_identical_output(got, uncached(prompts[0]))
    got = second.generate([prompts[1]], PARAMS)[0]
    assert got.num_cached_tokens > 0
    assert_identical_output(got, uncached(prompts[1]))
    assert second.shutdown(30)
