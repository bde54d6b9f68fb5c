"""The engine's greedy output equals transformers' own, alone, batched, chunked and joined mid-decode."""

from __future__ import annotations

import pytest
import torch

from kvcellar.engine import SamplingParams
from tests._models import chat_ids, make_engine, reference_greedy, tiny_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your work.",
    "Give me a name for a grey cat.",
    "Why is the sky blue? Answer briefly, in two sentences at most, for a child of ten.",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, top_logprobs=5)
LOGPROB_TOL = 2e-4  # fp32; measured differences are ~1e-5


def assert_matches_reference(result, ref_tokens, ref_logprobs):
    n = len(result.token_ids)
    assert result.token_ids == ref_tokens[:n]
    assert n == len(ref_tokens) or result.finish_reason == "stop"
    for step, top in enumerate(result.top_logprobs):
        for token_id, logprob in top:
            assert abs(logprob - float(ref_logprobs[step, token_id])) < LOGPROB_TOL, (step, token_id)


def test_greedy_matches_transformers_generate(model):
    engine = make_engine(model)
    prompts = [chat_ids(model, p) for p in PROMPTS[:4]]
    for prompt in prompts:
        (result,) = engine.generate([prompt], GREEDY)
        ref_tokens, ref_logprobs = reference_greedy(model.model, prompt, GREEDY.max_tokens)
        assert_matches_reference(result, ref_tokens, ref_logprobs)


@pytest.fixture(scope="module")
def alone(model):
    """Each of ``PROMPTS`` generated alone, by an engine of its own."""
    return [make_engine(model, prefix_caching=False).generate([chat_ids(model, p)], GREEDY)[0] for p in PROMPTS]


def test_batch_of_eight_equals_each_alone(model, alone):
    prompts = [chat_ids(model, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) >= 6, "the prompts should have different lengths"
    batched = make_engine(model, prefix_caching=False).generate(prompts, GREEDY)
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_TOL)


def test_requests_joining_mid_decode_do_not_change_others(model, alone):
    prompts = [chat_ids(model, p) for p in PROMPTS]
    engine = make_engine(model)

    first = [engine.submit(p, GREEDY) for p in prompts[:4]]
    for _ in range(6):  # the first four are prefilled and decoding
        engine.step()
    assert all(s.state.value == "running" for s in engine.scheduler.running)
    assert len(engine.scheduler.running) == 4
    late = [engine.submit(p, GREEDY) for p in prompts[4:]]
    engine.run_until_idle()
    for i, handle in enumerate(first + late):
        assert engine.collect(handle).token_ids == alone[i].token_ids


def test_chunked_prefill_equals_unchunked(model):
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    prompt = chat_ids(model, "Summarise this list in one sentence:\n" + text)
    assert len(prompt) > 500
    whole = make_engine(model, max_step_tokens=4096).generate([prompt], GREEDY)[0]
    chunked_engine = make_engine(model, max_step_tokens=64)
    chunked = chunked_engine.generate([prompt], GREEDY)[0]
    assert chunked_engine.stats.steps >= len(prompt) // 64
    assert whole.token_ids == chunked.token_ids
    assert torch.allclose(torch.tensor(whole.logprobs), torch.tensor(chunked.logprobs), atol=LOGPROB_TOL)
    ref_tokens, ref_logprobs = reference_greedy(model.model, prompt, GREEDY.max_tokens)
    assert_matches_reference(chunked, ref_tokens, ref_logprobs)


