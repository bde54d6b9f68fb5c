"""The first-token timeout (server/generation.py) against a real engine: a prompt whose
prefill takes longer than the timeout, in chunks that each finish well within it, is not
cut off; a request whose prompt does not advance is. The timeout is set from a measured
chunk (at least ``PERIOD``), so a slow or busy machine does not turn one slow chunk into a
timeout the test did not mean."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvcellar.engine import SamplingParams
from kvcellar.server.generation import Generation, GenerationTimeout, Inflight, Timeouts
from tests._models import embedded, make_engine

PERIOD = 0.4  # seconds: the first-token timeout under test, at least
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def long_prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(1000, 40000) for _ in range(800)]  # 50 chunks of 16 tokens


async def first_event_after(engine, prompt: list[int], period: float = PERIOD) -> float:
    gen = Generation(engine, Inflight(), Timeouts(first_token=period, inter_token=60.0))
    t0 = time.monotonic()
    gen.submit([prompt], [PARAMS], cache_salt=None)
    try:
        async for _ in gen.events():
            return time.monotonic() - t0
    finally:
        gen.close()
    raise AssertionError("no event")


def test_a_prefill_that_advances_outlives_the_first_token_timeout():
    engine = make_engine(embedded(), max_step_tokens=16, prefix_caching=False)
    t0 = time.monotonic()
    engine.generate([long_prompt()[:64]], PARAMS)  # four chunks, the first paying for cold paths
    period = max(PERIOD, 4 * (time.monotonic() - t0))  # many chunks' worth
    engine.start()
    try:
        waited = asyncio.run(first_event_after(engine, long_prompt(), period))
    finally:
        assert engine.shutdown(30)
    # Only meaningful if the prefill did outlast the timeout: 50 steps of 16 tokens.
    assert waited > period


def test_a_prompt_that_does_not_advance_times_out():
    engine = make_engine(embedded(), max_step_tokens=16, prefix_caching=False)  # never started: no step runs
    t0 = time.monotonic()
    with pytest.raises(GenerationTimeout) as raised:
        asyncio.run(first_event_after(engine, long_prompt()))
    assert raised.value.kind == "first_token" and time.monotonic() - t0 >= PERIOD
