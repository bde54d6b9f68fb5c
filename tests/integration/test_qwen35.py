"""Hybrid Gated-DeltaNet models (``qwen3_5``: Qwen3.5, Qwen3.6; ``qwen3_5_moe``: their MoE
variants, routed experts and a gated shared expert): three linear-attention layers to one gated
full-attention layer.

kvcellar runs them through its own walk (``engine/lean_qwen35.py``): the attention layers over
the paged KV pool (which holds only them), the linear-attention layers a token at a time over
each sequence's recurrent state (``engine/deltanet.py``, in ``cache/state_pool.py``'s slots).
A cached prefix resumes from a snapshot of the state at a block boundary (where a prompt's
prefill ended, where a generation ended, every N blocks). Checked here: greedy tokens and
logprobs against transformers' own ``generate`` (which computes prompts in chunks); under the
native kernels, cached runs equal to the bit the uncached engine's (the same prompt again, a
batch holding one prompt twice, chunk sizes, the next turn of a conversation, a preempted
sequence resuming from its own snapshot, 8-bit KV); a chain whose last snapshot is gone resumes
from the one before, or from nothing; a model from a HF folder, multimodal included; every
state slot given back; a failed step keeps no checkpoint it half wrote, and a batch that fails
rolls its sequences back, fails only the one that fails alone and changes no other's bit."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.cache.state_pool import history_point
from kvcellar.engine import SamplingParams, native
from kvcellar.engine.blocking import collect
from kvcellar.engine.model_runner import ModelRunner
from kvcellar.engine.scheduler import StepPlan
from kvcellar.engine.tokenization import generation_prompt_ids
from kvcellar.errors import ModelLoadError
from tests._models import (
    QWEN35,
    QWEN35_MOE,
    assert_generates_like_reference,
    assert_identical_output,
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    make_engine,
    needs_native,
    qwen35_source,
    reference_greedy,
    served_file,
    tiny_model,
    uncached_runner,
)

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True)
SYSTEM = "You keep a build farm running. Answer with the host name and the command. " * 6
QUESTIONS = ("Which host runs the nightly build?", "How do I restart the runner on ci-3?",
             "Why did the cache volume fill up?")
CONFIG = QWEN35  # four layers: linear, linear, linear, full attention
MOE = QWEN35_MOE  # the MoE variant (Qwen3.5-35B-A3B, Qwen3.6's): routed experts and a gated shared expert


@functools.cache
def tiny(family: str = "dense") -> Any:
    if family == "moe":
        return tiny_model("qwen3_5_moe_text", embedded().tokenizer, **CONFIG, **MOE)
    return tiny_model("qwen3_5_text", embedded().tokenizer, **CONFIG)


@functools.cache
def folder(family: str = "dense") -> Path:
    """``tiny(family)``'s model written as a HF folder (safetensors, config, the embedded tokenizer)."""
    path = Path(tempfile.mkdtemp(prefix="kvcellar-test-qwen35-")) / f"tiny-qwen3_5-{family}"
    atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
    loaded = tiny(family)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


def prompts(loaded: Any) -> list[list[int]]:
    return [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS]


@pytest.mark.parametrize(("family", "chunk"), [("dense", 512), ("dense", 7), ("dense", 64), ("moe", 13)])
def test_the_engine_generates_what_transformers_generates(family, chunk):
    loaded = tiny(family)
    prompt = prompts(loaded)[0]
    assert len(prompt) > 100
    assert_generates_like_reference(loaded.model, loaded, prompt, PARAMS, chunk=chunk)


def test_the_pool_holds_only_the_attention_layers_and_two_states_per_sequence():
    engine = make_engine(tiny(), max_num_seqs=3, state_snapshots=5)
    assert engine.layout.num_layers == 1
    states = engine.scheduler.cache.states
    assert states is not None and states.slots == 2 * 3 + 5 and states.layout.num_layers == 3
    assert states.layout.heads == 4 and states.layout.conv_channels == 2 * 64 + 128
    results = engine.generate(prompts(tiny()) * 2, PARAMS)  # six sequences, three at a time
    assert len(results) == 6 and results[0].token_ids == results[3].token_ids
    assert states.stats.snapshots <= 5
    assert_no_leaks(engine)
    engine.shutdown(10)


