"""Sampling: the math on known logits, and the engine's behaviour with the real model."""

from __future__ import annotations

import math

import pytest
import torch

from kvcellar.engine import SamplingParams
from kvcellar.engine.sampling import apply_penalties, sample_row
from tests._models import chat_ids, make_engine


def test_greedy_and_top_k_one_pick_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_row(logits, SamplingParams(temperature=0.0), [], None).token_id == 1
    gen = torch.Generator().manual_seed(0)
    assert all(sample_row(logits, SamplingParams(temperature=1.5, top_k=1), [], gen).token_id == 1 for _ in range(20))


@pytest.mark.parametrize("temperature", [5e-324, 1e-38, 1e-6])
def test_tiny_temperatures_are_greedy_not_nan(temperature):
    """A temperature this small overflows float32 logits to inf when divided (NaN
    probabilities, a 500 found by the schema fuzzer); it samples greedily instead."""
    logits = torch.tensor([1.0, 30.0, -5.0, 29.9])
    params = SamplingParams(temperature=temperature)
    params.validate()
    assert params.greedy
    assert sample_row(logits, params, [], params.make_generator(logits.device)).token_id == 1


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(1)
    seen_k = {sample_row(logits, SamplingParams(temperature=1.0, top_k=2), [], gen).token_id for _ in range(300)}
    assert seen_k == {0, 1}
    # top_p=0.7: the smallest set reaching 70 % is {0, 1} (0.5 + 0.3)
    seen_p = {sample_row(logits, SamplingParams(temperature=1.0, top_p=0.7), [], gen).token_id for _ in range(300)}
    assert seen_p == {0, 1}
    seen_all = {sample_row(logits, SamplingParams(temperature=1.0), [], gen).token_id for _ in range(2000)}
    assert seen_all == {0, 1, 2, 3}


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    gen = torch.Generator().manual_seed(2)
    draws = [sample_row(torch.log(probs), SamplingParams(temperature=1.0), [], gen).token_id for _ in range(4000)]
    for token, p in enumerate(probs.tolist()):
        assert abs(draws.count(token) / len(draws) - p) < 0.03


def test_penalties_follow_openai_definition():
    logits = torch.zeros(5)
    out = apply_penalties(logits, [1, 1, 3], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert out.tolist() == [0.0, -0.5 - 0.5, 0.0, -0.5 - 0.25, 0.0]
    # a strong presence penalty steers greedy away from a repeated token
    logits = torch.tensor([2.0, 1.9, 0.0])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample_row(logits, params, [0], None).token_id == 1


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -3.0])
    res = sample_row(logits, SamplingParams(temperature=0.7, logprobs=True, top_logprobs=2, seed=3), [],
                     torch.Generator().manual_seed(3))
    expected = torch.log_softmax(logits, -1)
    assert math.isclose(res.logprob, float(expected[res.token_id]), abs_tol=1e-6)
    assert [t for t, _ in res.top_logprobs] == [0, 1]
    assert math.isclose(res.top_logprobs[0][1], float(expected[0]), abs_tol=1e-6)


@pytest.mark.parametrize("bad", [
    {"max_tokens": 0}, {"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"presence_penalty": 3.0}, {"frequency_penalty": -2.5}, {"top_logprobs": 21},
])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


def test_seed_makes_sampling_reproducible_across_batches(model):
    prompt = chat_ids(model, "Invent a name for a dragon.")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    engine = make_engine(model)
    alone = engine.generate([prompt], params)[0]
    other = chat_ids(model, "Invent a name for a ship.")
    batched = engine.generate([other, prompt, other], [params, params, params])
    assert batched[1].token_ids == alone.token_ids
    different = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=99))[0]
    assert different.token_ids != alone.token_ids


def test_stop_token_ids_and_max_tokens(model):
    engine = make_engine(model)
    prompt = chat_ids(model, "Count from one to ten in words.")
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[5]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                       stop_token_ids=(stop_at,)))[0]
    first = free.token_ids.index(stop_at)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token ends it and adds no text
    assert stopped.text == model.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)


