"""GGUFs of each architecture served, written by the test with the ``gguf`` package (tiny
shapes, random weights, the GGUF types people download): ``--weights int4|int8`` through
the artifact cache, which keeps the linears apart from the rest of the model (the dense
entry holds no linear weight; the quantized entry holds them), and every prefix-cache path
gives what transformers computes from the served weights (each quantized linear's
dequantized weight in a plain ``nn.Linear``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from kvcellar.artifacts import prepare
from kvcellar.artifacts.store import ArtifactCache
from kvcellar.engine.linears import quant_kernels_run, row_layout
from kvcellar.engine.sampling import SamplingParams
from kvcellar.quantization import QuantizedEmbedding
from kvcellar.runtime import prepare_and_load
from tests._models import (
    assert_equivalent_output,
    assert_no_leaks,
    expected_cached,
    make_engine,
    reference_greedy,
    uncached_runner,
    without_native_kernels,
)
from tests.artifacts.gguf_files import write_gguf

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5)
FP32_TOL = 2e-4
BF16_TOL = 0.3  # as tests/engine/test_quantization.py: bf16 rounding differs with the step's rows
KERNELS = quant_kernels_run(torch.bfloat16, torch.device("cpu"))


def q4_k_m_with_q8_embedding(name: str) -> str:
    if name == "token_embd.weight":
        return "Q8_0"
    if name.split(".")[2:3] in (["attn_v"], ["ffn_down"]):
        return "Q6_K"
    return "Q4_K"


FILES: dict[str, dict[str, Any]] = {
    "llama-q4_k_m": dict(arch="llama"),  # Q4_K with Q6_K attn_v/ffn_down, Q6_K output
    "qwen2-q4_0-tied": dict(arch="qwen2", tied=True, types=lambda n: "Q8_0" if n == "token_embd.weight" else "Q4_0"),
    "qwen3-q4_k": dict(arch="qwen3", heads=2, kv_heads=1, tied=True, types=q4_k_m_with_q8_embedding),
    "gemma3-q4_1": dict(arch="gemma3", tied=True, types="Q4_1"),
    # as llama.cpp's `llama-quantize Q4_0` writes a small model: the embedding in Q4_0 too
    "llama-q4_0-tied": dict(arch="llama", tied=True, types="Q4_0"),
}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf-served")
    return {name: write_gguf(folder / f"{name}.gguf", seed=i, head_scale=1.0, **kw)
            for i, (name, kw) in enumerate(FILES.items())}


def served_reference(path: Path, loaded: Any) -> nn.Module:
    """transformers' own model of the GGUF, each quantized linear's weight replaced by what
    the server serves: ``QuantizedWeight.dequantize``."""
    model = prepare._load_gguf(path, torch.float32)
    for name, q in loaded.quantized.items():
        linear = model.get_submodule(name)
        linear.weight = nn.Parameter(row_layout(q).dequantize(torch.float32), requires_grad=False)
    return model.eval()


def prompts(loaded: Any) -> list[list[int]]:
    """A long shared start (past gemma3's 64-token sliding window), then three endings."""
    tok = loaded.tokenizer
    shared = tok("hello world, the other hello " * 12).input_ids
    return [shared + tok(end).input_ids for end in (" tell hello", " or the world", " hell or the")]


def entry_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("name", list(FILES))
def test_served_with_linears_apart_equals_transformers_on_the_served_weights(
        ggufs: dict[str, Path], tmp_path: Path, name: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    without_native_kernels(monkeypatch)  # float32 exactly: the dense path (the kernels' in test_native_kernels)
    path = ggufs[name]
    loaded = prepare_and_load(str(path), dtype="float32", device="cpu", weights=mode,
                              artifacts=ArtifactCache(tmp_path / "models"))
    assert loaded.weights == mode and loaded.artifact is not None and loaded.quantized_artifact is not None
    assert loaded.artifact.manifest.info["linears_apart"] is True
    linears = {f"{n}.weight" for n in loaded.quantized}
    held = entry_names(loaded.artifact.path)
    assert held and not held & linears  # the dense entry holds all but the linears
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= held
    reference = served_reference(path, loaded)

    engine = make_engine(loaded, max_step_tokens=48)  # chunked prefill too
    first, *others = prompts(loaded)

    def check(got: Any, prompt: list[int]) -> None:
        tokens, logprobs = reference_greedy(reference, prompt, PARAMS.max_tokens)
        assert got.token_ids == tokens[: len(got.token_ids)]
        ref = logprobs[torch.arange(len(got.token_ids)), torch.tensor(got.token_ids)]
        assert torch.allclose(torch.tensor(got.logprobs), ref, atol=FP32_TOL)

    check(engine.generate([first], PARAMS)[0], first)
    again = engine.generate([first], PARAMS)[0]  # full hit
    assert again.num_cached_tokens == expected_cached(len(first), len(first))
    check(again, first)
    for got, prompt in zip(engine.generate(others, PARAMS), others, strict=True):  # partial hits, batched
        assert got.num_cached_tokens > 0
        check(got, prompt)
    assert_no_leaks(engine)


@pytest.mark.skipif(not KERNELS, reason="this CPU has no native bf16: the quantized kernels never run")
@pytest.mark.parametrize(("name", "mode"), [("llama-q4_k_m", "int4"), ("qwen2-q4_0-tied", "int8"),
                                            ("gemma3-q4_1", "int4")])
def test_lean_serving_keeps_no_dense_linear(ggufs: dict[str, Path], tmp_path: Path, name: str, mode: str) -> None:
    """With the kernels running, no linear's dense weight exists at any point: the model
    loads with placeholders (no memory) and every linear the engine runs is lean; cached
    runs equal uncached ones under the same weights."""
    from kvcellar.engine.loader import linear_kernels

    loaded = prepare_and_load(str(ggufs[name]), dtype="bfloat16", device="cpu", weights=mode,
                              artifacts=ArtifactCache(tmp_path / "models"))
    embedding = loaded.model.get_input_embeddings().weight
    for module_name in loaded.quantized:
        weight = loaded.model.get_submodule(module_name).weight
        if weight is not embedding:  # a tied LM head: the embedding, quantized for the head alone
            assert weight.stride() == (0, 0) and weight.untyped_storage().nbytes() <= 2
    quantized_bytes = sum(q.nbytes for q in loaded.quantized.values())
    engine = make_engine(loaded)
    assert not any(type(m) is nn.Linear for m in loaded.model.modules())
    prepared = engine.runner.linears
    assert all(m.lean and m._dense is None for m in prepared.linears)
    assert sum(m.nbytes for m in prepared.linears) <= 1.1 * quantized_bytes
    counts = linear_kernels(loaded.model)
    assert counts["lean"] == len(prepared.linears) and counts["dense"] == 0

    uncached = uncached_runner(loaded, PARAMS)
    first, *others = prompts(loaded)
    for prompt in (first, first):
        assert_equivalent_output(engine.generate([prompt], PARAMS)[0], uncached(prompt), BF16_TOL)
    for got, prompt in zip(engine.generate(others, PARAMS), others, strict=True):
        assert got.num_cached_tokens > 0
        assert_equivalent_output(got, uncached(prompt), BF16_TOL)
    assert_no_leaks(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_embedding_stored_as_int4_blocks_is_served_from_them(ggufs: dict[str, Path], tmp_path: Path,
                                                                 dtype: str) -> None:
    """A Q4_0 embedding is kept as its own blocks beside the quantized linears (an eighth of
    float32's bytes), through the artifact cache or not, and a lookup gives exactly the rows
    of the dense embedding ``--weights full`` serves; a tied LM head keeps its own weights.
    An embedding in another type (Q8_0 here) stays dense."""
    path = ggufs["llama-q4_0-tied"]
    cache = ArtifactCache(tmp_path / "models")
    full = prepare_and_load(str(path), dtype=dtype, device="cpu", weights="full", artifacts=cache)
    dense = full.model.get_input_embeddings()
    ids = torch.arange(dense.weight.shape[0]).view(-1, 8)[:, torch.tensor([3, 0, 6])]  # any order, 2-D
    for artifacts in (cache, None):
        loaded = prepare_and_load(str(path), dtype=dtype, device="cpu", weights="int4", artifacts=artifacts)
        embedding = loaded.model.get_input_embeddings()
        assert isinstance(embedding, QuantizedEmbedding)
        assert embedding.quant.nbytes < dense.weight.numel() * 4 / 6
        assert torch.equal(embedding(ids), dense(ids))
        assert "lm_head" in loaded.quantized and "model.embed_tokens" not in loaded.quantized
        if artifacts is not None:
            assert loaded.quantized_artifact is not None
            assert loaded.quantized_artifact.manifest.info["embedding"] == "int4"
    other = prepare_and_load(str(ggufs["qwen2-q4_0-tied"]), dtype=dtype, device="cpu", weights="int4", artifacts=cache)
    assert type(other.model.get_input_embeddings()) is nn.Embedding
