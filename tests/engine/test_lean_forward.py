"""engine/lean_forward.py gives bitwise the logits of transformers' module path, on every
step of every prefix-cache path (chunked prefill, RAM hits, copy-on-write, batched decode),
and is used only where it is exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcellar.engine import native
from kvcellar.engine.experts import moe_blocks
from kvcellar.engine.lean_forward import LeanForward, lean_forward_for, module_forward
from kvcellar.engine.model_runner import ModelRunner
from kvcellar.engine.native import layer as native_layer
from kvcellar.engine.native.layer import DenseLayers
from kvcellar.engine.sampling import SamplingParams
from kvcellar.quantization import quantize_model
from tests._models import (
    chat_ids,
    embedded,
    make_engine,
    needs_native,
    served_gpt_oss,
    served_moe,
    tiny_model,
    without_native_kernels,
)

GEMMA4 = {"global_head_dim": 32, "num_global_key_value_heads": 1, "sliding_window": 24,
          "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 6


class ComparingRunner(ModelRunner):
    """Runs every step through both forwards (the second rewrites the same KV) and keeps the
    largest difference seen; returns the lean logits."""

    def __init__(self, model: Any, pool: Any) -> None:
        super().__init__(model, pool, lean=True)
        assert self.lean is not None, "this architecture should take the lean path"
        self.reference = module_forward(model)
        self.steps = 0
        self.max_diff = 0.0

    @torch.inference_mode()
    def run(self, plan: Any) -> torch.Tensor:
        inputs, meta = self.build(plan)
        args = (inputs["input_ids"], inputs["position_ids"], inputs["logits_to_keep"])
        want = self.reference(*args, meta)
        got = self.forward(*args, self.build(plan)[1])
        self.steps += 1
        if not torch.equal(got, want):
            self.max_diff = max(self.max_diff, float((got.float() - want.float()).abs().max()))
        return got[0].float()


def run_cache_paths(loaded: Any, prompts: list[list[int]], **overrides: Any) -> ComparingRunner:
    engine = make_engine(loaded, **{"max_step_tokens": 48, "block_size": 16, **overrides})
    runner = ComparingRunner(loaded.model, engine.pool)
    engine.runner = runner
    engine.generate(prompts, GREEDY)  # batched decode, chunked prefill
    engine.generate(prompts[:2], GREEDY)  # RAM hits; the second prompt ends on a block boundary
    engine.generate([prompts[0] + [prompts[0][5]] * 7], GREEDY)  # a hit and a tail
    return runner


def prompts_for(loaded: Any) -> list[list[int]]:
    first = chat_ids(loaded, "Name a colour.", SYSTEM)
    boundary = chat_ids(loaded, "Name a fruit.", SYSTEM)
    boundary = boundary[: len(boundary) // 16 * 16]  # fully cached on its second run: copy-on-write
    return [first, boundary, chat_ids(loaded, "Count to three.", SYSTEM)]


def test_embedded_model_logits_are_bitwise_the_module_path(model: Any) -> None:
    runner = run_cache_paths(model, prompts_for(model))
    assert runner.steps > 10 and runner.max_diff == 0.0


def test_bf16_logits_are_bitwise_the_module_path(model: Any) -> None:
    """The embedded model's family in bf16 (its norms and residuals round in bf16), small: a
    CPU without native bf16 emulates its matmuls, which the embedded model's size would make
    slow to test."""
    tiny = tiny_model("llama", model.tokenizer, dtype=torch.bfloat16)
    assert tiny.dtype == torch.bfloat16
    runner = run_cache_paths(tiny, prompts_for(model))
    assert runner.steps > 10 and runner.max_diff == 0.0


@pytest.mark.parametrize(("arch", "extra"), [
    ("qwen2", {"attention_bias": True, "use_sliding_window": False}),
    ("llama", {"num_key_value_heads": 8, "attention_bias": True, "mlp_bias": True}),
    ("qwen3", {}),
    # routed experts in layers 0 and 2, a dense MLP in layer 1
    ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
                   "mlp_only_layers": [1]}),
    # sinks, 16-token windows in layers 0 and 2, biased router and experts, YaRN
    ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}),
    # Gemma 4's 31B: global layers of wider heads, keys as values; 26B-A4B: experts beside the
    # MLP; E2B: per-layer embeddings, the last two layers reading earlier layers' KV
    ("gemma4_text", {**GEMMA4, "attention_k_eq_v": True}),
    ("gemma4_text", {**GEMMA4, "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                     "moe_intermediate_size": 32}),
    ("gemma4_text", {**GEMMA4, "hidden_size_per_layer_input": 32, "num_kv_shared_layers": 2,
                     "num_hidden_layers": 5, "layer_types": [*GEMMA4["layer_types"], "sliding_attention",
                                                             "full_attention"]}),
], ids=["qwen2", "llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma4-31B", "gemma4-26B-A4B", "gemma4-E2B"])
def test_supported_architectures_are_bitwise_the_module_path(model: Any, arch: str, extra: dict) -> None:
    tiny = tiny_model(arch, model.tokenizer, **extra)
    runner = run_cache_paths(tiny, prompts_for(model))
    assert runner.steps > 10 and runner.max_diff == 0.0


def test_other_architectures_keep_the_module_path(model: Any) -> None:
    tiny = tiny_model("mistral", model.tokenizer, sliding_window=24)
    assert lean_forward_for(tiny.model) is None
    engine = make_engine(tiny, block_size=8)
    assert engine.runner.lean is None
    assert lean_forward_for(model.model) is not None
    assert make_engine(model, lean_forward=False).runner.lean is None


@needs_native
def test_the_hidden_states_norms_run_on_the_kernels_for_either_forward_and_the_namespace_names_them(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine on transformers' modules runs the norms the lean walk would (a cache shared by
    the two gives the bits recomputing gives), and the KV namespace names the kernels'
    arithmetic; without the kernels the norms are torch's and the namespace names none."""
    tiny = tiny_model("llama", model.tokenizer, dtype=torch.bfloat16)
    modules = make_engine(tiny, lean_forward=False)
    assert modules.runner.lean is None and modules.runner.kernel_norms
    assert modules.descriptor["arithmetic"] == native.ARITHMETIC
    norms = [tiny.model.model.norm, *(m for layer in tiny.model.model.layers
                                      for m in (layer.input_layernorm, layer.post_attention_layernorm))]
    assert all("forward" in vars(m) for m in norms)  # the modules' own forward replaced
    prompts = prompts_for(model)
    lean = make_engine(tiny).generate(prompts, GREEDY)
    assert [r.token_ids for r in modules.generate(prompts, GREEDY)] == [r.token_ids for r in lean]

    without_native_kernels(monkeypatch)
    plain = tiny_model("llama", model.tokenizer, dtype=torch.bfloat16)
    engine = make_engine(plain)
    assert not engine.runner.kernel_norms and "forward" not in vars(plain.model.model.norm)
    assert "arithmetic" not in engine.descriptor


