"""The blocking API over the engine's event streams: run completions to the end.

With the engine thread running, ``collect`` just reads the stream; without it (tests,
benchmarks, ``kvcellar generate``) it steps the engine itself until the sequence's last
event arrives, which makes runs deterministic.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from kvcellar.engine.sampling import SamplingParams
from kvcellar.engine.sequence import EventStream, RequestHandle, TokenEvent


class Engine(Protocol):
    """The part of ``engine.Engine`` this module drives."""

    @property
    def threaded(self) -> bool: ...

    def submit(self, prompt_ids: Seq[int], params: SamplingParams, *, cache_salt: str | None = None,
               stream: EventStream | None = None) -> RequestHandle: ...

    def step_or_wait(self) -> bool: ...


@dataclass
class GenerationResult:
    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[float] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    error: str | None = None


def run_to_end(engine: Engine, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams], *,
             cache_salt: str | None = None) -> list[GenerationResult]:
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    handles = [engine.submit(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, plist, strict=True)]
    return [collect(engine, h) for h in handles]


def _next_event(engine: Engine, handle: RequestHandle) -> TokenEvent:
    if engine.threaded:
        return handle.stream.get_sync()
    while True:
        try:
            return handle.stream.get_sync(timeout=0)
        except queue.Empty:
            if not engine.step_or_wait():
                raise RuntimeError(f"sequence {handle.seq_id} is unknown or never finished") from None


def collect(engine: Engine, handle: RequestHandle) -> GenerationResult:
    result = GenerationResult(handle.seq_id, [], "", "", handle.num_prompt_tokens, 0)
    texts = []
    while True:
        ev = _next_event(engine, handle)
        if ev.token_id is not None:
            result.token_ids.append(ev.token_id)
            if ev.logprob is not None:
                result.logprobs.append(ev.logprob)
            if ev.top_logprobs is not None:
                result.top_logprobs.append(ev.top_logprobs)
        texts.append(ev.text)
        result.num_cached_tokens = ev.num_cached_tokens
        result.cached_tokens_by_tier = ev.cached_tokens_by_tier or {}
        if ev.finish_reason is not None:
            result.finish_reason = ev.finish_reason
            result.error = ev.error
            result.text = "".join(texts)
            return result
