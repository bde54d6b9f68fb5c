"""Speculative decoding: tokens a sequence will likely emit next, drafted from text it has
seen, verified in one step.

Agents copy: a rewritten file repeats the file in the prompt, a tool call echoes a path or a
block of code, a JSON document repeats its keys. A draft of k tokens found there is fed with
the sequence's last token as one span of k + 1 rows; each row is computed as a decode step
would compute it (the attention kernel and the linears give a row the same numbers at any
row count: engine/attention.py, docs/performance.md "One arithmetic per token"), and the
engine picks each row's token as a decode step would (the same sampler, the same draws of
the sequence's generator), keeping drafted tokens while they equal what it picked. So the
output is the one plain decoding gives, token for token, greedy and seeded sampling alike;
with a draft that is a point mass this is standard speculative sampling (accept with the
model's probability of the draft token, else sample the rest of the distribution).

Drafters (``--speculative``):

* ``ngram`` (prompt lookup): the longest n-gram (``MIN_NGRAM``..``MAX_NGRAM`` tokens) that
  ends the sequence and occurred before in its prompt or output; the draft is what followed
  its latest occurrence.
* ``suffix``: the same over the sequence, and over recent outputs of every request
  (``SharedOutputs``: what earlier turns and other requests emitted, which agents emit again);
  a match there drafts as far as the continuations seen after it agree (the match's frequency).

Per sequence the draft length adapts (``Pacer``): it grows while drafts are taken whole and
shrinks to what was taken; a draft taken not at all pauses drafting for a number of steps that
doubles with each miss in a row, so text that does not repeat costs a verification now and
then, not every step.

Engine thread only.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence as Seq
from typing import Literal, get_args

SpeculativeMode = Literal["off", "ngram", "suffix"]
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = get_args(SpeculativeMode)

# The n-gram lengths a draft is matched on: a single token matches almost anywhere in natural
# text (drafts that fail); longer matches are rarer and better.
MIN_NGRAM = 2
MAX_NGRAM = 4
FIRST_LENGTH = 4  # draft length of a sequence's first draft
MAX_PAUSE = 64  # steps without drafting after many misses in a row
# Draft tokens one step verifies in all: beyond it a step of many sequences grows past what a
# decode step of them costs (the panels' cost grows with rows once they are compute-bound).
STEP_DRAFT_TOKENS = 16
# suffix: recent outputs of all requests the shared index keeps, in tokens.
SHARED_TOKENS = 1 << 18
# suffix: a shared continuation is drafted while at least this share of its occurrences agree.
SHARED_AGREEMENT = 0.5
_SEPARATOR = -1  # between outputs in the shared corpus: no n-gram spans two


class NgramIndex:
    """Where each n-gram of a token list last occurred: n-gram -> the position after it.
    Extended as the list grows; ``match`` finds the longest n-gram ending the list that occurred
    earlier and returns where its continuation starts."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in

    def extend(self, tokens: Seq[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end before position ``upto``."""
        last = self._last
        for end in range(self.indexed + 1, upto + 1):  # n-gram tokens[end - n : end]
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end - n < 0:
                    break
                gram = tuple(tokens[end - n:end])
                if _SEPARATOR in gram:
                    break
                last[gram] = end
        self.indexed = max(self.indexed, upto)

    def match(self, tail: Seq[int]) -> tuple[int, int]:
        """(position after the latest earlier occurrence of the longest n-gram ending ``tail``,
        its length); (-1, 0) if none occurred."""
        for n in range(min(MAX_NGRAM, len(tail)), MIN_NGRAM - 1, -1):
            pos = self._last.get(tuple(tail[-n:]))
            if pos is not None:
                return pos, n
        return -1, 0

    def __len__(self) -> int:
        return len(self._last)


class SharedOutputs:
    """Recent outputs of every request, in one corpus (``SHARED_TOKENS`` at most, the oldest
    dropped), with an index of which tokens followed each n-gram and how often."""

    def __init__(self, capacity: int = SHARED_TOKENS) -> None:
        self.capacity = capacity
        self._outputs: collections.deque[tuple[int, ...]] = collections.deque()
        self._tokens = 0
        # n-gram -> next token -> times seen
        self._next: dict[tuple[int, ...], collections.Counter[int]] = {}

    def add(self, output: Seq[int]) -> None:
        out = tuple(output)
        if len(out) <= MIN_NGRAM:
            return
        self._count(out, +1)
        self._outputs.append(out)
        self._tokens += len(out)
        while self._tokens > self.capacity and len(self._outputs) > 1:
            old = self._outputs.popleft()
            self._tokens -= len(old)
            self._count(old, -1)

    def _count(self, out: tuple[int, ...], sign: int) -> None:
        table = self._next
        for end in range(MIN_NGRAM, len(out)):
            nxt = out[end]
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                gram = out[end - n:end]
                counts = table.get(gram)
                if counts is None:
                    if sign < 0:
                        continue
                    counts = table[gram] = collections.Counter()
                counts[nxt] += sign
                if counts[nxt] <= 0:
                    del counts[nxt]
                    if not counts:
                        del table[gram]

    def draft(self, context: Seq[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens after ``context``: at each step the most frequent continuation of
        the longest n-gram ending what is drafted so far, while that continuation holds at least
        ``SHARED_AGREEMENT`` of what followed it, overall (the product of the shares)."""
        out: list[int] = []
        tail = list(context[-MAX_NGRAM:])
        share = 1.0
        while len(out) < limit:
            counts = None
            for n in range(min(MAX_NGRAM, len(tail)), MIN_NGRAM - 1, -1):
                counts = self._next.get(tuple(tail[-n:]))
                if counts:
                    break
            if not counts:
                break
            token, seen = counts.most_common(1)[0]
            share *= seen / sum(counts.values())
            if share < SHARED_AGREEMENT:
                break
            out.append(token)
            tail = [*tail[-(MAX_NGRAM - 1):], token]
        return out

    @property
    def tokens(self) -> int:
        return self._tokens

    def outputs(self) -> list[tuple[int, ...]]:
        return list(self._outputs)


@dataclasses.dataclass
class Pacer:
    """One sequence's drafting: its index over its own tokens and how long its drafts are."""

    length: int
    index: NgramIndex = dataclasses.field(default_factory=NgramIndex)
    pause: int = 0  # steps left without drafting
    misses: int = 0  # drafts in a row of which nothing was taken

    def verified(self, drafted: int, accepted: int, most: int) -> None:
        if accepted == drafted:
            self.length = min(most, self.length + 2)
            self.misses = 0
        elif accepted == 0:
            self.length = max(1, self.length // 2)
            self.misses += 1
            self.pause = min(MAX_PAUSE, 1 << self.misses)
        else:
            self.length = max(1, accepted + 1)
            self.misses = 0


class Drafter:
    """Drafts for sequences (``ngram`` or ``suffix``); the engine tells it what was taken."""

    def __init__(self, mode: SpeculativeMode, max_tokens: int, shared: SharedOutputs | None = None) -> None:
        if mode not in ("ngram", "suffix"):
            raise ValueError(f"no drafter for speculative mode {mode!r}")
        self.mode = mode
        self.max_tokens = max_tokens
        self.shared = shared if shared is not None else (SharedOutputs() if mode == "suffix" else None)
        self._pacers: dict[int, Pacer] = {}

    def propose(self, seq_id: int, tokens: Seq[int], limit: int) -> list[int]:
        """A draft of at most ``limit`` tokens to follow ``tokens`` (the sequence's prompt and
        output), or none."""
        pacer = self._pacers.get(seq_id)
        if pacer is None:
            pacer = self._pacers[seq_id] = Pacer(min(FIRST_LENGTH, self.max_tokens))
        if pacer.pause > 0:
            pacer.pause -= 1
            return []
        limit = min(limit, pacer.length)
        if limit <= 0:
            return []
        index = pacer.index
        index.extend(tokens, len(tokens) - 1)  # not the n-grams ending the list: they match themselves
        pos, _ = index.match(tokens)
        own = list(tokens[pos:pos + limit]) if pos >= 0 else []
        if self.shared is not None and len(own) < limit:
            other = self.shared.draft(tokens, limit)
            if len(other) > len(own):
                return other
        return own

    def verified(self, seq_id: int, drafted: int, accepted: int) -> None:
        pacer = self._pacers.get(seq_id)
        if pacer is not None:
            pacer.verified(drafted, accepted, self.max_tokens)

    def finished(self, seq_id: int, output: Seq[int]) -> None:
        """The sequence is done: forget it; its output joins the shared index (suffix)."""
        self._pacers.pop(seq_id, None)
        if self.shared is not None and output:
            self.shared.add(output)
