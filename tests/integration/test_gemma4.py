"""Gemma 4 (``gemma4`` / ``gemma4_text``: gemma-4-31B, gemma-4-26B-A4B, gemma-4-E2B/E4B) from HF
folders: sliding-window layers between global ones whose heads are wider and fewer (keys are
values, ``attention_k_eq_v``), a dense MLP beside routed experts whose router has its own
norm and a scale per expert (26B-A4B), per-layer embeddings and layers that reuse an earlier
layer's KV (E2B/E4B), soft-capped final logits.

Tiny random configs from transformers' own: kvcellar generates what transformers generates;
the KV pool keeps each layer's own head shape (``KVLayout.layer_shapes``); a cache hit gives
the uncached bits with int4/int8 weights on kvcellar's kernels, over 8-bit KV, and after a
restart from SSD."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.cache.kv_pool import KVLayout
from kvcellar.engine.experts import Router, moe_blocks
from kvcellar.engine.sampling import SamplingParams
from tests._models import (
    assert_identical_output,
    assert_same_output,
    chat_ids,
    embedded,
    make_engine,
    needs_native,
    reference_greedy,
    served_file,
    tiered,
    uncached_runner,
)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
SYSTEM = "You are a coding agent. Read the file before you edit it; run the tests after each edit. " * 4
QUESTIONS = ("Which file defines the parser?", "Where are the tests?", "What does make check run?")
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# 26B-A4B's shape, small: every layer a dense MLP and 8 experts (2 routed) side by side.
MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}
# E2B's: per-layer embeddings, the last two layers reading the KV of the last of their kind before.
PER_LAYER = {"hidden_size_per_layer_input": 32, "num_kv_shared_layers": 2, "attention_k_eq_v": False}


def gemma4(vocab: int, seed: int = 7, **extra: Any) -> Any:
    """A tiny Gemma 4 text model: sliding layers of 2 KV heads of 16 (window 8), global ones of
    1 KV head of 32, final logits soft-capped at 30; weights drawn large enough to matter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma4_text", **{
        "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": len(LAYERS), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 8,
        "layer_types": LAYERS, "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.uniform_(0.5, 2.0)
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("extra", [{}, MOE, PER_LAYER], ids=["31B", "26B-A4B", "E2B"])
def test_a_tiny_gemma4_generates_what_transformers_generates(extra: dict[str, Any]) -> None:
    from kvcellar.engine.loader import wrap_model

    tokenizer = embedded("float32").tokenizer
    reference = gemma4(len(tokenizer), **extra)
    ours = wrap_model(copy.deepcopy(reference), tokenizer, name="tiny-gemma4")
    assert len(moe_blocks(ours.model)) == (len(LAYERS) if extra is MOE else 0)
    assert all(isinstance(r, Router) for r in (layer.router for layer in ours.model.model.layers
                                                 if hasattr(layer, "router")))
    prompt = chat_ids(ours, QUESTIONS[0], SYSTEM)
    engine = make_engine(ours, max_step_tokens=16, block_size=8)
    layout = engine.pool.layout
    wide = (2 if extra is PER_LAYER else 1, 32)  # keys as values: one KV head on global layers
    assert layout.layer_shapes == ((2, 16), (2, 16), wide, (2, 16), wide)
    result, hit = (engine.generate([prompt], PARAMS)[0] for _ in range(2))
    assert hit.num_cached_tokens >= len(prompt) - 8
    tokens, logprobs = reference_greedy(reference, prompt, PARAMS.max_tokens)
    assert result.token_ids == hit.token_ids == tokens
    want = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    for got in (result, hit):
        torch.testing.assert_close(torch.tensor(list(got.logprobs)), want, rtol=0, atol=2e-4)
    engine.shutdown(10)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 4 with every part at once (experts, per-layer embeddings, shared KV) saved as
    a HF folder, with the embedded model's tokenizer."""
    tokenizer = embedded("float32").tokenizer
    path = tmp_path_factory.mktemp("gemma4")
    gemma4(len(tokenizer), **{**MOE, **PER_LAYER}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("weights", ["full", pytest.param("int4", marks=needs_native),
                                     pytest.param("int8", marks=needs_native)])
def test_a_hit_gives_the_uncached_output_on_every_step_shape(folder: Path, weights: str) -> None:
    loaded = served_file(folder, weights)
    engine = make_engine(loaded, max_step_tokens=13, block_size=8)
    uncached = uncached_runner(loaded, PARAMS)
    prompts = [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS]
    results = engine.generate(prompts, PARAMS)  # chunked prefill of 13, shared prefix, batched decode
    again = engine.generate([prompts[0], prompts[1] + prompts[1][-5:]], PARAMS)  # full hit; hit and tail
    if weights != "full":
        fused = [b._fused() for b in moe_blocks(loaded.model)]
        assert all(f is not None and f.gate_up.kind == weights for f in fused)
        assert engine.pool.attends  # every layer's head shape in the kernel
    check = assert_identical_output if weights != "full" else assert_same_output
    for prompt, result in zip([*prompts, prompts[0], prompts[1] + prompts[1][-5:]], [*results, *again],
                              strict=True):
        check(result, uncached(prompt))
    assert again[0].num_cached_tokens >= len(prompts[0]) - 8
    engine.shutdown(10)


@needs_native
def test_8bit_kv_and_a_restart_from_ssd_give_the_uncached_bits(folder: Path, tmp_path: Path) -> None:
    loaded = served_file(folder, "int8")
    prompt = chat_ids(loaded, QUESTIONS[2], SYSTEM)
    uncached = uncached_runner(loaded, PARAMS, kv_bits=8, kv_group_size=16)
    engine = make_engine(loaded, kv_bits=8, kv_group_size=16, max_step_tokens=13, block_size=8)
    for _ in range(2):  # cold, then a full hit over 8-bit blocks of two head shapes
        assert_identical_output(engine.generate([prompt], PARAMS)[0], uncached(prompt))
    engine.shutdown(10)

    uncached = uncached_runner(loaded, PARAMS)
    first = tiered(loaded, tmp_path, max_step_tokens=64)
    first.generate([prompt], PARAMS)
    assert first.shutdown(30)
    second = tiered(loaded, tmp_path, max_step_tokens=64)
    got = second.generate([prompt], PARAMS)[0]
    assert got.cached_tokens_by_tier.get("ssd", 0) >= len(prompt) - 16
    assert_identical_output(got, uncached(prompt))
    assert second.shutdown(30)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_native)])
