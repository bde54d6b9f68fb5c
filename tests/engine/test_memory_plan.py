"""What a model will need, known before it loads (engine/memory.py, issue 25): the plan
matches what the engine then holds, `kvcellar models plan` prints it, and `serve` refuses a
model above `--max-memory-gb` with the figures instead of loading it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvcellar.engine.linears import quant_kernels_run
from kvcellar.engine.memory import GIB, OVERHEAD_BYTES, check_fits, plan_memory
from kvcellar.errors import ModelLoadError
from kvcellar.model_source import resolve_source
from tests._models import make_engine
from tests.engine.test_quantization import load


@pytest.mark.skipif(not quant_kernels_run(torch.bfloat16, torch.device("cpu")), reason="no int4 kernel here")
def test_the_int4_plan_is_what_the_engine_holds():
    loaded = load("int4")
    plan = plan_memory(resolve_source(None), "int4", torch.bfloat16, 0)
    engine = make_engine(loaded)
    linears = sum(m.nbytes for m in engine.runner.linears.linears)
    rest = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters())
    held = linears + rest  # the prepared linears hold no parameters: the rest is embeddings and norms
    assert abs(plan.weights_bytes - held) <= 0.02 * held, (plan.weights_bytes, held)


def _held(engine) -> int:
    """The bytes an engine's model holds: its prepared linears, parameters and int4 embedding."""
    from kvcellar.quantization import QuantizedEmbedding

    embedding = engine.model.get_input_embeddings()
    linears = sum(m.nbytes for m in engine.runner.linears.linears)
    rest = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters())
    return linears + rest + (embedding.quant.nbytes if isinstance(embedding, QuantizedEmbedding) else 0)


@pytest.mark.skipif(not quant_kernels_run(torch.bfloat16, torch.device("cpu")), reason="no int4 kernel here")
def test_the_plan_counts_an_embedding_kept_as_int4_blocks(tmp_path):
    """A Q4_0 embedding is served from its int4 blocks (``QuantizedEmbedding``): the plan
    counts it so, and still matches what the engine holds."""
    from kvcellar.artifacts.store import ArtifactCache
    from kvcellar.quantization import QuantizedEmbedding
    from kvcellar.runtime import prepare_and_load
    from tests.artifacts.gguf_files import write_gguf

    path = write_gguf(tmp_path / "q4_0.gguf", arch="llama", types="Q4_0", vocab_size=4096)
    plan = plan_memory(resolve_source(str(path)), "int4", torch.bfloat16, 0)
    assert plan.embedding_int4_params == 4096 * 256
    loaded = prepare_and_load(str(path), dtype="bfloat16", device="cpu", weights="int4",
                              artifacts=ArtifactCache(tmp_path / "models"))
    assert isinstance(loaded.model.get_input_embeddings(), QuantizedEmbedding)
    held = _held(make_engine(loaded))
    assert abs(plan.weights_bytes - held) <= 0.02 * held, (plan.weights_bytes, held)


@pytest.mark.skipif(not quant_kernels_run(torch.bfloat16, torch.device("cpu")), reason="no int4 kernel here")
def test_panels_the_artifact_cache_stores_are_planned_at_any_size(tmp_path, monkeypatch):
    """A model whose int4 weights are more than a start may pack as panels (a Qwen3.5-35B-A3B's
    19 GB on a 24 GB machine) still gets them as panels from the artifact cache, without a Q4_0
    source's offsets: the plan counts them so, where it refused such a model for the offsets it
    would not hold. Without the artifact cache they stay in the row layout, offsets and all."""
    from kvcellar.artifacts.store import ArtifactCache
    from kvcellar.engine import native
    from kvcellar.runtime import prepare_and_load
    from tests.artifacts.gguf_files import write_gguf

    if not native.available():
        pytest.skip("kvcellar's kernels are not built here")
    monkeypatch.setattr(native.matmul, "PANEL_RAM_SHARE", 1e-9)  # every model is too big to pack at a start
    path = write_gguf(tmp_path / "q4_0.gguf", arch="llama", types="Q4_0", vocab_size=4096)
    source = resolve_source(str(path))
    stored = plan_memory(source, "int4", torch.bfloat16, 0, stored_panels=True)
    packed = plan_memory(source, "int4", torch.bfloat16, 0)
    assert stored.weights_bytes < packed.weights_bytes
    for plan, artifacts in ((stored, ArtifactCache(tmp_path / "models")), (packed, None)):
        loaded = prepare_and_load(str(path), dtype="bfloat16", device="cpu", weights="int4", artifacts=artifacts)
        held = _held(make_engine(loaded))
        assert abs(plan.weights_bytes - held) <= 0.02 * held, (artifacts, plan.weights_bytes, held)


def test_full_weights_count_a_tied_head_once():
    source = resolve_source(None)  # SmolLM2 ties its LM head to the embedding
    full = plan_memory(source, "full", torch.bfloat16, GIB)
    assert full.weights_bytes == (full.linear_params + full.other_params) * 2
    assert full.total_bytes == full.weights_bytes + GIB + OVERHEAD_BYTES
    int4 = plan_memory(source, "int4", torch.bfloat16, GIB)
    assert int4.weights_bytes < 0.6 * full.weights_bytes


def test_a_plan_over_the_limit_is_refused_with_its_figures():
    plan = plan_memory(resolve_source(None), "full", torch.bfloat16, 2 * GIB)
    check_fits(plan, max_memory_gb=100)
    with pytest.raises(ModelLoadError, match=r"needs 3\.\d GB: weights 0\.3 GB \(full\), KV pool 2\.0 GB.*"
                                             r"--max-memory-gb is 3\.0 GB"):
        check_fits(plan, max_memory_gb=3)


def test_serve_refuses_before_loading_and_models_plan_says_why(tmp_path):
    kvcellar = [sys.executable, "-m", "kvcellar.cli"]
    plan = subprocess.run([*kvcellar, "models", "plan", "--json", "--weights", "full", "--dtype", "bfloat16",
                           "--kv-cache-gb", "1"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    figures = json.loads(plan.stdout)
    assert figures["weights_mode"] == "full" and figures["kv_pool_bytes"] == GIB
    assert figures["total_bytes"] == figures["weights_bytes"] + GIB + OVERHEAD_BYTES
    refused = subprocess.run([*kvcellar, "serve", "--cache-dir", str(tmp_path), "--max-memory-gb", "1.5",
                              "--kv-cache-gb", "1", "--dtype", "bfloat16", "--weights", "full"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "will not fit" in refused.stderr and "--max-memory-gb is 1.5 GB" in refused.stderr
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").rglob("*.safetensors"))


def test_the_plan_of_a_mixture_of_experts_gguf_is_what_the_engine_holds():
    """The experts count as linears (quantized: their int4/int8 bytes, not float32's)."""
    from tests._models import moe_gguf, served_moe

    loaded = served_moe("auto")
    plan = plan_memory(resolve_source(str(moe_gguf())), loaded.weights, loaded.dtype, 0)
    assert plan.linear_params > 0.9 * (plan.linear_params + plan.other_params)  # experts are most of it
    engine = make_engine(loaded)
    linears = sum(m.nbytes for m in engine.runner.linears.linears)
    rest = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters())
    held = linears + rest
    assert abs(plan.weights_bytes - held) <= 0.02 * held, (plan.weights_bytes, held)
    engine.shutdown(10)
