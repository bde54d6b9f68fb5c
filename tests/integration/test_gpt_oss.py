"""gpt-oss (``gpt_oss``: gpt-oss-20b/120b's architecture) from HF folders: routed experts with
biases and a clamped, interleaved SwiGLU, a top-k-then-softmax router with a bias, attention
sinks, and sliding-window layers between full-attention ones.

Tiny random configs from transformers' own: kvcellar generates what transformers generates
(its eager attention, the one that computes sinks), and a cache hit gives the uncached bits,
also with int4/int8 experts on kvcellar's kernels (one call a projection, biases added per
expert) and sinks in the kernel that attends over blocks where they lie."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.engine.attention import _attend_with_sinks
from kvcellar.engine.experts import moe_blocks
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
    uncached_runner,
)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
SYSTEM = "You are a coding agent. Read the file before you edit it; run the tests after each edit. " * 4
QUESTIONS = ("Which file defines the parser?", "Where are the tests?", "What does make check run?")


def gpt_oss(vocab: int, seed: int = 5) -> Any:
    """A tiny gpt-oss: a sliding-window layer (window 8) and a full-attention one, 8 experts of
    64, 2 routed; sinks, biases and weights drawn large enough to matter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=vocab, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.1)
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


def test_a_tiny_gpt_oss_generates_what_transformers_generates() -> None:
    from kvcellar.engine.loader import wrap_model

    tokenizer = embedded("float32").tokenizer
    reference = gpt_oss(len(tokenizer))
    ours = wrap_model(copy.deepcopy(reference), tokenizer, name="tiny-gpt-oss")
    assert len(moe_blocks(ours.model)) == 2
    prompt = chat_ids(ours, QUESTIONS[0], SYSTEM)
    assert len(prompt) > 4 * 8  # the window slides
    engine = make_engine(ours, max_step_tokens=16, block_size=8)
    result = engine.generate([prompt], PARAMS)[0]
    tokens, logprobs = reference_greedy(reference, prompt, PARAMS.max_tokens)
    assert result.token_ids == tokens
    got = torch.tensor(list(result.logprobs))
    want = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    engine.shutdown(10)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gpt-oss saved as a HF folder, with the embedded model's tokenizer."""
    tokenizer = embedded("float32").tokenizer
    path = tmp_path_factory.mktemp("gpt-oss")
    gpt_oss(len(tokenizer)).save_pretrained(path)
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
        assert all(f is not None and f.gate_up.kind == weights and f.gate_up_bias is not None for f in fused)
        assert engine.pool.attends  # the full-attention layer's sinks in the kernel
    check = assert_identical_output if weights != "full" else assert_same_output
    for prompt, result in zip([*prompts, prompts[0], prompts[1] + prompts[1][-5:]], [*results, *again],
                              strict=True):
        check(result, uncached(prompt))
    assert again[0].num_cached_tokens >= len(prompts[0]) - 8
    engine.shutdown(10)


def test_sinks_take_their_share_of_the_softmax() -> None:
    """``_attend_with_sinks`` is transformers' eager gpt-oss attention (a sink column in the
    softmax, dropped after it), causal and windowed, over queries of several passes."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    heads, n, dim = 4, 70, 32
    q, k, v = (torch.randn(1, heads, n, dim) for _ in range(3))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = torch.randn(heads) * 2, 1, False
    window = torch.arange(n)[None, :] > torch.arange(n)[:, None] - 8
    for mask in (None, window):
        visible = torch.ones(n, n, dtype=torch.bool).tril_() if mask is None else mask & torch.ones(n, n).tril_().bool()
        additive = torch.zeros(n, n).masked_fill(~visible, float("-inf"))
        want, _ = eager_attention_forward(module, q, k, v, additive[None, None], scaling=dim ** -0.5)
        got = _attend_with_sinks(q, k, v, None if mask is None else visible, dim ** -0.5,
                                 module.sinks.view(1, heads, 1, 1), causal=mask is None)
        torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=1e-5)