def test_a_model_without_an_attention_layer_is_refused_by_name():
    config = {**CONFIG, "layer_types": ["linear_attention"] * 4}
    linear_only = tiny_model("qwen3_5_text", embedded().tokenizer, **config)
    with pytest.raises(ModelLoadError, match="all linear attention"):
        make_engine(linear_only)


def resumable(prompt_tokens: int, block_size: int = 16) -> int:
    """Tokens a prompt seen before resumes after: its last block boundary before its last token."""
    return (prompt_tokens - 1) // block_size * block_size


@needs_native
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_every_step_shape_and_hit_gives_the_uncached_bits(family, weights):
    loaded = served_file(folder(family), weights)
    model_class = "Qwen3_5MoeForCausalLM" if family == "moe" else "Qwen3_5ForCausalLM"
    assert loaded.weights == weights and type(loaded.model).__name__ == model_class
    uncached = uncached_runner(loaded, PARAMS)
    asked = prompts(loaded)
    for chunk in (13, 64):
        engine = make_engine(loaded, max_step_tokens=chunk)
        cold = engine.generate([asked[0]], PARAMS)[0]
        assert cold.num_cached_tokens == 0
        assert_identical_output(cold, uncached(asked[0]))
        again = engine.generate([asked[0]], PARAMS)[0]  # from the snapshot where its prefill ended
        assert again.num_cached_tokens == resumable(len(asked[0]))
        assert_identical_output(again, uncached(asked[0]))
        batch = [asked[1], asked[2], asked[2]]  # the shared system prompt's blocks; one prompt twice
        results = engine.generate(batch, PARAMS)
        for got, prompt in zip(results, batch, strict=True):
            assert_identical_output(got, uncached(prompt))
        assert results[2].num_cached_tokens == resumable(len(asked[2]))
        assert_no_leaks(engine)
        engine.shutdown(10)


@needs_native
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_bf16_activations_give_the_uncached_bits(family):
    """What a CPU with AVX-512 BF16 or AMX serves (``--dtype auto``: bf16 activations, int4
    linears): the norms, the MLPs' silu and the gated norm on the kernels, cold, from a snapshot
    and in a batch, give the uncached engine's bits at every chunk size."""
    loaded = served_file(folder(family), "int4", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    uncached = uncached_runner(loaded, PARAMS)
    asked = prompts(loaded)
    for chunk in (13, 64):
        engine = make_engine(loaded, max_step_tokens=chunk)
        assert engine.descriptor.get("recurrence") == native.RECURRENCE
        cold = engine.generate([asked[0]], PARAMS)[0]
        assert_identical_output(cold, uncached(asked[0]))
        again = engine.generate([asked[0]], PARAMS)[0]
        assert again.num_cached_tokens == resumable(len(asked[0]))
        assert_identical_output(again, uncached(asked[0]))
        batch = engine.generate([asked[1], asked[2]], PARAMS)
        for got, prompt in zip(batch, asked[1:], strict=True):
            assert_identical_output(got, uncached(prompt))
        assert_no_leaks(engine)
        engine.shutdown(10)


@needs_native
def test_the_walks_norms_and_silu_on_the_kernels_are_transformers_within_rounding():
    """The hybrid walk's zero-centred RMS norms (hidden states and per head), its MLP's silu and
    the linear-attention layer's gated norm on the kernels against transformers' own modules, in
    float32 and bf16 (to float rounding: the kernels sum in their own order)."""
    from kvcellar.engine.lean_qwen35 import qwen35_forward_for

    model = tiny().model
    walk = qwen35_forward_for(model)
    assert walk is not None
    layer, delta = model.model.layers[0], model.model.layers[0].linear_attn
    attention = next(i for i, lyr in enumerate(model.model.layers) if hasattr(lyr, "self_attn"))
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, model.config.hidden_size, generator=gen) * 3
    heads = torch.randn(7, 4, model.model.layers[attention].self_attn.head_dim, generator=gen) * 3
    gate = torch.randn(7, model.config.intermediate_size, generator=gen) * 4
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        pairs = [(walk.layers[0].input_norm, layer.input_layernorm, hidden), (walk.norm, model.model.norm, hidden),
                 (walk.layers[attention].mixer.q_norm, model.model.layers[attention].self_attn.q_norm, heads),
                 (walk.layers[0].mlp.act, layer.mlp.act_fn, gate)]
        for ours, theirs, x in pairs:
            x = x.to(dtype)
            got, want = ours(x), theirs(x)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        core = torch.randn(7, delta.num_v_heads, delta.head_v_dim, generator=gen)
        z = torch.randn(7, delta.num_v_heads, delta.head_v_dim, generator=gen).to(dtype)
        got = native.gated_norm(core, z, delta.norm.weight, float(delta.norm.variance_epsilon)).to(dtype)
        want = delta.norm(core.to(dtype), z).reshape(7, -1)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_native
