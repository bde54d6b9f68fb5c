"""gpt-oss from GGUF, as llama.cpp writes gpt-oss-20b: MXFP4 experts with biases (gate and
up in tensors of their own), Q8_0 attention with biases and a sink per head, sliding-window
layers, YaRN rope.

The reference is transformers' own ``GptOssForCausalLM`` holding the file's tensors as the
``gguf`` package dequantizes them, placed by llama.cpp's naming (``reference``), not by
kvcellar's conversion. Checked: ``--weights full`` generates its tokens and logprobs; under
the quantized modes each expert's MXFP4 codes and exponents are kept as stored (the weight
the kernel multiplies is the reference's, exactly) and every cache path gives the uncached
engine's bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvcellar.artifacts.gguf_convert import gguf_config
from kvcellar.engine import SamplingParams
from kvcellar.engine.experts import RoutedExperts
from tests._models import (
    TEST_DEVICE,
    assert_generates_like_reference,
    assert_identical_output,
    assert_no_leaks,
    chat_ids,
    expected_cached,
    gpt_oss_gguf,
    make_engine,
    needs_native,
    reference_greedy,
    served_gpt_oss,
    tiered,
    uncached_runner,
)
from tests.engine.test_stored_panels import mapped

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
SYSTEM = "You answer questions about a build system in one line. The build uses ninja and clang. " * 8
QUESTIONS = ("Which compiler builds it?", "How are tests run?", "Where is the cache?")


def reference(path: Path):
    """transformers' gpt-oss with the GGUF's tensors (dequantized by the ``gguf`` package),
    named as llama.cpp's converter names them: experts' gate and up de-interleaved, stacked
    weights stored outputs first."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(gguf_config(path), dtype=torch.float32, attn_implementation="eager")
    stored = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        stored[t.name] = torch.from_numpy(np.array(values, dtype=np.float32))
    names = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
             "ffn_gate_inp.bias": "mlp.router.bias"}
    for gguf_name, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                            ("attn_output", "o_proj")):
        names |= {f"{gguf_name}.{p}": f"self_attn.{proj}.{p}" for p in ("weight", "bias")}
    state = {"model.embed_tokens.weight": stored["token_embd.weight"],
             "model.norm.weight": stored["output_norm.weight"], "lm_head.weight": stored["output.weight"]}
    for i in range(model.config.num_hidden_layers):
        state |= {f"model.layers.{i}.{hf}": stored[f"blk.{i}.{g}"] for g, hf in names.items()}
        gate, up = stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]  # [E, I, H]
        experts = f"model.layers.{i}.mlp.experts"
        state[f"{experts}.gate_up_proj"] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
        gate_b, up_b = stored[f"blk.{i}.ffn_gate_exps.bias"], stored[f"blk.{i}.ffn_up_exps.bias"]
        state[f"{experts}.gate_up_proj_bias"] = torch.stack([gate_b, up_b], dim=2).flatten(1, 2)
        state[f"{experts}.down_proj"] = stored[f"blk.{i}.ffn_down_exps.weight"].transpose(1, 2)
        state[f"{experts}.down_proj_bias"] = stored[f"blk.{i}.ffn_down_exps.bias"]
    missing, unexpected = model.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    model.generation_config.eos_token_id = None
    return model.eval()


def test_full_weights_generate_what_transformers_generates_from_the_files_tensors():
    ref = reference(gpt_oss_gguf())
    assert ref.config.layer_types == ["sliding_attention", "full_attention"] and ref.config.sliding_window == 16
    assert ref.config.head_dim == 32 and ref.config.rope_parameters["rope_type"] == "yarn"
    full = served_gpt_oss("full")
    prompt = chat_ids(full, QUESTIONS[0], SYSTEM)
    assert len(prompt) > 3 * 16  # past the window
    assert_generates_like_reference(ref, full, prompt, PARAMS)


@needs_native
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_mxfp4_experts_are_kept_code_for_code(weights):
    """The experts' linears multiply the reference's expert weights exactly (MXFP4 under
    every quantized mode: exact and the smallest; kept as panels, stored), gate and up rows
    interleaved as gpt-oss gates them, each expert's biases its own; no expert weight lies in
    the dense entry."""
    ref = reference(gpt_oss_gguf())
    loaded = served_gpt_oss(weights)
    blocks = [m for m in loaded.model.modules() if isinstance(m, RoutedExperts)]
    assert len(blocks) == 2 and all(b.num_experts == 8 for b in blocks)
    engine = make_engine(loaded)  # prepares the linears
    if TEST_DEVICE != "cpu":
        pytest.skip("the MXFP4 kernel runs on CPUs")
    stacked = ref.model.layers[1].mlp.experts
    for e in (0, 5):
        gate_up, down = blocks[1].gate_up[e], blocks[1].down[e]
        assert gate_up.quant_kind == "mxfp4" and down.quant_kind == "mxfp4" and gate_up.lean
        assert gate_up.panels and down.panels  # kept as panels (their bits are the row layout's)
        assert torch.equal(gate_up.dequantized().clone(), stacked.gate_up_proj[e].t())
        assert torch.equal(down.dequantized().clone(), stacked.down_proj[e].t())
        assert torch.equal(gate_up.bias, stacked.gate_up_proj_bias[e])
        assert torch.equal(down.bias, stacked.down_proj_bias[e])
    assert blocks[1]._fused().act == "clamped"  # the whole block, biases and gating too, in one call
    # every expert's panels stored in the quantized entry as it was prepared, and mapped from it
    experts = [m for b in blocks for m in (*b.gate_up, *b.down)]
    assert len(experts) == 2 * 2 * 8 and all(mapped(m) for m in experts)
    entry = {k for f in loaded.artifact.path.glob("*.safetensors") for k in _keys(f)}
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in entry)
    prompt = chat_ids(loaded, QUESTIONS[1], SYSTEM)
    tokens, _ = reference_greedy(ref, prompt, 4)
    # attention requantized, activations rounded to 8 bits by the kernels: the first tokens
    assert engine.generate([prompt], PARAMS)[0].token_ids[:2] == tokens[:2]
    engine.shutdown(10)


