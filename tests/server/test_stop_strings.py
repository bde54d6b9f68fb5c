"""Stop strings never leak, also across token boundaries and inside multi-byte characters;
incomplete UTF-8 is never emitted. Stop strings are derived from the real model's output, so
the test knows they span tokens."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.helpers import MODEL

SEA = [{"role": "user", "content": "Write one sentence about the sea."}]
EMOJI = [{"role": "user", "content": "Write three ocean emojis."}]
REPEAT = [{"role": "user", "content": "Repeat exactly: 🌊🌊🌊 日本語 ñandú 🌊"}]


def run(client: Any, messages: list[dict[str, str]], stream: bool = False, **kwargs: Any) -> tuple[str, str, Any]:
    """(text, finish_reason, response or chunks)"""
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 40, **kwargs}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    return text, finish[0], chunks


@pytest.fixture(scope="module")
def sea(client: Any) -> tuple[str, list[str], str]:
    """(text, tokens, finish_reason) of the greedy answer without stop strings."""
    text, finish, r = run(client, SEA, logprobs=True)
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert "".join(tokens) == text
    return text, tokens, finish


def spanning_stops(text: str, tokens: list[str]) -> list[tuple[str, int]]:
    """(stop, where it first occurs) for strings made of the end of one token and the start
    of the next, at a boundary inside the output."""
    out = []
    offset = 0
    for a, b in itertools.pairwise(tokens):
        offset += len(a)
        if len(a.strip()) >= 2 and len(b.strip()) >= 2:
            stop = a[-2:] + b[:2]
            if text.find(stop) == offset - 2:
                out.append((stop, offset - 2))
    return out


def test_stop_spanning_tokens(client: Any, sea: tuple[str, list[str], str]) -> None:
    text, tokens, _ = sea
    candidates = spanning_stops(text, tokens)
    assert candidates, f"no token-spanning stop string found in {tokens}"
    stop, at = candidates[len(candidates) // 2]
    for stream in (False, True):
        got, finish, _ = run(client, SEA, stream=stream, stop=stop)
        assert finish == "stop"
        assert got == text[:at], (stop, got)
        assert stop not in got


def test_stop_list_earliest_match_wins(client: Any, sea: tuple[str, list[str], str]) -> None:
    text, tokens, _ = sea
    candidates = spanning_stops(text, tokens)
    assert len(candidates) >= 2
    (early, at), (late, _) = candidates[0], candidates[-1]
    got, finish, _ = run(client, SEA, stop=[late, early])
    assert (got, finish) == (text[:at], "stop")


def test_stop_in_legacy_completions_stream(client: Any) -> None:
    full = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert len(text) > 6
    stop = text[3:6]
    at = text.find(stop)
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=16,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_not_found_keeps_everything(client: Any, sea: tuple[str, list[str], str]) -> None:
    text, _, original_finish = sea
    # A stop string whose prefixes keep appearing (" t", " th", "the") is held back, then released.
    for stream in (False, True):
        got, finish, _ = run(client, SEA, stream=stream, stop=["the zebra", "QQQ"])
        assert (got, finish) == (text, original_finish)


def test_stop_at_start_gives_empty_text(client: Any, sea: tuple[str, list[str], str]) -> None:
    text, _, _ = sea
    got, finish, r = run(client, SEA, stop=text[:3])
    assert (got, finish) == ("", "stop")
    assert r.usage.completion_tokens >= 1


def test_stop_inside_multibyte_characters(client: Any) -> None:
    text, _, r = run(client, EMOJI, logprobs=True, max_tokens=20)
    pieces = [bytes(t.bytes) for t in r.choices[0].logprobs.content]
    split = [p for p in pieces if p and p[0] >= 0xF0 and len(p) < 4]
    assert split, "expected the model's emoji to be split over several byte tokens"
    emoji = next(ch for ch in text if ord(ch) > 0xFFFF)
    for stop, stream in ((emoji, True), ("\n\n" + emoji, False), (":\n\n" + emoji, True)):
        got, finish, _ = run(client, EMOJI, stream=stream, stop=stop, max_tokens=20)
        assert finish == "stop"
        assert got == text[: text.find(stop)]


def test_stream_never_emits_partial_utf8(client: Any) -> None:
    full, _, _ = run(client, REPEAT, max_tokens=24)
    assert any(ord(ch) > 0xFFFF for ch in full)
    _, _, chunks = run(client, REPEAT, stream=True, max_tokens=24)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)
