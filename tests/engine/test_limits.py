"""max_tokens against the context: clamped to the room left, a 400 only for a prompt that does
not fit; and a context above the model's trained one when asked for."""

from __future__ import annotations

import pytest

from kvcellar.engine import SamplingParams
from kvcellar.errors import InvalidRequestError
from tests._models import chat_ids, make_engine


def test_max_tokens_is_clamped_to_the_room_the_context_leaves(model) -> None:
    engine = make_engine(model, max_model_len=64)
    prompt = chat_ids(model, "Count from one to one hundred.")
    assert len(prompt) < 64
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=32000, temperature=0.0, ignore_eos=True))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 64 - len(prompt)
    assert engine.fit_max_tokens(len(prompt), 32000) == 64 - len(prompt)
    assert engine.fit_max_tokens(len(prompt), 3) == 3


def test_only_a_prompt_that_does_not_fit_by_itself_is_refused(model) -> None:
    engine = make_engine(model, max_model_len=64)
    assert engine.fit_max_tokens(63, 1000) == 1
    with pytest.raises(InvalidRequestError) as err:
        engine.fit_max_tokens(64, 1)
    assert err.value.code == "context_length_exceeded" and "64" in str(err.value)


def test_the_pool_is_the_limit_where_it_holds_less_than_the_context(model) -> None:
    engine = make_engine(model, kv_cache_blocks=9)  # 8 usable blocks of 16 tokens
    assert engine.fit_max_tokens(100, 32000) == 28
    with pytest.raises(InvalidRequestError, match="KV cache pool holds 128 tokens"):
        engine.fit_max_tokens(128, 1)


def test_a_context_above_the_trained_one_is_served_and_the_pool_grows_to_it(model) -> None:
    trained = model.max_context
    engine = make_engine(model, max_model_len=trained + 64, kv_cache_gb=0.001)
    assert engine.max_model_len == trained + 64
    assert engine.pool_tokens >= trained + 64
    prompt = chat_ids(model, "hello")
    assert engine.fit_max_tokens(trained + 10, 32000) == 54
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    assert result.finish_reason in ("stop", "length") and result.token_ids


def test_max_completion_tokens_caps_every_request(model) -> None:
    engine = make_engine(model, max_completion_tokens=5)
    assert engine.fit_max_tokens(10, 32000) == 5
    assert engine.fit_max_tokens(10, 3) == 3
    (result,) = engine.generate([chat_ids(model, "Count to fifty.")],
                                SamplingParams(max_tokens=32000, temperature=0.0, ignore_eos=True))
    assert result.finish_reason == "length" and len(result.token_ids) == 5