@pytest.mark.parametrize(("attention", "mode"), [("Q8_0", "int8"), ("F16", "int8"), ("Q4_0", "int4")])
def test_weights_auto_reads_the_attention_types_mxfp4_experts_do_not_vote(tmp_path: Path, attention, mode):
    """Every gpt-oss GGUF keeps its experts in MXFP4 whatever its label; the other linears
    pick the mode, and a float file is served int8, not in floats (its experts would be)."""
    from kvcellar.engine.loader import gguf_weights_mode
    from kvcellar.gguf_info import read_gguf_info
    from tests.artifacts.gguf_files import gpt_oss_types, write_gguf

    def types(name: str) -> str:
        kind = gpt_oss_types(name)
        return attention if kind == "Q8_0" else kind

    path = write_gguf(tmp_path / "g.gguf", arch="gpt-oss", hidden=256, layers=1, heads=4, kv_heads=2, experts=2,
                      experts_used=1, expert_ffn=64, types=types)
    assert gguf_weights_mode(read_gguf_info(path)) == mode


@needs_native
def test_the_memory_plan_counts_mxfp4_experts_as_stored():
    """``serve`` refuses a model whose plan does not fit: MXFP4 experts planned at 1 byte a
    weight would double gpt-oss-20b's 11 GB and refuse it on a 24 GB machine."""
    from kvcellar.engine.memory import MXFP4_BYTES_PER_WEIGHT, plan_memory
    from kvcellar.model_source import resolve_source

    if TEST_DEVICE != "cpu":
        pytest.skip("the MXFP4 kernel runs on CPUs")
    loaded = served_gpt_oss("int8")
    plan = plan_memory(resolve_source(str(gpt_oss_gguf())), "int8", torch.float32, 0)
    assert plan.mxfp4_params == 2 * 8 * 3 * 128 * 256
    engine = make_engine(loaded)
    linears = sum(m.nbytes for m in engine.runner.linears.linears)
    experts = sum(m.nbytes for b in loaded.model.modules() if isinstance(b, RoutedExperts)
                  for m in (*b.gate_up, *b.down))
    assert abs(experts - plan.mxfp4_params * MXFP4_BYTES_PER_WEIGHT) <= 0.05 * experts  # + their biases
    held = linears + sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert abs(plan.weights_bytes - held) <= 0.02 * held, (plan.weights_bytes, held)
    engine.shutdown(10)


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


@needs_native
@pytest.mark.parametrize("weights", ["auto", "int4"])
def test_every_step_shape_hit_and_restart_gives_the_uncached_bits(tmp_path: Path, weights):
    loaded = served_gpt_oss(weights)
    assert loaded.weights == ("int8" if weights == "auto" else "int4")  # Q8_0 attention: int8
    uncached = uncached_runner(loaded, PARAMS)
    prompts = [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS]
    for chunk in (7, 64):
        engine = make_engine(loaded, max_step_tokens=chunk)
        assert_identical_output(engine.generate([prompts[0]], PARAMS)[0], uncached(prompts[0]))
        full = engine.generate([prompts[0]], PARAMS)[0]
        assert full.num_cached_tokens == expected_cached(len(prompts[0]), len(prompts[0]))
        assert_identical_output(full, uncached(prompts[0]))
        for got, prompt in zip(engine.generate(prompts[1:], PARAMS), prompts[1:], strict=True):
            assert got.num_cached_tokens > 0
            assert_identical_output(got, uncached(prompt))
        assert_no_leaks(engine)
        engine.shutdown(10)
    first = tiered(loaded, tmp_path, max_step_tokens=64)
    first.generate([prompts[2]], PARAMS)
    assert first.shutdown(30)
    second = tiered(loaded, tmp_path, max_step_tokens=64)
    got = second.generate([prompts[2]], PARAMS)[0]
    assert got.cached_tokens_by_tier.get("ssd", 0) == expected_cached(len(prompts[2]), len(prompts[2]))
    assert_identical_output(got, uncached(prompts[2]))
    second.shutdown(10)