def test_layers_of_different_head_shapes_keep_their_own_kv(bits: int, kernels: bool) -> None:
    """A pool whose layers differ (4 x 16 and 1 x 32 values a token): each layer reads back what
    was written to it, untouched by its neighbours' writes; attention over each layer's blocks
    (the kernel reading them where they lie) is SDPA's over the gathered context."""
    from kvcellar.cache.kv_pool import KVPool, dequantize_kv, quantize_kv
    from kvcellar.engine import native

    layout = KVLayout(num_layers=3, num_kv_heads=4, head_dim=16, block_size=4, dtype=torch.float32, kv_bits=bits,
                      kv_group_size=16, layer_shapes=((4, 16), (1, 32), (2, 16)))
    pool = KVPool(layout, 6, torch.device("cpu"), *((native.gather_kv, native.attend_kv, native.write_kv)
                                                    if kernels else (None, None, None)))
    gen = torch.Generator().manual_seed(0)
    blocks = torch.tensor([3, 3, 3, 3, 1, 1, 1])
    offsets = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    written = {}
    for layer in (1, 0, 2):  # a narrow layer first: the wide one beside it must not reach into it
        heads, dim = layout.heads(layer)
        k, v = (torch.randn(7, heads, dim, generator=gen) for _ in range(2))
        pool.write(layer, blocks, offsets, k, v)
        if bits < 16:
            k, v = (dequantize_kv(*quantize_kv(x, bits, 16), bits, torch.float32) for x in (k, v))
        written[layer] = k, v
    table = torch.tensor([[3, 1]])
    for layer, (k, v) in written.items():
        gk, gv = pool.gather(layer, table)
        assert torch.equal(gk[0].transpose(0, 1)[:7], k) and torch.equal(gv[0].transpose(0, 1)[:7], v)
        if not kernels:
            continue
        heads, dim = layout.heads(layer)
        q = torch.randn(1, heads, 2, dim, generator=gen)
        got = pool.attend(layer, table, torch.tensor([7]), q, dim ** -0.5)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(heads * 2, 1, dim), k.transpose(0, 1).repeat_interleave(2, 0),
            v.transpose(0, 1).repeat_interleave(2, 0), scale=dim ** -0.5)
        torch.testing.assert_close(got.reshape(heads * 2, 1, dim), want, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """One tiny Gemma 4 with every part, as transformers holds it, as a GGUF written the way
    llama.cpp writes Gemma 4 (float32 tensors) and as a HF folder (with the GGUF's tokenizer)."""
    from kvcellar.artifacts.prepare import gguf_tokenizer
    from tests.artifacts.gguf_files import gguf_vocab, write_gemma4_gguf

    path = tmp_path_factory.mktemp("gemma4-gguf")
    model = gemma4(len(gguf_vocab()[0]), seed=11, **{**MOE, **PER_LAYER})
    gguf = write_gemma4_gguf(path / "tiny-gemma4.gguf", model)
    folder = path / "hf"
    model.save_pretrained(folder)
    gguf_tokenizer(gguf).save_pretrained(folder)
    return model, gguf, folder


@pytest.mark.parametrize("weights", ["full", pytest.param("int8", marks=needs_native),
                                     pytest.param("int4", marks=needs_native)])
def test_a_gguf_serves_what_its_hf_folder_serves(gguf_pair: tuple[Any, Path, Path], weights: str) -> None:
    """The GGUF's config (head shapes per layer kind, which layers slide, shared KV, experts,
    the partial rotation) and tensors (the router's and experts' scales under llama.cpp's
    names, gate and up fused) read back as the model: with ``--weights full`` transformers' own
    tokens and logprobs, quantized the same bits as the HF folder quantized."""
    model, gguf, folder = gguf_pair
    served = served_file(gguf, weights)
    prompt = served.tokenizer("hello there, tell me a story about the old wizard and the dragon " * 2).input_ids
    engine = make_engine(served, max_step_tokens=16, block_size=8)
    got = engine.generate([prompt], PARAMS)[0]
    engine.shutdown(10)
    if weights == "full":
        tokens, logprobs = reference_greedy(model, prompt, PARAMS.max_tokens)
        assert got.token_ids == tokens
        want = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(list(got.logprobs)), want, rtol=0, atol=2e-4)
        return
    engine = make_engine(served_file(folder, weights), max_step_tokens=16, block_size=8)
    assert_identical_output(got, engine.generate([prompt], PARAMS)[0])
    engine.shutdown(10)


@needs_native
def test_a_quantized_gguf_under_auto_gives_the_uncached_bits(tmp_path: Path) -> None:
    """4-bit experts (Q4_0: a tiny model's rows are too short for Q4_K's 256) and Q8_0 linears,
    served under the default weights: a hit is the uncached output."""
    from tests.artifacts.gguf_files import gguf_vocab, write_gemma4_gguf

    def types(name: str) -> str:
        return "Q4_0" if "_exps" in name else "F32" if "ffn_gate_inp" in name else "Q8_0"

    model = gemma4(len(gguf_vocab()[0]), seed=12, **MOE)
    loaded = served_file(write_gemma4_gguf(tmp_path / "q4_k_m.gguf", model, types), "auto")
    assert loaded.weights in ("int4", "int8")
    uncached = uncached_runner(loaded, PARAMS)
    prompt = loaded.tokenizer("a story about the old wizard and the dragon, and the knight " * 3).input_ids
    engine = make_engine(loaded, max_step_tokens=13, block_size=8)
    for _ in range(2):  # cold (chunks of 13), then a full hit
        assert_identical_output(engine.generate([prompt], PARAMS)[0], uncached(prompt))
    engine.shutdown(10)
