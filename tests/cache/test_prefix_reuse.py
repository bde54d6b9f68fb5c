"""Prefix hits change nothing: cached runs equal cache-disabled runs, and blocks never leak.

On the stand-in model (a small random-weight Llama with the real tokenizer): which blocks
are reused is the same for any model, and a wrong one moves the logprobs as surely. The
multi-turn test re-encodes a reply's text, so it runs on the embedded model, whose replies
are text that encodes back to the same tokens; the embedded model's prefix paths are also
checked in tests/engine (lean forward, quantized weights, quantized KV)."""

from __future__ import annotations

import random

import pytest
import torch

from kvcellar.engine import SamplingParams
from kvcellar.engine.tokenization import shared_prefix_len
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from tests._models import (
    LOGPROB_TOL,
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    stand_in,
    tiny_model,
    uncached_runner,
)

BS = 16
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, top_logprobs=3)
SYSTEM = (
    "You are a meticulous assistant for a software team. Answer precisely, cite the relevant "
    "function names, keep answers short, and never invent APIs that do not exist. "
    "The project is a Python web service with a PostgreSQL database and a Redis cache."
)


@pytest.fixture(scope="module")
def model():
    return stand_in()


def expected_hit(prompt_len: int, common: int, computed: int | None = None) -> int:
    return expected_cached(prompt_len, common, computed, BS)




def test_full_prefix_hit(model, uncached):
    engine = make_engine(model)
    prompt = chat_ids(model, "Which HTTP status code means 'not found'?", SYSTEM)
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == expected_hit(len(prompt), len(prompt))
    assert second.num_cached_tokens >= len(prompt) - BS + 1
    assert_same_output(first, uncached(prompt))
    assert_same_output(second, uncached(prompt))
    assert_no_leaks(engine)


