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
model's probability of the draft token, else sample the rest of the distribution). A hybrid
model's rows advance its linear-attention state too: where the model rejects a draft's tail,
the engine rewinds that state to the last row kept (``ModelRunner.rewind``).

Drafters (``--speculative``):

* ``ngram`` (prompt lookup): the longest n-gram (``MIN_NGRAM``..``MAX_NGRAM`` tokens) that
  ends the sequence and occurred before in its prompt or output; the draft is what followed
  the one of its latest occurrences whose preceding tokens agree with the sequence's furthest
  back (the latest of them, unless an older one agrees clearly further).
* ``suffix``: the same over the sequence, and over recent outputs of every request of its
  cache root (``SharedOutputs``: what earlier turns and other requests emitted, which agents
  emit again); a match there drafts as far as the continuations seen after it agree (the
  match's frequency), and wins over a match of the sequence's own that agrees on a bare bigram.
  They are kept in the cache dir across restarts (``RecentOutputs``).

Drafting is worth it only while the tokens a draft adds outweigh the rows it costs: a step's
draft tokens are chosen one at a time (``Drafter.choose``), the likeliest first, each only if it
raises the step's expected tokens per second, from what steps of each row count cost here
(``RowCost``, learnt from the steps run) and how often such drafts were taken (per sequence,
and per match length over all of them). Text that does not repeat has short matches whose
drafts are rarely taken, and stops drafting; more sequences in a step make every extra row
cost more of a step's worth, so drafting asks for surer drafts.

Engine thread only.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import struct
import time
from collections.abc import Sequence as Seq
from pathlib import Path

from kvcellar.engine.config import SpeculativeMode

log = logging.getLogger(__name__)


# The n-gram lengths a draft is matched on: a single token matches almost anywhere in natural
# text (drafts that fail); longer matches are rarer and better.
MIN_NGRAM = 2
MAX_NGRAM = 4
MATCH_CAP = 64  # a match is measured back this far at most
# Steps with candidates but no draft worth it, after which one token is drafted anyway (to
# measure again what drafting costs and yields here): a few % of the steps' time at most on
# text that never repeats (docs/performance.md).
EXPLORE_EVERY = 32
# suffix: recent outputs a cache root's shared index keeps, in tokens (its n-gram table takes
# ~450 bytes a token where every n-gram is new, ~120 on code: docs/performance.md).
SHARED_TOKENS = 1 << 15
# suffix: a shared continuation is drafted while at least this share of its occurrences agree.
SHARED_AGREEMENT = 0.5
# suffix: a match in the sequence's own tokens that agrees on fewer tokens than this (a bare
# bigram, whose first token is taken about half the time) gives way to a shared continuation.
SHARED_OVER_AGREEMENT = 3


class NgramIndex:
    """Where each n-gram of a token list occurred lately (its ``KEEP`` latest occurrences):
    n-gram -> the positions after them. Extended as the list grows; ``match`` finds the longest
    n-gram ending the list that occurred earlier and, of its occurrences, the one whose preceding
    tokens agree with the list's furthest back: code repeats short n-grams everywhere (an indent
    and ``self.``), and the occurrence in the same surroundings is the one copied."""

    KEEP = 4
    # an older occurrence is taken only where it agrees more than this many tokens further back
    # than a later one: the latest version of a text is the likelier one to be copied again
    LATEST_MARGIN = 2

    def __init__(self) -> None:
        self._at: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending before this position are in

    def extend(self, tokens: Seq[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end before position ``upto``."""
        at = self._at
        for end in range(self.indexed + 1, upto + 1):  # n-gram tokens[end - n : end]
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end - n < 0:
                    break
                seen = at.setdefault(tuple(tokens[end - n:end]), [])
                seen.append(end)
                if len(seen) > self.KEEP:
                    del seen[0]
        self.indexed = max(self.indexed, upto)

    def match(self, tokens: Seq[int]) -> tuple[int, int]:
        """(position after the chosen earlier occurrence of the longest n-gram ending ``tokens``,
        how many tokens before that position agree with the end of ``tokens``, ``MATCH_CAP`` at
        most); (-1, 0) if none occurred. The latest occurrence, unless an older one agrees more
        than ``LATEST_MARGIN`` tokens further back."""
        end = len(tokens)
        for n in range(min(MAX_NGRAM, end), MIN_NGRAM - 1, -1):
            seen = self._at.get(tuple(tokens[end - n:]))
            if not seen:
                continue
            best, agree = -1, 0
            for pos in reversed(seen):
                if pos >= MATCH_CAP and tokens[pos - MATCH_CAP:pos] == tokens[end - MATCH_CAP:end]:
                    a = MATCH_CAP  # copying: one comparison in C, not 64 in Python
                else:
                    a = n
                    while a < MATCH_CAP and pos - a - 1 >= 0 and tokens[pos - a - 1] == tokens[end - a - 1]:
                        a += 1
                if best < 0 or a > agree + self.LATEST_MARGIN:
                    best, agree = pos, a
            return best, agree
        return -1, 0

    def __len__(self) -> int:
        return len(self._at)


class SharedOutputs:
    """Recent outputs of the requests of one cache root (``SHARED_TOKENS`` at most, the oldest
    dropped), with an index of which tokens followed each n-gram in them and how often.

    Most n-grams were followed by one token only: their entry is one int (the token and its count
    packed, ``_pack``) rather than a table, a third of the memory (docs/performance.md)."""

    _TOKEN_BITS = 32

    def __init__(self, capacity: int = SHARED_TOKENS) -> None:
        self.capacity = capacity
        self._outputs: collections.deque[tuple[int, ...]] = collections.deque()
        self._tokens = 0
        # n-gram -> what followed it: a packed (token, times) where one token did, else token -> times
        self._next: dict[tuple[int, ...], int | dict[int, int]] = {}

    @classmethod
    def _pack(cls, token: int, times: int) -> int:
        return times << cls._TOKEN_BITS | token

    @classmethod
    def _unpack(cls, packed: int) -> tuple[int, int]:
        return packed & ((1 << cls._TOKEN_BITS) - 1), packed >> cls._TOKEN_BITS

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
        table, pack, unpack = self._next, self._pack, self._unpack
        for end in range(MIN_NGRAM, len(out)):
            nxt = out[end]
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                gram = out[end - n:end]
                seen = table.get(gram)
                if seen is None:
                    if sign > 0:
                        table[gram] = pack(nxt, 1)
                    continue
                if isinstance(seen, int):
                    token, times = unpack(seen)
                    if token != nxt:
                        if sign > 0:
                            table[gram] = {token: times, nxt: 1}
                    elif times + sign > 0:
                        table[gram] = pack(token, times + sign)
                    else:
                        del table[gram]
                    continue
                times = seen.get(nxt, 0) + sign
                if times > 0:
                    seen[nxt] = times
                elif nxt in seen:
                    del seen[nxt]
                    if len(seen) == 1:
                        table[gram] = pack(*next(iter(seen.items())))

    def _likeliest(self, gram: tuple[int, ...]) -> tuple[int, float] | None:
        """The token that followed ``gram`` most often and its share of what followed it."""
        seen = self._next.get(gram)
        if seen is None:
            return None
        if isinstance(seen, int):
            return self._unpack(seen)[0], 1.0
        token = max(seen, key=seen.__getitem__)
        return token, seen[token] / sum(seen.values())

    def draft(self, context: Seq[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens after ``context``: at each step the most frequent continuation of
        the longest n-gram ending what is drafted so far, while that continuation holds at least
        ``SHARED_AGREEMENT`` of what followed it, overall (the product of the shares)."""
        out: list[int] = []
        tail = list(context[-MAX_NGRAM:])
        share = 1.0
        while len(out) < limit:
            found = None
            for n in range(min(MAX_NGRAM, len(tail)), MIN_NGRAM - 1, -1):
                found = self._likeliest(tuple(tail[-n:]))
                if found is not None:
                    break
            if found is None:
                break
            token, part = found
            share *= part
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


class RowCost:
    """What a step costs by its rows, learnt from the steps the engine runs (decodes and
    verifications; a step with a prefill chunk says nothing about a decode's cost): per row count
    the lower quartile of its last ``WINDOW`` steps, interpolated between the counts seen,
    extrapolated past the last with the slope of the last two (``PRIOR_SLOPE`` of a row's cost
    before two are known), each row count's first step left out once any count has a second (a
    first call's warm-up). A low quantile, not a mean: a step the host stalls (a page fault, another
    process) only ever takes longer, and one such step would price its row count out of the
    drafts, which then never measure it again."""

    PRIOR_SLOPE = 0.25  # an extra row's cost, in rows' worth of the smallest step seen (CPUs: 0.2-0.3)
    WINDOW = 16  # steps of a row count its quartile is taken over

    def __init__(self) -> None:
        self._first: dict[int, float] = {}  # each row count's first step: its estimate until a second
        self._seen: dict[int, collections.deque[float]] = {}
        self._seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        if rows not in self._first:  # a first call of a shape grows buffers and faults pages in
            self._first[rows] = seconds
            return
        seen = self._seen.get(rows)
        if seen is None:
            seen = self._seen[rows] = collections.deque(maxlen=self.WINDOW)
        seen.append(seconds)
        self._seconds[rows] = sorted(seen)[(len(seen) - 1) // 4]

    def seconds(self, rows: int) -> float | None:
        """A step of ``rows`` rows, in seconds; None before any step was seen."""
        known = self._seconds or self._first
        if rows in known:
            return known[rows]
        if not known:
            return None
        counts = sorted(known)
        below = [r for r in counts if r < rows]
        above = [r for r in counts if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
        if len(counts) >= 2 and below:
            lo, hi = counts[-2], counts[-1]
            slope = max(0.0, (known[hi] - known[lo]) / (hi - lo))
        else:
            slope = self.PRIOR_SLOPE * known[counts[0]] / counts[0]
        edge = below[-1] if below else above[0]
        return max(0.0, known[edge] + slope * (rows - edge))


# Match lengths (tokens of the context that agree with the earlier occurrence) whose drafts'
# acceptance is learnt apart: a long match is the better evidence.
MATCH_BUCKETS = (2, 4, 8, 16, 32)
SHARED_BUCKET = -1  # drafts from other requests' outputs


def _bucket(length: int) -> int:
    found = MATCH_BUCKETS[0]
    for b in MATCH_BUCKETS:
        if length >= b:
            found = b
    return found


class Acceptance:
    """How often a drafted token is taken, given the ones before it were: ``taken / (taken +
    missed)`` from counts that fade (``FADE`` a verification), starting from ``prior`` taken and
    missed each."""

    FADE = 0.9

    def __init__(self, prior: float = 1.0) -> None:
        self.taken = prior
        self.missed = prior

    def rate(self) -> float:
        return self.taken / (self.taken + self.missed)

    def update(self, drafted: int, accepted: int) -> None:
        self.taken = self.taken * self.FADE + accepted
        self.missed = self.missed * self.FADE + (accepted < drafted)


class RecentOutputs:
    """``suffix``'s shared outputs, one ``SharedOutputs`` per cache root (the model and the
    request's cache salt: a tenant's outputs never draft for another, whose speed would tell
    what the first one wrote), ``PARTITIONS`` at most (the least recently used dropped), and
    kept in a file across restarts (``path``): written whole, atomically, at most every
    ``SAVE_EVERY_S`` while outputs arrive and at ``close``; a file that does not read back whole
    (damaged, cut short, another format) is ignored, and replaced by the next save."""

    PARTITIONS = 8
    SAVE_EVERY_S = 60.0
    MAGIC = b"KVCSPEC1"

    def __init__(self, path: Path | None = None, capacity: int = SHARED_TOKENS) -> None:
        self.path = path
        self.capacity = capacity
        self._parts: collections.OrderedDict[bytes, SharedOutputs] = collections.OrderedDict()
        self._dirty = False
        self._saved_at = time.monotonic()
        self.load_error: str | None = None
        if path is not None:
            self._load(path)

    def get(self, root: bytes) -> SharedOutputs | None:
        part = self._parts.get(root)
        if part is not None:
            self._parts.move_to_end(root)
        return part

    def add(self, root: bytes, output: Seq[int]) -> None:
        part = self._parts.get(root)
        if part is None:
            part = self._parts[root] = SharedOutputs(self.capacity)
            while len(self._parts) > self.PARTITIONS:
                self._parts.popitem(last=False)
        self._parts.move_to_end(root)
        part.add(output)
        self._dirty = True
        if self.path is not None and time.monotonic() - self._saved_at >= self.SAVE_EVERY_S:
            self.save()

    def close(self) -> None:
        if self._dirty and self.path is not None:
            self.save()

    def save(self) -> None:
        """Write every partition to ``path`` (temp file, fsync, rename; owner-only)."""
        assert self.path is not None
        self._saved_at = time.monotonic()
        body = bytearray()
        for root, part in self._parts.items():
            outputs = part.outputs()
            body += struct.pack("<H", len(root)) + root + struct.pack("<I", len(outputs))
            for out in outputs:
                body += struct.pack(f"<I{len(out)}i", len(out), *out)
        digest = hashlib.blake2b(bytes(body), digest_size=16).digest()
        data = self.MAGIC + struct.pack("<Q", len(body)) + digest + bytes(body)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError as exc:  # a full or read-only disk loses the drafts' memory, nothing else
            log.warning("could not save the speculative decoding outputs to %s: %s", self.path, exc)

    def _load(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            self.load_error = str(exc)
            return
        try:
            head = len(self.MAGIC) + 8 + 16
            if data[:len(self.MAGIC)] != self.MAGIC:
                raise ValueError("not an outputs file")
            (size,) = struct.unpack_from("<Q", data, len(self.MAGIC))
            body = data[head:]
            if len(body) != size or hashlib.blake2b(body, digest_size=16).digest() != data[head - 16:head]:
                raise ValueError("damaged or cut short")
            at = 0
            parts: list[tuple[bytes, list[tuple[int, ...]]]] = []
            while at < len(body):
                (n,) = struct.unpack_from("<H", body, at)
                root = body[at + 2:at + 2 + n]
                (count,) = struct.unpack_from("<I", body, at + 2 + n)
                at += 6 + n
                outs = []
                for _ in range(count):
                    (length,) = struct.unpack_from("<I", body, at)
                    outs.append(struct.unpack_from(f"<{length}i", body, at + 4))
                    at += 4 + 4 * length
                parts.append((root, outs))
        except (ValueError, struct.error) as exc:
            self.load_error = str(exc)
            log.warning("ignoring the speculative decoding outputs in %s (%s); they are written anew", path, exc)
            return
        for root, outs in parts[-self.PARTITIONS:]:
            part = self._parts[root] = SharedOutputs(self.capacity)
            for out in outs:
                part.add(out)

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self._parts.values())


@dataclasses.dataclass
class Pacer:
    """One sequence's drafting: its index over its own tokens, its acceptance, and the kind of
    match its last draft came from."""

    index: NgramIndex = dataclasses.field(default_factory=NgramIndex)
    acceptance: Acceptance = dataclasses.field(default_factory=lambda: Acceptance(prior=0.5))
    bucket: int = MATCH_BUCKETS[0]


@dataclasses.dataclass
class Candidate:
    """A sequence that decodes this step, with the draft it could verify."""

    seq_id: int
    draft: list[int]
    rate: float  # chance that a drafted token is taken, given the ones before it were
    taken: int = 0  # tokens of ``draft`` the step will verify


class Drafter:
    """Drafts for sequences (``ngram`` or ``suffix``), as long as they pay: a step's draft tokens
    are chosen one at a time, the likeliest next (a sequence's i-th token is taken with its
    acceptance rate to the i-th power), while the tokens it is expected to add raise the step's
    expected tokens per second under the row costs seen so far (``RowCost``). The engine tells
    it what each verification took and what each step cost."""

    def __init__(self, mode: SpeculativeMode, max_tokens: int, outputs: RecentOutputs | None = None) -> None:
        if mode not in ("ngram", "suffix"):
            raise ValueError(f"no drafter for speculative mode {mode!r}")
        self.mode = mode
        self.max_tokens = max_tokens
        self.outputs = outputs if outputs is not None else (RecentOutputs() if mode == "suffix" else None)
        self.costs = RowCost()
        self._declined = 0  # steps in a row whose candidates choose declined
        self._pacers: dict[int, Pacer] = {}
        # acceptance by match length, over every sequence: a sequence's own counts start from it
        self._by_match: dict[int, Acceptance] = {b: Acceptance() for b in (*MATCH_BUCKETS, SHARED_BUCKET)}

    def candidate(self, seq_id: int, tokens: Seq[int], limit: int, root: bytes = b"") -> Candidate | None:
        """What sequence ``seq_id`` (its prompt and output ``tokens``; ``root``: its cache root)
        could draft, at most ``limit`` tokens; None: nothing matches."""
        if limit <= 0:
            return None
        pacer = self._pacers.get(seq_id)
        if pacer is None:
            pacer = self._pacers[seq_id] = Pacer()
        index = pacer.index
        index.extend(tokens, len(tokens) - 1)  # not the n-grams ending the list: they match themselves
        pos, agree = index.match(tokens)
        draft: list[int] = []
        if pos >= 0:
            draft = list(tokens[pos:pos + limit])
            pacer.bucket = _bucket(agree)
        shared = self.outputs.get(root) if self.outputs is not None else None
        weak = pos < 0 or agree < SHARED_OVER_AGREEMENT
        if shared is not None and (len(draft) < limit or weak):
            other = shared.draft(tokens, limit)
            if len(other) > len(draft) or (weak and other):
                draft, pacer.bucket = other, SHARED_BUCKET
        if not draft:
            return None
        prior = self._by_match[pacer.bucket].rate()
        own = pacer.acceptance
        # the sequence's own record weighs in as it grows; the match's kind speaks first
        rate = (own.taken + 2 * prior) / (own.taken + own.missed + 2)
        return Candidate(seq_id, draft, rate)

    def choose(self, candidates: list[Candidate], rows: int, budget: int) -> None:
        """Set ``taken`` of each candidate: the draft tokens worth verifying in a step of ``rows``
        rows without them, ``budget`` tokens at most."""
        base = self.costs.seconds(rows)
        if base is None or not candidates or budget <= 0:
            return
        # Tokens are ranked likeliest first; the step takes the first n of them for the n that
        # gives the most expected tokens a second. Every n is priced, not only up to the first
        # that does not pay: a step's cost is not smooth in its rows (the kernels take rows in
        # pairs and groups), so 4 rows can cost less than 3.
        expected = float(rows)  # tokens the step emits: one a row, plus what drafts add
        best_rate, taken = expected / max(base, 1e-9), 0
        order: list[Candidate] = []
        while len(order) < budget:
            pick = max(candidates, key=lambda c: c.rate ** (c.taken + 1) if c.taken < len(c.draft) else -1.0)
            if pick.taken >= len(pick.draft):
                break
            pick.taken += 1
            order.append(pick)
            expected += pick.rate ** pick.taken
            after = self.costs.seconds(rows + len(order))
            assert after is not None
            if expected / max(after, 1e-9) > best_rate:
                best_rate, taken = expected / max(after, 1e-9), len(order)
        for c in candidates:
            c.taken = 0
        for pick in order[:taken]:
            pick.taken += 1
        if taken:
            self._declined = 0
            return
        # What is never tried is never measured again: a step cost or an acceptance that came out
        # badly once (a noisy minute) would end drafting for good. So now and then, one token.
        self._declined += 1
        if self._declined >= EXPLORE_EVERY:
            self._declined = 0
            max(candidates, key=lambda c: c.rate).taken = 1

    def verified(self, seq_id: int, drafted: int, accepted: int) -> None:
        pacer = self._pacers.get(seq_id)
        if pacer is not None:
            pacer.acceptance.update(drafted, accepted)
            self._by_match[pacer.bucket].update(drafted, accepted)

    def observe(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` decode or draft rows (no prefill) took ``seconds``."""
        self.costs.observe(rows, seconds)

    def finished(self, seq_id: int, output: Seq[int], root: bytes = b"") -> None:
        """The sequence is done: forget it; its output joins its root's shared index (suffix)."""
        self._pacers.pop(seq_id, None)
        if self.outputs is not None and output:
            self.outputs.add(root, output)

    def close(self) -> None:
        """Keep the shared outputs (suffix, with a file)."""
        if self.outputs is not None:
            self.outputs.close()
