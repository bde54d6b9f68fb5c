"""Sixteen concurrent streaming clients get correct, independent outputs: each equals the
same prompt run alone (greedy, fp32), although they share batches, the prefix cache (the
solo runs cached their prompts) and a common system prompt."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.helpers import MODEL, ServerProcess

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = [
    "What colour is the sky?", "Name a fruit.", "What is 3 + 4?", "Name a planet.", "What do cows drink?",
    "Name a musical instrument.", "What is the capital of Italy?", "Name an ocean.", "What is ice made of?",
    "Name a bird.", "How many legs does a spider have?", "Name a metal.", "What do bees make?",
    "Name a season.", "What is the opposite of hot?", "Name a vegetable.",
]
MAX_TOKENS = 12


def messages(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


async def stream_one(client: Any, q: str) -> tuple[str, str, float]:
    start = time.perf_counter()
    text, finish = [], None
    stream = await client.chat.completions.create(model=MODEL, messages=messages(q), temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), str(finish), time.perf_counter() - start


def test_16_concurrent_streams_match_solo_runs(server: ServerProcess, client: Any) -> None:
    solo = []
    for q in QUESTIONS:
        r = client.chat.completions.create(model=MODEL, messages=messages(q), temperature=0, max_tokens=MAX_TOKENS)
        solo.append((r.choices[0].message.content, r.choices[0].finish_reason))
    assert len({text for text, _ in solo}) > 8, "prompts should give different answers"

    async def all_at_once() -> list[tuple[str, str, float]]:
        async with server.async_client() as aclient:
            return await asyncio.gather(*(stream_one(aclient, q) for q in QUESTIONS))

    t0 = time.perf_counter()
    together = asyncio.run(all_at_once())
    wall = time.perf_counter() - t0
    for q, (text, finish), (ctext, cfinish, _) in zip(QUESTIONS, solo, together, strict=True):
        assert (ctext, cfinish) == (text, finish), q
    assert server.wait_idle()["kv_blocks_used"] == 0
    print(f"16 concurrent streams: {wall:.2f} s wall, slowest {max(t for *_, t in together):.2f} s")
