"""Hybrid Gated-DeltaNet models (``qwen3_5``: Qwen3.5, Qwen3.6): three linear-attention layers
to one gated full-attention layer.

kvcellar runs them through its own walk (``engine/lean_qwen35.py``): the attention layers over
the paged KV pool (which holds only them), the linear-attention layers a token at a time over
each sequence's recurrent state (``engine/deltanet.py``, in ``cache/state_pool.py``'s slots).
Checked here: greedy tokens and logprobs against transformers' own ``generate`` (which computes
prompts in chunks), a token's bits independent of the step it runs in (chunk sizes, batches,
preemption, 8-bit KV) under the native kernels, a model from a HF folder, every state slot given
back, and a failed step. Until states are snapshotted these models reuse no prefix: a second
identical prompt is computed again, and says so (``cached_tokens`` 0)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.engine import SamplingParams
from kvcellar.engine.model_runner import ModelRunner
from kvcellar.engine.scheduler import StepPlan
from tests._models import (
    assert_generates_like_reference,
    assert_identical_output,
    assert_no_leaks,
    chat_ids,
    embedded,
    make_engine,
    needs_native,
    served_file,
    tiny_model,
    uncached_runner,
)

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True)
SYSTEM = "You keep a build farm running. Answer with the host name and the command. " * 6
QUESTIONS = ("Which host runs the nightly build?", "How do I restart the runner on ci-3?",
             "Why did the cache volume fill up?")
# Four layers: linear, linear, linear, full attention (transformers' default interval of 4).
CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@functools.cache
def tiny() -> Any:
    return tiny_model("qwen3_5_text", embedded().tokenizer, **CONFIG)


@functools.cache
def folder() -> Path:
    """``tiny()``'s model written as a HF folder (safetensors, config, the embedded tokenizer)."""
    path = Path(tempfile.mkdtemp(prefix="kvcellar-test-qwen35-")) / "tiny-qwen3_5"
    atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
    loaded = tiny()
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


def prompts(loaded: Any) -> list[list[int]]:
    return [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS]


@pytest.mark.parametrize("chunk", [512, 7, 64])
def test_the_engine_generates_what_transformers_generates(chunk):
    loaded = tiny()
    prompt = prompts(loaded)[0]
    assert len(prompt) > 100
    assert_generates_like_reference(loaded.model, loaded, prompt, PARAMS, chunk=chunk)


def test_the_pool_holds_only_the_attention_layers_and_a_state_per_sequence():
    engine = make_engine(tiny(), max_num_seqs=3)
    assert engine.layout.num_layers == 1
    states = engine.scheduler.cache.states
    assert states is not None and states.slots == 3 and states.layout.num_layers == 3
    assert states.layout.heads == 4 and states.layout.conv_channels == 2 * 64 + 128
    results = engine.generate(prompts(tiny()) * 2, PARAMS)  # six sequences through three slots
    assert len(results) == 6 and results[0].token_ids == results[3].token_ids
    assert_no_leaks(engine)
    engine.shutdown(10)


@needs_native
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_every_step_shape_gives_the_uncached_bits(weights):
    loaded = served_file(folder(), weights)
    assert loaded.weights == weights and type(loaded.model).__name__ == "Qwen3_5ForCausalLM"
    uncached = uncached_runner(loaded, PARAMS)
    asked = prompts(loaded)
    for chunk in (13, 64):
        engine = make_engine(loaded, max_step_tokens=chunk)
        for _ in range(2):  # the same prompt again is computed again (no snapshots yet), to the bit
            got = engine.generate([asked[0]], PARAMS)[0]
            assert got.num_cached_tokens == 0
            assert_identical_output(got, uncached(asked[0]))
        batch = [asked[1], asked[2], asked[2]]  # a batch of prompts of other lengths; one twice
        for got, prompt in zip(engine.generate(batch, PARAMS), batch, strict=True):
            assert_identical_output(got, uncached(prompt))
        assert_no_leaks(engine)
        engine.shutdown(10)


@needs_native
def test_preemption_and_8bit_kv_give_the_uncached_bits():
    loaded = served_file(folder(), "int8")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    asked = [chat_ids(loaded, f"Question {i}: which host failed job {i}?") for i in range(6)]
    roomy = make_engine(loaded, block_size=8).generate(asked, params)
    tight = make_engine(loaded, kv_cache_blocks=30, block_size=8)
    for got, want in zip(tight.generate(asked, params), roomy, strict=True):
        assert_identical_output(got, want)  # a preempted sequence starts its state again
    assert tight.scheduler.stats.preemptions > 0
    assert_no_leaks(tight)
    tight.shutdown(10)
    uncached = uncached_runner(loaded, PARAMS, kv_bits=8, kv_group_size=32)
    engine = make_engine(loaded, kv_bits=8, kv_group_size=32, max_step_tokens=64)
    prompt = prompts(loaded)[0]
    assert_identical_output(engine.generate([prompt], PARAMS)[0], uncached(prompt))
    engine.shutdown(10)


class FailingOnce(ModelRunner):
    """The real runner, whose first forward of a batch of two or more raises half-way through
    (after its first layers advanced the recurrent states)."""

    failed = False

    def run(self, plan: StepPlan) -> Any:
        if self.failed or len(plan.items) < 2:
            return super().run(plan)
        self.failed = True
        layers = self.lean.layers  # type: ignore[union-attr]
        last = layers[-1].down

        def fail(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("out of memory in the last layer")

        layers[-1].down = fail
        try:
            return super().run(plan)
        finally:
            layers[-1].down = last


def test_a_failed_step_fails_its_sequences_and_the_next_requests_are_exact():
    loaded = tiny()
    asked = prompts(loaded)
    engine = make_engine(loaded, max_step_tokens=64)
    engine.runner.__class__ = FailingOnce
    handles = [engine.submit(p, PARAMS) for p in asked[:2]]
    engine.run_until_idle()
    assert all(engine.collect(h).finish_reason == "error" for h in handles)
    assert_no_leaks(engine)
    uncached = uncached_runner(loaded, PARAMS)
    for got, prompt in zip(engine.generate(asked[:2], PARAMS), asked[:2], strict=True):
        assert got.token_ids == uncached(prompt).token_ids
    engine.shutdown(10)


def test_a_multimodal_folder_serves_its_text_model(tmp_path):
    """Qwen3.5 checkpoints are ``qwen3_5`` (a vision tower beside the text model, whose weights
    sit under ``model.language_model``): served as the text model, with the first token's
    logprobs of transformers' own multimodal class."""
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    tokenizer = embedded().tokenizer
    config = AutoConfig.for_model(
        "qwen3_5", text_config=dict(CONFIG, vocab_size=len(tokenizer), tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128))
    torch.manual_seed(3)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "vl")
    tokenizer.save_pretrained(tmp_path / "vl")
    loaded = served_file(tmp_path / "vl", "full")
    assert type(loaded.model).__name__ == "Qwen3_5ForCausalLM"
    prompt = prompts(loaded)[0]
    engine = make_engine(loaded)
    got = engine.generate([prompt], PARAMS)[0]
    engine.shutdown(10)
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert got.token_ids[0] == int(want.argmax())
    assert abs(got.logprobs[0] - float(want.max())) < 2e-4