def test_outputs_with_and_without_the_lean_path_are_identical(model: Any) -> None:
    prompts = prompts_for(model)
    lean = make_engine(model).generate(prompts, GREEDY)
    modules = make_engine(model, lean_forward=False).generate(prompts, GREEDY)
    assert [(r.token_ids, r.logprobs) for r in lean] == [(r.token_ids, r.logprobs) for r in modules]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_and_unfused_linears_give_the_same_outputs_on_every_cache_path(dtype: str) -> None:
    """The lean forward over fused QKV / gate-up (and prepacked weights in bf16) against
    transformers' modules over a separately loaded copy whose linears are not fused: the
    same greedy outputs on a first run, a RAM hit, a hit with a tail and a batch; logprobs
    within fp32 noise, or bf16 rounding (a matmul over fused weights rounds like any other
    matmul shape). float32 on the embedded model; bf16 on a small llama (a CPU without native
    bf16 emulates its matmuls, slow at the embedded model's size)."""
    from kvcellar.artifacts.store import ArtifactCache
    from kvcellar.runtime import prepare_and_load
    from tests._models import LOGPROB_TOL, TEST_DEVICE, assert_equivalent_output, assert_same_output, shared_models_dir

    # Two loads of their own: the shared ``embedded`` model is prepared (fused or not) by
    # whichever test of this worker made the first engine over it.
    if dtype == "float32":
        fused, unfused = (prepare_and_load(None, dtype=dtype, device=TEST_DEVICE, weights="full",
                                           artifacts=ArtifactCache(shared_models_dir())) for _ in range(2))
    else:
        tokenizer = embedded().tokenizer
        fused, unfused = (tiny_model("llama", tokenizer, dtype=torch.bfloat16) for _ in range(2))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
    a, b = make_engine(fused, max_step_tokens=48), make_engine(unfused, lean_forward=False, max_step_tokens=48)
    assert a.runner.linears.fused and not b.runner.linears.fused
    prompts = prompts_for(fused)
    runs = [lambda e: e.generate(prompts, params),  # chunked prefill, batched decode
            lambda e: e.generate(prompts[:2], params),  # RAM hits (the second: copy-on-write)
            lambda e: e.generate([prompts[0] + [prompts[0][5]] * 7], params)]  # a hit and a tail
    for run in runs:
        for got, want in zip(run(a), run(b), strict=True):
            assert got.num_cached_tokens == want.num_cached_tokens
            if dtype == "float32":
                assert_same_output(got, want, LOGPROB_TOL)
            else:
                assert_equivalent_output(got, want, 0.3)