def test_stop_string_across_tokens_is_never_emitted(model):
    engine = make_engine(model)
    prompt = chat_ids(model, "Count from one to ten, separated by commas.")
    free = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    tok = model.tokenizer
    # character offset where each generated token's text ends
    ends = [len(tok.decode(free.token_ids[: i + 1], skip_special_tokens=True)) for i in range(len(free.token_ids))]
    boundary = ends[len(ends) // 2]
    stop = free.text[boundary - 2 : boundary + 2]
    first = free.text.index(stop)
    token_of = [next(i for i, e in enumerate(ends) if e > c) for c in (first, first + len(stop) - 1)]
    assert token_of[0] != token_of[1], f"{stop!r} should straddle a token boundary"
    stopped = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:first]


def test_eos_ends_generation_without_text(model):
    engine = make_engine(model)
    result = engine.generate([chat_ids(model, "Reply with the single word: yes")],
                             SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in model.eos_token_ids
    assert "<|im_end|>" not in result.text


def test_a_batch_of_greedy_rows_is_picked_at_once_and_others_are_left_to_the_sampler():
    from kvcellar.engine.sampling import greedy_tokens, plain_greedy

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    logits[2, 7] = logits[2, 11] = logits[2].max() + 1  # a tie: the first index, as one row's argmax
    plain = [True, False, True, True, False]
    picked = greedy_tokens(logits, plain)
    assert picked == [int(torch.argmax(logits[i])) if p else None for i, p in enumerate(plain)]
    assert picked[2] == 7
    assert greedy_tokens(logits, [True] * 5) == [sample_row(r, SamplingParams(temperature=0.0), [], None).token_id
                                                  for r in logits]
    greedy = SamplingParams(temperature=0.0)
    assert plain_greedy(greedy, None) and plain_greedy(SamplingParams(top_k=1), None)
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, logprobs=True),
                  SamplingParams(temperature=0.0, presence_penalty=0.5),
                  SamplingParams(temperature=0.0, frequency_penalty=0.5)):
        assert not plain_greedy(other, None)
    assert not plain_greedy(greedy, object())  # any grammar constraint


def _nucleus_by_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus's probabilities, renormalized, by its definition: the whole vocabulary sorted."""
    probs = torch.softmax(logits.double(), -1)
    ordered, order = torch.sort(probs, descending=True)
    ordered[ordered.cumsum(0) - ordered >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, ordered)
    return kept / kept.sum()


@pytest.mark.parametrize(("vocab", "spread", "draws"),
                         [(12, 1.0, 20000), (200, 0.05, 4000), (5000, 0.05, 1500), (5000, 4.0, 20000)])
def test_top_p_draws_only_the_nucleus_in_its_proportions(vocab, spread, draws):
    """The nucleus is found among the likeliest 64 tokens, then four times as many until they
    hold it (a flat distribution over 5,000 tokens: every round up to the whole vocabulary; over
    200, a round past it), not by sorting the vocabulary: the tokens drawn and their frequencies
    are the definition's."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * spread
    want = _nucleus_by_sort(logits, 0.9)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    counts = torch.bincount(torch.tensor([sample_row(logits, params, [], gen).token_id for _ in range(draws)]),
                            minlength=vocab).double()
    assert set(counts.nonzero().flatten().tolist()) <= set(want.nonzero().flatten().tolist())
    likely = want * draws >= 50  # a chi-square over the tokens seen often enough to count
    expected = want[likely] * draws
    if likely.sum() > 1:
        chi2 = float(((counts[likely] - expected) ** 2 / expected).sum())
        assert chi2 < 2 * int(likely.sum()) + 30, chi2  # ~3.5 sigma above its mean (the cells' count)


def test_a_draw_never_picks_a_token_of_probability_zero_and_refuses_no_distribution():
    from kvcellar.engine.sampling import _draw

    weights = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    gen = torch.Generator().manual_seed(3)
    assert {_draw(weights, gen) for _ in range(2000)} == {1, 3}
    assert _draw(torch.tensor([0.0, 0.0, 1e-30, 0.0]), gen) == 2
    for bad in (torch.zeros(4), torch.tensor([float("nan"), 1.0]), torch.tensor([float("inf"), 1.0]), torch.zeros(0)):
        with pytest.raises(ValueError):
            _draw(bad, gen)