def test_torchs_recurrence_where_the_kernel_does_not_run(monkeypatch):
    """The path CUDA takes (the gated delta rule in torch, ``deltanet.GatedDeltaNet._torch_rule``):
    cached equals uncached to the bit there too, and its numbers are the kernel's within float32
    rounding (the kernel fuses multiply-adds; compared on float32 weights, where no activation
    is quantized to 8 bits to amplify that rounding)."""
    dense = tiny()
    by_kernel = uncached_runner(dense, PARAMS)(prompts(dense)[0])
    loaded = served_file(folder(), "int8")
    asked = prompts(loaded)
    monkeypatch.setattr(native, "runs_gated_delta", lambda device, value_dim: False)
    assert_same_output(uncached_runner(dense, PARAMS)(prompts(dense)[0]), by_kernel, tol=1e-4)
    uncached = uncached_runner(loaded, PARAMS)
    engine = make_engine(loaded, max_step_tokens=13)
    assert engine.descriptor.get("recurrence") is None  # another namespace than the kernel's blocks
    for _ in range(2):  # cold, then from the snapshot
        assert_identical_output(engine.generate([asked[0]], PARAMS)[0], uncached(asked[0]))
    batch = engine.generate([asked[1], asked[1]], PARAMS)
    assert_identical_output(batch[1], uncached(asked[1]))
    engine.shutdown(10)


@needs_native
def test_the_next_turn_resumes_where_the_reply_ended():
    loaded = served_file(folder(), "int8")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    uncached = uncached_runner(loaded, params)
    engine = make_engine(loaded, max_step_tokens=64)
    first = prompts(loaded)[0]
    reply = engine.generate([first], params)[0]
    computed = len(first) + len(reply.token_ids) - 1  # the last sampled token is never fed
    turn = first + reply.token_ids + chat_ids(loaded, "And the one after it?")[1:]
    got = engine.generate([turn], params)[0]
    assert got.num_cached_tokens == computed // 16 * 16 > len(first)
    assert_identical_output(got, uncached(turn))
    stats = engine.scheduler.cache.states.stats
    assert stats.snapshots_loaded == 1 and stats.resume_distance_tokens == 0
    engine.shutdown(10)


def across_a_boundary(loaded: Any, question: str, system: str = SYSTEM) -> tuple[list[int], int]:
    """A chat prompt (``system`` and ``question``, padded) whose generation prompt crosses a block
    boundary, and its tokens before that generation prompt."""
    suffix = generation_prompt_ids(loaded.tokenizer)
    assert suffix  # <|im_start|>assistant\n
    for pad in range(32):
        prompt = chat_ids(loaded, question + " x" * pad, system)
        if history_point(len(prompt) - len(suffix), len(prompt), 16) is not None:
            return prompt, len(prompt) - len(suffix)
    raise AssertionError("no padding put the generation prompt across a block boundary")