@needs_native
@pytest.mark.parametrize(("weights", "kind"), [("auto", "int4"), ("int8", "int8"), ("gpt-oss", "mxfp4")])
def test_a_moe_gguf_on_kvcellars_kernels_is_bitwise_the_module_path(weights: str, kind: str) -> None:
    """Qwen3-MoE from a Q4_K_M-like GGUF and gpt-oss's MXFP4 experts: they run in one call a
    projection and layer (``native.moe_matmul``), on both paths."""
    loaded = served_gpt_oss("auto") if weights == "gpt-oss" else served_moe(weights)
    runner = run_cache_paths(loaded, prompts_for(loaded))
    blocks = moe_blocks(loaded.model)
    assert blocks and {(b._fused().gate_up.kind, b._fused().down.kind) for b in blocks} == {(kind, kind)}
    assert runner.steps > 10 and runner.max_diff == 0.0


@needs_native
@pytest.mark.parametrize(("arch", "dtype", "weights", "kv_bits"), [
    ("llama", torch.bfloat16, "int4", 16), ("qwen2", torch.bfloat16, "int4", 8), ("llama", torch.float32, "int8", 4),
    ("qwen2", torch.float32, "int4", 16), ("qwen3", torch.bfloat16, "int4", 8)])
def test_a_dense_models_layers_in_one_call_are_bitwise_the_module_path(
        model: Any, monkeypatch: pytest.MonkeyPatch, arch: str, dtype: torch.dtype, weights: str, kv_bits: int) -> None:
    """The lean walk's layers in one call (``native.DenseLayers``: decodes, and prompt chunks of
    up to 64 rows) against transformers' modules over the same kernels, on every cache path:
    the same logits to the bit, in bf16 and float32, over int4 panels and int8 linears with
    biases (Qwen2's QKV; Llama's everywhere), Qwen3's per-head norms, KV of 16, 8 and 4 bits."""
    extra = {"qwen2": {"attention_bias": True, "use_sliding_window": False},
             "llama": {"attention_bias": True, "mlp_bias": True}, "qwen3": {"attention_bias": True}}[arch]
    tiny = tiny_model(arch, model.tokenizer, dtype=dtype, **extra)
    with torch.no_grad():  # biases and head norms off their initial values, so that one missed shows
        for name, p in tiny.model.named_parameters():
            if name.endswith("bias") or name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(torch.randn_like(p) * 0.5)
    tiny.quantized, tiny.kernel_dtype = quantize_model(tiny.model, weights), torch.int8
    calls: list[int] = []
    real = DenseLayers.__call__
    monkeypatch.setattr(DenseLayers, "__call__", lambda self, h, *a: (calls.append(h.shape[1]), real(self, h, *a))[1])
    runner = run_cache_paths(tiny, prompts_for(model), kv_bits=kv_bits, kv_group_size=16)
    assert isinstance(runner.lean, LeanForward) and runner.lean.dense is not None
    assert runner.steps > 10 and runner.max_diff == 0.0
    assert len(calls) > 10 and max(calls) > 1  # decodes and prompt chunks both took it


@needs_native
def test_silu_on_the_kernels_is_torchs_within_rounding_and_each_rows_own() -> None:
    """The act the layers' call and every other path run: within a few ulp of torch's silu in
    float32 and 1 bf16 ulp in bf16, the same per row whatever the rows, a strided gate taken as
    it lies; other inputs get torch's."""
    silu = native_layer.silu_for(torch.nn.functional.silu)
    assert silu is not None
    torch.manual_seed(0)
    x = torch.randn(37, 2 * 264) * 6
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 88.5, -200.0])
    for dtype, tol in ((torch.float32, 4e-7), (torch.bfloat16, 8e-3)):
        gate = x.to(dtype)[:, :264]  # the gate half of a fused gate-up: rows 528 apart
        got, want = silu(gate), torch.nn.functional.silu(gate.float())
        assert got.dtype == dtype and got.shape == gate.shape and torch.isfinite(got).all()
        assert ((got.float() - want).abs() <= tol * want.abs() + 1e-30).all()
        rows = torch.cat([silu(gate[i : i + 1]) for i in range(37)])
        assert torch.equal(rows, got)
    assert torch.equal(silu(x.double()), torch.nn.functional.silu(x.double()))