def test_larger_prefill_chunks_only_while_nothing_decodes(model):
    """With no sequence decoding a step may take max_prefill_step_tokens of prompt; once one
    decodes, the budget falls back to max_step_tokens. Outputs are the same either way."""
    tiny = tiny_model("llama", model.tokenizer)
    text = " ".join(f"line {i}: red green blue" for i in range(40))
    long_prompt = chat_ids(model, text)
    short_prompt = chat_ids(model, "Hi")
    n = len(long_prompt)
    assert n > 256
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reference = {len(p): reference_greedy(tiny.model, p, params.max_tokens)[0] for p in (long_prompt, short_prompt)}

    alone = make_engine(tiny, max_step_tokens=32, max_prefill_step_tokens=128)
    result = alone.generate([long_prompt], params)[0]
    assert result.token_ids == reference[n]
    prefill_steps = -(-n // 128)
    assert alone.stats.steps == prefill_steps + params.max_tokens - 1

    # The short prompt decodes from step 2 on: the long one continues 32 tokens at a time.
    mixed = make_engine(tiny, max_step_tokens=32, max_prefill_step_tokens=128)
    both = mixed.generate([short_prompt, long_prompt], params)
    assert [r.token_ids for r in both] == [reference[len(short_prompt)], reference[n]]
    first_step = 128 - len(short_prompt)
    assert mixed.stats.steps >= 1 + (n - first_step) // 32


def test_unaligned_chunks_and_odd_block_size(model):
    """Chunk boundaries that fall inside blocks, and a block size that is not a power of two."""
    prompt = chat_ids(model, "Count from one to twenty in words, separated by commas.")
    ref_tokens, ref_logprobs = reference_greedy(model.model, prompt, GREEDY.max_tokens)
    engine = make_engine(model, block_size=7, max_step_tokens=13)
    assert_matches_reference(engine.generate([prompt], GREEDY)[0], ref_tokens, ref_logprobs)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("qwen3", {"use_sliding_window": False}),  # qk-norm, GQA 8:2
        ("mistral", {"sliding_window": 24}),  # sliding-window attention shorter than the prompt
        ("llama", {"num_key_value_heads": 8}),  # plain multi-head attention
    ],
)
def test_other_architectures_match_transformers(model, arch, extra):
    tiny = tiny_model(arch, model.tokenizer, **extra)
    prompts = [chat_ids(model, p) for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True)
    engine = make_engine(tiny, max_step_tokens=32, block_size=8)
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        ref_tokens, ref_logprobs = reference_greedy(tiny.model, prompt, params.max_tokens)
        assert_matches_reference(result, ref_tokens, ref_logprobs)


def test_attention_outputs_in_another_memory_layout_give_the_same_tokens(model, monkeypatch):
    """CUDA's attention kernels may return their output [B, H, T, D] stored as [B, T, H, D]
    (not contiguous), which the CPU kernels never do: every attention path (short prompts
    fold GQA heads into query rows) must read it by shape, not by memory order."""
    engine = make_engine(model)
    prompt = chat_ids(model, PROMPTS[0])
    (expected,) = engine.generate([prompt], GREEDY)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed_layout)
    fresh = make_engine(model)
    (result,) = fresh.generate([prompt], GREEDY)
    (hit,) = fresh.generate([prompt], GREEDY)  # the tail after a prefix hit: the folded path again
    assert result.finish_reason == expected.finish_reason and result.token_ids == expected.token_ids
    assert hit.num_cached_tokens > 0 and hit.token_ids == expected.token_ids


def _resident_pages(tensor: torch.Tensor) -> list[bool]:
    """Which 4 KB pages of ``tensor``'s memory are in RAM (mincore(2))."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def test_an_idle_engine_faults_in_the_blocks_it_hands_out_next(model, alone):
    """An idle engine thread writes the pages of the free blocks it allocates next, a few at a
    time, so that a step does not fault them in: they are in RAM after, the rest of the pool is
    not, the null block still reads as zeros, and generation gives the tokens it gave before."""
    from kvcellar.engine.engine import TOUCH_AHEAD_BYTES

    engine = make_engine(model, prefix_caching=False, kv_cache_gb=0.5)
    ahead = [b.block_id for b in engine.blocks.free_front(TOUCH_AHEAD_BYTES // engine.layout.bytes_per_block)]
    assert 0 < len(ahead) < engine.blocks.num_free
    data = engine.pool.data
    assert not any(_resident_pages(data[ahead[-1]])), "a fresh pool's blocks are not in RAM yet"
    while engine._touch_ahead():  # what the engine thread does while it waits for work
        pass
    assert all(all(_resident_pages(data[b])) for b in ahead)
    last = engine.blocks.free_front(engine.blocks.num_free)[-1].block_id  # far from them (2 MB pages)
    assert not any(_resident_pages(data[last]))
    assert not data[0].view(torch.uint8).any()
    (result,) = engine.generate([chat_ids(model, PROMPTS[0])], GREEDY)
    assert result.token_ids == alone[0].token_ids