@needs_native
@pytest.mark.parametrize("chunk", [512, 48])  # 48: a step ends on that boundary (its checkpoint is copied)
def test_the_next_turn_resumes_where_the_messages_ended_when_the_reply_renders_otherwise(chunk):
    """The conversation's next prompt repeats this one's messages but not its generation prompt
    (templates drop an empty or old reasoning block from the reply they render back): the snapshot
    kept at the last boundary before the generation prompt is where it resumes."""
    loaded = served_file(folder(), "int8")
    uncached = uncached_runner(loaded, PARAMS)
    prompt, history = across_a_boundary(loaded, "Which host?")
    engine = make_engine(loaded, max_step_tokens=chunk)
    engine.submit(prompt, PARAMS, history_tokens=history)
    engine.run_until_idle()
    states = engine.scheduler.cache.states
    # where the messages end, and where the prompt's prefill (and the short generation) ended
    assert sorted(snap.tokens for snap in states._stored.values()) == [history // 16 * 16, resumable(len(prompt))]
    turn = prompt[:history] + chat_ids(loaded, "And the one after it?")[1:]  # the reply rendered as nothing
    got = engine.generate([turn], PARAMS)[0]
    assert got.num_cached_tokens == history // 16 * 16
    assert_identical_output(got, uncached(turn))
    assert_no_leaks(engine)
    engine.shutdown(10)


def test_snapshots_where_messages_end_take_no_slot_a_sequence_needs():
    """Three sequences at once (no prefix in common: none waits for another's), each with a
    history point, on a pool of two slots a sequence and one snapshot: none is refused a slot."""
    loaded = tiny()
    engine = make_engine(loaded, max_num_seqs=3, state_snapshots=1)
    asked = [across_a_boundary(loaded, "Which host runs it?", f"Build farm {i}. " + SYSTEM) for i in range(3)]
    handles = [engine.submit(prompt, PARAMS, history_tokens=history) for prompt, history in asked]
    results = [collect(engine, h) for h in handles]
    assert [r.error for r in results] == [None] * 3 and all(len(r.token_ids) == 10 for r in results)
    assert engine.scheduler.cache.states.stats.snapshots_stored >= 4  # each prompt's end, a history point
    assert_no_leaks(engine)
    engine.shutdown(10)


@needs_native
def test_a_chain_without_its_last_snapshot_resumes_from_the_one_before():
    loaded = served_file(folder(), "int8")
    uncached = uncached_runner(loaded, PARAMS)
    prompt = prompts(loaded)[0]
    engine = make_engine(loaded, max_step_tokens=48, snapshot_every_blocks=2, state_snapshots=2)
    assert len(prompt) > 3 * 32
    engine.generate([prompt], PARAMS)
    states = engine.scheduler.cache.states
    assert states.stats.snapshots == 2  # the end of the prompt's prefill and the end of the generation
    engine.generate([chat_ids(loaded, "Something else entirely.")], PARAMS)  # evicts both
    got = engine.generate([prompt], PARAMS)[0]
    assert got.num_cached_tokens == 0 and states.stats.snapshots_missed == 1
    assert_identical_output(got, uncached(prompt))
    # now with a snapshot every 2 blocks kept (the prompt's prefill crossed 32-token boundaries
    # in 48-token steps) and the last one dropped
    engine = make_engine(loaded, max_step_tokens=48, snapshot_every_blocks=2, state_snapshots=16)
    engine.generate([prompt], PARAMS)
    states = engine.scheduler.cache.states
    kept = sorted(snap.tokens for snap in states._stored.values())
    last = max(t for t in kept if t <= resumable(len(prompt)))
    for key, snap in list(states._stored.items()):
        if snap.tokens >= last:
            del states._stored[key]
            states.release(snap.slot)
    got = engine.generate([prompt], PARAMS)[0]
    earlier = max(t for t in kept if t < last)
    assert got.num_cached_tokens == earlier
    assert states.stats.resume_distance_tokens == resumable(len(prompt)) - earlier
    assert_identical_output(got, uncached(prompt))
    assert_no_leaks(engine)
    engine.shutdown(10)


@needs_native
def test_without_a_tier_below_ram_a_snapshot_goes_with_the_block_it_ends():
    loaded = served_file(folder(), "int8")
    uncached = uncached_runner(loaded, PARAMS)
    prompt, other = prompts(loaded)[0], chat_ids(loaded, "Something else entirely. " * 12)
    blocks = -(-(max(len(prompt), len(other)) + PARAMS.max_tokens) // 16)
    engine = make_engine(loaded, kv_cache_blocks=blocks + 1, max_step_tokens=64, state_snapshots=8)
    engine.generate([prompt], PARAMS)
    states = engine.scheduler.cache.states
    assert states.stats.snapshots == 2  # the end of the prompt's prefill and the end of the generation
    engine.generate([other], PARAMS)  # takes every block: the first prompt's are dropped
    assert states.stats.snapshots_unreachable == 2 and states.stats.snapshots_evicted == 0
    assert states.stats.snapshots == 2  # the other prompt's own, in slots that are not wasted
    got = engine.generate([prompt], PARAMS)[0]
    assert got.num_cached_tokens == 0
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
        assert_identical_output(got, want)  # a preempted sequence resumes from its own snapshot
    assert tight.scheduler.stats.preemptions > 0
    assert tight.scheduler.cache.states.stats.snapshots_loaded > 0
    assert_no_leaks(tight)
    tight.shutdown(10)
    uncached = uncached_runner(loaded, PARAMS, kv_bits=8, kv_group_size=32)
    engine = make_engine(loaded, kv_bits=8, kv_group_size=32, max_step_tokens=64)
    prompt = prompts(loaded)[0]
    for _ in range(2):  # cold, then from the snapshot over 8-bit blocks
        assert_identical_output(engine.generate([prompt], PARAMS)[0], uncached(prompt))
    engine.shutdown(10)


def failing_in_the_last_layer(runner: ModelRunner, plan: StepPlan) -> Any:
    """``runner``'s real forward of ``plan``, raising in the last layer's MLP: after every
    linear-attention layer advanced its sequences' states (and wrote any checkpoint)."""
    mlp = runner.lean.layers[-1].mlp  # type: ignore[union-attr]
    down = mlp.down

    def fail(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory in the last layer")

    mlp.down = fail
    try:
        return ModelRunner.run(runner, plan)
    finally:
        mlp.down = down


class FailingOnce(ModelRunner):
    """The real runner, whose first forward of a sequence's second prefill chunk raises half-way
    through: after its linear-attention layers advanced the state and wrote the chunk's block
    boundary into the checkpoint, which held the first chunk's boundary."""

    failed = False

    def run(self, plan: StepPlan) -> Any:
        if self.failed or not any(item.start > 0 for item in plan.items):
            return super().run(plan)
        self.failed = True
        return failing_in_the_last_layer(self, plan)


def test_a_failed_step_fails_its_sequences_and_keeps_no_checkpoint_it_wrote():
    loaded = tiny()
    prompt = prompts(loaded)[0]
    engine = make_engine(loaded, max_step_tokens=40)
    engine.runner.__class__ = FailingOnce
    handle = engine.submit(prompt, PARAMS)
    engine.run_until_idle()
    assert engine.collect(handle).finish_reason == "error"
    states = engine.scheduler.cache.states
    assert states.stats.snapshots == 0  # the checkpoint after 32 tokens was half overwritten
    assert_no_leaks(engine)
    got = engine.generate([prompt], PARAMS)[0]
    assert got.num_cached_tokens == 0
    assert got.token_ids == uncached_runner(loaded, PARAMS)(prompt).token_ids
    engine.shutdown(10)


class FailingBatches(ModelRunner):
    """The real runner, whose forward raises in the last layer (after every linear-attention layer
    advanced its sequences' states) for a step holding the ``poison`` prompt's sequence, and
    once for the first step that decodes ``fail_once_decodes`` sequences or more."""

    poison: list[int] | None = None
    fail_once_decodes = 0

    def run(self, plan: StepPlan) -> Any:
        poisoned = any(item.seq.token_ids[:item.seq.num_prompt_tokens] == self.poison for item in plan.items)
        once = 0 < self.fail_once_decodes <= len(plan.decodes)
        if not poisoned and not once:
            return super().run(plan)
        if once:
            self.fail_once_decodes = 0
        return failing_in_the_last_layer(self, plan)


@needs_native
def test_a_batch_failing_for_one_sequence_fails_it_alone_and_the_others_give_the_uncached_bits():
    """The three prompts prefill in one step, which fails for the second: each is rolled back (its
    state half-advanced) and runs alone up to where that step would have taken it; the second
    fails by itself, the others go on, batched, to the uncached engine's bits (int4: the row
    kernel's bits whatever the batch)."""
    loaded = served_file(folder(), "int4")
    asked = prompts(loaded)
    engine = make_engine(loaded, max_step_tokens=512)
    engine.runner.__class__ = FailingBatches
    engine.runner.poison = asked[1]
    handles = [engine.submit(p, PARAMS) for p in asked]
    engine.run_until_idle()
    got = [engine.collect(h) for h in handles]
    assert [g.finish_reason == "error" for g in got] == [False, True, False]
    uncached = uncached_runner(loaded, PARAMS)
    for i in (0, 2):
        assert_identical_output(got[i], uncached(asked[i]))
    assert engine.scheduler.stats.preemptions == 3 and not engine._suspects
    assert_no_leaks(engine)
    engine.shutdown(10)


@needs_native
def test_a_batch_failing_once_mid_decode_loses_no_sequence_and_changes_no_bit():
    """A decode step of three sequences fails once, after their states advanced: all three are
    rolled back to their last snapshots, computed again alone past that step, and finish with
    the uncached engine's tokens and logprobs."""
    loaded = served_file(folder(), "int4")
    asked = prompts(loaded)
    engine = make_engine(loaded, max_step_tokens=512)
    engine.runner.__class__ = FailingBatches
    engine.runner.fail_once_decodes = 3
    got = engine.generate(asked, PARAMS)
    assert engine.runner.fail_once_decodes == 0 and engine.stats.step_failures == 1
    uncached = uncached_runner(loaded, PARAMS)
    for prompt, result in zip(asked, got, strict=True):
        assert_identical_output(result, uncached(prompt))
    assert engine.scheduler.stats.preemptions == 3 and not engine._suspects
    assert_no_leaks(engine)
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


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_a_gguf_as_llama_cpp_writes_it_serves_what_transformers_runs(family, tmp_path):
    """llama.cpp's ``qwen35``/``qwen35moe`` files (``write_qwen35_gguf``: its names, ``w + 1``
    norms, ``-exp(A_log)``, the squeezed convolution, value heads tiled), converted a tensor at a
    time: served with the greedy tokens and logprobs of the transformers model they were written
    from (an F32 file); a Q8_0 file, under ``--weights auto`` (its int8 on kvcellar's kernels),
    gives the uncached bits on a hit."""
    from tests.artifacts.gguf_files import write_qwen35_gguf

    model = qwen35_source(family)
    path = write_qwen35_gguf(tmp_path / f"tiny-{family}.gguf", model)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    loaded = served_file(path, "full")
    assert type(loaded.model).__name__ == type(model).__name__
    engine = make_engine(loaded, max_step_tokens=16)
    got = engine.generate([prompt], params)[0]
    engine.shutdown(10)
    tokens, logprobs = reference_greedy(model, prompt, 8)
    assert got.token_ids == tokens
    assert torch.allclose(torch.tensor(got.logprobs), logprobs[torch.arange(8), torch.tensor(tokens)], atol=2e-4)
    if not native.available():
        return  # the rest is about kvcellar's kernels
    (tmp_path / "q8").mkdir()
    served = served_file(write_qwen35_gguf(tmp_path / "q8" / f"tiny-{family}.gguf", model, quantized=True), "auto")
    assert served.weights == "int8"
    engine = make_engine(served, max_step_tokens=16)
    cold, hit = (engine.generate([prompt], params)[0] for _ in range(2))
    assert hit.num_cached_tokens == resumable(len(prompt)) and cold.token_ids == hit.token_ids
    assert_identical_output(hit, uncached_runner(served, params)(prompt))
    engine.shutdown(10)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_a_gguf_streams_the_values_transformers_loads_whole(family, tmp_path):
    """The file converted a tensor at a time (``gguf_convert.qwen35_processor``) holds, bit for
    bit, what transformers' own conversion of it loads whole (its dense entry, and every linear
    quantized under int8 and int4), a multi-token-prediction block left out unread."""
    from transformers import AutoModelForCausalLM

    from kvcellar.artifacts import gguf_convert, prepare
    from kvcellar.engine.experts import split_experts
    from kvcellar.quantization import quantize_linears
    from tests.artifacts.gguf_files import write_qwen35_gguf

    path = write_qwen35_gguf(tmp_path / f"tiny-{family}.gguf", qwen35_source(family), quantized=True, mtp=True)
    with gguf_convert.GgufFile(path) as source:  # streamed: no NotStreamable
        assert any(name.startswith("blk.4.") for name in source.unmapped)
    (tmp_path / "entry").mkdir()
    prepare.gguf_builder(path, torch.float32, name="streamed", progress=False)(tmp_path / "entry")
    entry = AutoModelForCausalLM.from_pretrained(str(tmp_path / "entry"), dtype=torch.float32).state_dict()
    whole = prepare._load_gguf(path, torch.float32).state_dict()
    assert sorted(entry) == sorted(whole)
    for key, value in whole.items():
        assert torch.equal(entry[key], value), key
    for mode in ("int8", "int4"):
        streamed = prepare.quantize_gguf(path, mode)
        whole = prepare._load_gguf(path, torch.float32)
        split_experts(whole)  # the experts as the linears kvcellar runs
        expected = quantize_linears(whole, mode)
        assert sorted(streamed) == sorted(expected)
        for key, q in expected.items():
            assert torch.equal(streamed[key].dequantize(torch.float32), q.dequantize(torch.float32)), (mode, key)


def test_the_memory_plan_counts_every_state_slot():
    from kvcellar.cache.state_pool import StateLayout
    from kvcellar.engine.memory import plan_memory
    from kvcellar.model_source import ModelSource

    per_slot = StateLayout.from_model_config(tiny().model.config).bytes_per_slot
    assert per_slot == 3 * (256 * 3 + 4 * 32 * 32) * 4  # three linear-attention layers, float32
    plan = plan_memory(ModelSource("hf_dir", folder(), "tiny"), "full", torch.float32, 1 << 20, state_slots=2 * 32 + 32)
    assert plan.state_pool_bytes == 96 * per_slot
    assert plan.total_bytes == plan.weights_bytes + (1 << 20) + 96 * per_slot + plan.overhead_bytes
    assert "recurrent states" in plan.describe()
    # what a server plans: live and checkpoint slots, snapshots, and a slot per sequence a step's
    # drafts may verify (the state before each)
    from kvcellar.engine.config import STEP_HYBRID_VERIFIES, EngineConfig
    from kvcellar.runtime import memory_plan
    from kvcellar.settings import Settings

    for speculative, verifying in (("auto", STEP_HYBRID_VERIFIES), ("off", 0)):
        settings = Settings(model=str(folder()), engine=EngineConfig(speculative=speculative, weights="full"))
        slots = 2 * settings.engine.max_num_seqs + settings.engine.state_snapshots + verifying
        assert memory_plan(settings).state_pool_bytes == slots * per_slot
