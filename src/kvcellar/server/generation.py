"""One API request's engine sequences: submitted together, read as one event stream,
cancelled together.

A request asks for ``n`` choices of one or more prompts; each choice is one engine sequence.
All of them report into a single ``EventStream`` bound to the server's event loop, and
``events()`` yields ``(choice index, TokenEvent)`` in arrival order. Events of one choice
that arrived together (a step that verified a draft emits several tokens at once) are
yielded as one whose text is theirs joined, where nothing is lost by it (no logprobs asked
for): one chunk a step instead of one a token, which the server renders and the client
parses on the cores that compute the next step.

Timeouts are per choice: its first event must come within ``first_token`` seconds of
submission (queueing and prefill included), every later one within ``inter_token`` seconds
of the previous. When one is exceeded, every unfinished choice is cancelled in the engine
and ``GenerationTimeout`` is raised.

Lifecycle: whoever creates a ``Generation`` calls ``close()`` exactly once in a ``finally``;
it cancels whatever is unfinished (a client that went away, a timeout, an error) and
unregisters it from the ``Inflight`` registry. The engine frees a cancelled sequence's
blocks on its next step.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from kvcellar.engine import Engine, EventStream, SamplingParams, TokenEvent
from kvcellar.engine.sequence import RequestHandle

# asyncio.wait_for with a zero timeout gives up before even looking at the queue; an
# already-expired deadline therefore waits this long, which still returns queued events.
_MIN_WAIT = 0.001


def _joinable(event: TokenEvent) -> bool:
    """Whether a later event of the same sequence may carry this one's text: not a final one,
    and no per-token logprobs to report."""
    return event.finish_reason is None and event.error is None and event.logprob is None and not event.is_eos


class GenerationTimeout(Exception):
    def __init__(self, kind: str, seconds: float) -> None:
        super().__init__(f"{kind} timeout after {seconds:g} s")
        self.kind = kind  # "first_token" | "inter_token"
        self.seconds = seconds


@dataclass(frozen=True)
class Timeouts:
    first_token: float
    inter_token: float


@dataclass
class Choice:
    index: int
    prompt_index: int
    handle: RequestHandle
    deadline: float
    started: bool = False
    finish_reason: str | None = None
    progress: int = 0  # prompt tokens computed when its first-token deadline was last checked


class Inflight:
    """Registry of live generations (reported by /health; must return to zero).

    Touched only from the event loop thread."""

    def __init__(self) -> None:
        self._live: dict[int, Generation] = {}
        self._ids = itertools.count(1)

    def add(self, gen: Generation) -> int:
        key = next(self._ids)
        self._live[key] = gen
        return key

    def discard(self, key: int) -> None:
        self._live.pop(key, None)

    def __len__(self) -> int:
        return len(self._live)

    def num_sequences(self) -> int:
        return sum(gen.num_unfinished for gen in self._live.values())


class Generation:
    def __init__(self, engine: Engine, inflight: Inflight, timeouts: Timeouts) -> None:
        self.engine = engine
        self.timeouts = timeouts
        self.choices: list[Choice] = []
        self.created = time.monotonic()
        self.first_event_at: float | None = None
        self._stream = EventStream(asyncio.get_running_loop())
        self._by_seq: dict[int, Choice] = {}
        self._inflight = inflight
        self._key: int | None = inflight.add(self)

    @property
    def num_unfinished(self) -> int:
        return sum(1 for c in self.choices if c.finish_reason is None)

    def submit(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
               cache_salt: str | None, history_tokens: int | None = None, arrived: float | None = None,
               tenant: str | None = None) -> None:
        """Submit ``len(params)`` choices of each prompt, prompt-major. If one submission
        fails, the ones before it are cancelled and the error propagates. ``arrived``: when the
        request came (monotonic); its first-token timeout counts from then. ``tenant``: the
        API key's name (admission takes tenants in turn)."""
        deadline = (time.monotonic() if arrived is None else arrived) + self.timeouts.first_token
        try:
            for p, prompt in enumerate(prompts):
                for sp in params:
                    handle = self.engine.submit(prompt, sp, cache_salt=cache_salt, stream=self._stream,
                                                history_tokens=history_tokens, tenant=tenant)
                    choice = Choice(len(self.choices), p, handle, deadline)
                    self.choices.append(choice)
                    self._by_seq[handle.seq_id] = choice
        except BaseException:
            self.close()
            raise

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """Events of every choice until each has finished. Raises ``GenerationTimeout``
        (after cancelling) when a choice is late."""
        pending: TokenEvent | None = None  # arrived, not joinable with the event before it
        while self.num_unfinished:
            now = time.monotonic()
            late = min((c for c in self.choices if c.finish_reason is None), key=lambda c: c.deadline)
            try:
                if pending is not None:
                    event, pending = pending, None
                else:
                    event = await self._stream.get(timeout=max(late.deadline - now, _MIN_WAIT))
                while _joinable(event) and (after := self._stream.get_nowait()) is not None:
                    if (after.seq_id != event.seq_id or after.logprob is not None
                            or after.finish_reason not in (None, "stop", "length")):
                        pending = after  # its own event: a failure's text is not the failure
                        break
                    event = replace(after, text=event.text + after.text)
            except TimeoutError:
                if not late.started and self._prefill_advanced(late):
                    # A long prompt whose prefill keeps advancing is not late: a 7B model on
                    # a few cores takes minutes for a few thousand tokens.
                    late.deadline = time.monotonic() + self.timeouts.first_token
                    continue
                self.cancel()
                if late.started:
                    raise GenerationTimeout("inter_token", self.timeouts.inter_token) from None
                raise GenerationTimeout("first_token", self.timeouts.first_token) from None
            choice = self._by_seq.get(event.seq_id)
            if choice is None or choice.finish_reason is not None:
                continue
            now = time.monotonic()
            if self.first_event_at is None:
                self.first_event_at = now
            choice.started = True
            choice.deadline = now + self.timeouts.inter_token
            if event.finish_reason is not None:
                choice.finish_reason = event.finish_reason
            yield choice.index, event

    def _prefill_advanced(self, choice: Choice) -> bool:
        """Whether the count of the choice's prompt tokens computed changed since its last
        check (it grows as prefill advances; a preemption resets it, and recomputing follows)."""
        progress = self.engine.prompt_progress(choice.handle.seq_id)
        if progress is None or progress == choice.progress:
            return False
        choice.progress = progress
        return True

    def cancel(self) -> None:
        """Cancel every unfinished choice in the engine (idempotent)."""
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                choice.handle.cancel()

    def close(self) -> None:
        self.cancel()
        if self._key is not None:
            self._inflight.discard(self._key)
            self._key = None