def test_block_aligned_prompt_still_computes_last_token(model, uncached):
    """A fully cached, block-aligned prompt: the last block is copied and only its last
    token recomputed (the shared block is never written); outputs are unchanged."""
    engine = make_engine(model)
    prompt = chat_ids(model, "Say hello.", SYSTEM)
    prompt = prompt[: (len(prompt) // BS) * BS]  # exactly whole blocks
    first = engine.generate([prompt], GREEDY)[0]
    computed_before = engine.stats.computed_tokens
    ram_before = engine.blocks.stats.hit_tokens
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == len(prompt) - 1
    assert engine.blocks.stats.hit_tokens - ram_before == len(prompt) - 1  # RAM's count: what was reused
    # one prompt token plus one per generated token after the first
    assert engine.stats.computed_tokens - computed_before == 1 + len(again.token_ids) - 1
    third = engine.generate([prompt], GREEDY)[0]  # the shared block still holds the original KV
    assert third.num_cached_tokens == len(prompt) - 1
    for r in (first, again, third):
        assert_same_output(r, uncached(prompt))
    assert_no_leaks(engine)


def test_partial_prefix_shared_system_prompt(model, uncached):
    engine = make_engine(model)
    a = chat_ids(model, "How do I add an index to a table?", SYSTEM)
    b = chat_ids(model, "What does a Redis TTL do?", SYSTEM)
    engine.generate([a], GREEDY)
    result = engine.generate([b], GREEDY)[0]
    assert result.num_cached_tokens == expected_hit(len(b), shared_prefix_len(a, b))
    assert result.num_cached_tokens >= 32
    assert_same_output(result, uncached(b))


def test_multi_turn_reuses_previous_reply():
    model = embedded("float32")
    uncached = uncached_runner(model, GREEDY)
    engine = make_engine(model)
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Name two Python web frameworks."}]
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True)
    prompt1 = chat_ids(model, turn1[1]["content"], SYSTEM)
    reply = engine.generate([prompt1], params)[0]
    from kvcellar.engine.tokenization import encode_chat

    turn2 = [*turn1, {"role": "assistant", "content": reply.text},
             {"role": "user", "content": "Which of them is older?"}]
    prompt2 = encode_chat(model.tokenizer, turn2)
    history = prompt1 + reply.token_ids
    computed = len(history) - 1  # the last generated token is never fed back
    result = engine.generate([prompt2], GREEDY)[0]
    expect = expected_hit(len(prompt2), shared_prefix_len(history, prompt2), computed)
    assert expect > (len(prompt1) // BS) * BS, "turn 2 must reuse blocks of turn 1's reply"
    assert result.num_cached_tokens == expect
    assert_same_output(result, uncached(prompt2))


def test_concurrent_requests_sharing_a_prefix(model, uncached):
    engine = make_engine(model)
    questions = ["What is a foreign key?", "What is a cache stampede?", "What is WAL mode?",
                 "What is a connection pool?"]
    prompts = [chat_ids(model, q, SYSTEM) for q in questions]
    results = engine.generate(prompts, GREEDY)  # all submitted before the first step
    for prompt, result in zip(prompts, results, strict=True):
        assert_same_output(result, uncached(prompt))
    shared = expected_hit(min(map(len, prompts)), shared_prefix_len(prompts[0], prompts[1]))
    # the first computes the shared blocks; the others wait for them and reuse them
    assert sorted(r.num_cached_tokens for r in results) == [0, shared, shared, shared]
    assert engine.scheduler.cache.stats.deferred_for_shared_prefix >= 3
    assert_no_leaks(engine)


def test_after_eviction_recompute_is_identical(model, uncached):
    engine = make_engine(model, kv_cache_blocks=24)
    target = chat_ids(model, "Explain what a mutex is.", SYSTEM)
    first = engine.generate([target], GREEDY)[0]
    for i in range(4):  # other traffic pushes the target's blocks out
        filler = " ".join(f"moon fact {i}.{j}" for j in range(30))
        engine.generate([chat_ids(model, f"{i}: summarise these notes: {filler}")], GREEDY)
    assert engine.blocks.stats.evictions > 0
    again = engine.generate([target], GREEDY)[0]
    assert again.num_cached_tokens < expected_hit(len(target), len(target))
    assert_same_output(first, uncached(target))
    assert_same_output(again, uncached(target))
    assert_no_leaks(engine)


def test_cache_salt_isolates(model, uncached):
    engine = make_engine(model)
    prompt = chat_ids(model, "What is a deadlock?", SYSTEM)
    engine.generate([prompt], GREEDY, cache_salt="tenant-a")
    other = engine.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    unsalted = engine.generate([prompt], GREEDY)[0]
    same = engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == expected_hit(len(prompt), len(prompt))
    for r in (other, unsalted, same):
        assert_same_output(r, uncached(prompt))


def test_forced_collisions_change_nothing(model):
    """1-byte table keys: eight prompts of ~10 blocks fight over 256 slots, so collisions are
    certain (28 of them; the test asserts some); every output still equals the cache-disabled run."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True)
    prompts = [
        chat_ids(model, f"Topic {i}: " + " ".join(f"note {i * 100 + j}" for j in range(25)), SYSTEM if i % 2 else None)
        for i in range(8)
    ]
    reference = make_engine(model, prefix_caching=False).generate(prompts, params)
    engine = make_engine(model, key_bytes=1)
    for _ in range(2):
        for result, ref in zip(engine.generate(prompts, params), reference, strict=True):
            assert_same_output(result, ref)
    assert engine.blocks.stats.collisions > 0
    assert engine.blocks.stats.lookup_hits > 0, "the second round must still hit where keys are intact"
    assert_no_leaks(engine)


def test_a_lower_tier_needs_whole_digests_as_keys(model, tmp_path):
    """Shortened keys are for the RAM table's collision tests only: a tier names block files
    by the key, so chains sharing one would delete each other's files on every load."""
    engine = make_engine(model, key_bytes=31)
    tier = DiskTier(tmp_path, engine.fingerprint, engine.block_spec, DiskConfig(min_free_bytes=0))
    try:
        with pytest.raises(ValueError, match="key_bytes = 32"):
            engine.attach_tier(tier)
    finally:
        tier.close(10)
    assert not engine.lower.tiers


def test_two_hundred_mixed_requests_leak_nothing(model):
    """Shared and distinct prefixes, stop strings, salts, cancels mid-prefill and mid-decode,
    preemption under a small pool: afterwards every block is back. Bookkeeping does not
    depend on the model's size, so a small random-weight Llama keeps this fast."""
    tiny = tiny_model("llama", model.tokenizer)
    engine = make_engine(tiny, kv_cache_blocks=40, max_step_tokens=96, max_num_seqs=12)
    rng = random.Random(11)
    topics = ["databases", "caching", "testing", "logging", "queues", "threads"]
    handles = []
    cancelled = set()
    for i in range(200):
        system = SYSTEM if rng.random() < 0.6 else None
        prompt = chat_ids(model, f"Request {i % 37}: one sentence about {rng.choice(topics)}.", system)
        params = SamplingParams(
            max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]), seed=i,
            stop=("e",) if rng.random() < 0.3 else (),
        )
        handles.append(engine.submit(prompt, params, cache_salt=rng.choice([None, None, "x"])))
        if rng.random() < 0.25:
            victim = rng.choice(handles[-3:])
            victim.cancel()
            cancelled.add(victim.seq_id)
        for _ in range(rng.randint(0, 3)):
            engine.step()
    engine.run_until_idle()
    results = [engine.collect(h) for h in handles]
    finishes = [r.finish_reason for r in results]
    assert set(finishes) <= {"stop", "length", "abort"}
    assert {r.seq_id for r in results if r.finish_reason == "abort"} <= cancelled
    assert finishes.count("abort") >= 10
    assert engine.stats.requests_total == 200
    assert_no_leaks(engine)


def test_preempted_sequences_resume_with_identical_output(model):
    """A pool too small for every decode to grow: sequences are preempted, their blocks
    released (full ones stay cached) and later resumed; outputs equal a roomy run."""
    tiny = tiny_model("llama", model.tokenizer)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = [chat_ids(model, f"Question {i}: what is {i} plus {i}?") for i in range(6)]
    roomy = make_engine(tiny).generate(prompts, params)
    tight = make_engine(tiny, kv_cache_blocks=22, block_size=8)
    results = tight.generate(prompts, params)
    assert tight.scheduler.stats.preemptions > 0
    for a, b in zip(roomy, results, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_TOL)
    assert_no_leaks(tight)
