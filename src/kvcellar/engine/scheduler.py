"""Continuous batching with chunked prefill over the paged KV pool.

Every step the scheduler builds a plan under a token budget: ``max_step_tokens`` while
any sequence is decoding, else the larger ``max_prefill_step_tokens`` (no one is waiting
for a next token, so prefill takes bigger, more efficient chunks):

1. sequences whose lower-tier loads are over join the running batch;
2. every running sequence that is decoding gets one token (decodes never wait behind a
   prefill); a decode that needs a new block and finds none preempts the most recently
   admitted sequence of the tenant holding the most blocks (its full blocks stay in the
   prefix cache, so resuming is cheap);
3. sequences in the middle of a prefill continue with a chunk of what budget is left, the
   one with the fewest tokens left first; while a slot is free and the next waiting prompt is
   shorter than a running prefill's rest, up to half the budget is kept for admitting it, so
   a short request behind a long prompt starts at once;
4. waiting sequences are admitted in arrival order while budget and sequence slots allow
   and the prefix cache finds them room (``cache/prefix_cache.py``: what a sequence reuses,
   reserves and loads is decided there; the scheduler acts on the ``Admission`` it gets
   back). With several tenants (API keys) waiting, the next is the earliest of the tenant
   with the fewest sequences admitted, so one key's backlog does not hold another's
   requests behind it. A deferred sequence (its next block is being computed or read by
   another) keeps its place for the next step; one with no room stops admission, to keep
   the order;
5. waiting sequences that were not admitted may start reading their next blocks from a
   lower tier now (prefetch, ``cache/prefetch.py``), so the read overlaps this step's
   compute.

After the forward, ``commit`` advances each sequence; the prefix cache publishes blocks
that became full and computed.

Threading: not thread-safe; only the engine thread calls in.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from kvcellar.cache.block_manager import BlockManager
from kvcellar.cache.prefix_cache import Admission, PrefixCache
from kvcellar.cache.state_pool import StatePool
from kvcellar.cache.tiering import LowerTierLink
from kvcellar.engine.config import STEP_DRAFT_TOKENS, EngineConfig
from kvcellar.engine.sequence import SeqState, Sequence
from kvcellar.engine.speculation import Candidate, Drafter
from kvcellar.stats import Stats, counter


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # tokens computed before this step
    length: int  # tokens fed this step
    sample: bool  # the sequence's last token is fed: sample the next one
    # Speculative decoding: tokens drafted to follow the last one, fed after it (``length`` is
    # 1 + their count); every row is sampled, and the engine keeps those the model agrees with.
    draft: tuple[int, ...] = ()
    # A hybrid model's verification: the state slot that keeps the state before it
    # (``StatePool.take_verify_slot``), to rewind to the last row the model agrees with.
    state_before: int | None = None

    @property
    def rows(self) -> int:
        """Rows of logits this item gets."""
        return self.length if self.draft else int(self.sample)


@dataclass
class StepPlan:
    decodes: list[Scheduled]
    prefills: list[Scheduled]
    verifies: list[Scheduled] = field(default_factory=list)  # decodes with a draft (``Scheduled.draft``)

    @property
    def items(self) -> list[Scheduled]:
        """In the order of the packed step and its logits: decodes, verifies, prefills."""
        return self.decodes + self.verifies + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.length for s in self.verifies) + sum(s.length for s in self.prefills)

    def only(self, keep: Callable[[Scheduled], bool]) -> StepPlan:
        """The plan of the items ``keep`` says, each in its kind."""
        return StepPlan([i for i in self.decodes if keep(i)], [i for i in self.prefills if keep(i)],
                        [i for i in self.verifies if keep(i)])


@dataclass
class SchedulerStats(Stats):
    PREFIX: ClassVar[str] = "sched_"
    preemptions: int = counter()
    admitted: int = counter()


class Scheduler:
    """``config``: the engine's; its batch bounds, budgets and prefetch limits are read here.
    ``states``: a hybrid model's recurrent-state pool (slots per admitted sequence, snapshots:
    the prefix cache's to manage)."""

    def __init__(
        self,
        blocks: BlockManager,
        lower: LowerTierLink,
        config: EngineConfig,
        copy_block: Callable[[int, int], None] | None = None,
        states: StatePool | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_step_tokens = config.max_step_tokens
        self.max_prefill_step_tokens = max(config.max_step_tokens, config.max_prefill_step_tokens)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        # The sequence ``schedule`` is acting on (admitting, growing), for the engine to fail
        # if an exception escapes; None between sequences.
        self.in_hand: Sequence | None = None
        self.cache: PrefixCache[Sequence] = PrefixCache(
            blocks, lower, enabled=config.prefix_caching, copy_block=copy_block,
            prefetch_pool_fraction=config.prefetch_pool_fraction, prefetch_max_reads=config.prefetch_max_reads,
            states=states, snapshot_every_blocks=config.snapshot_every_blocks)
        # Speculative decoding (engine/speculation.py): None when off.
        self.drafter = drafter

    @property
    def loading(self) -> list[Sequence]:
        """Admitted sequences whose blocks a lower tier is reading (held by the cache)."""
        return self.cache.loading

    # ---- queue management -----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.state = SeqState.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cache.busy())

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or cancelled); the cache takes its blocks back."""
        if seq.state == SeqState.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq in self.running:
            self.running.remove(seq)
        self.cache.forget(seq)
        seq.state = SeqState.FINISHED
        if self.drafter is not None:
            self.drafter.finished(seq.seq_id, seq.output_ids, seq.root)

    def preempt(self, seq: Sequence) -> None:
        """Put running ``seq`` back at the head of the queue, its blocks and state given back: it
        is computed again from what the prefix cache keeps (a hybrid's last snapshot)."""
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq)
        seq.state = SeqState.WAITING
        seq.prefetch_checked = False
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _run(self, seq: Sequence) -> None:
        seq.state = SeqState.RUNNING
        self.running.append(seq)

    # ---- planning -------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        self.in_hand = None
        ready, again = self.cache.poll()
        for seq in ready:
            self._run(seq)
        # a load that hung (admitted again first, without that tier), or a hybrid model's that was
        # not whole (admitted again from what the tiers still hold)
        for seq in reversed(again):
            seq.state = SeqState.WAITING
            seq.prefetch_checked = False
            self.waiting.appendleft(seq)
        decoding = any(not seq.in_prefill for seq in self.running)
        budget = self.max_step_tokens if decoding else self.max_prefill_step_tokens
        decodes: list[Scheduled] = []
        verifies: list[Scheduled] = []
        prefills: list[Scheduled] = []

        for seq in list(self.running):
            if seq.in_prefill or seq not in self.running:
                continue
            self.in_hand = seq
            if not self._ensure_slot(seq, decodes):
                continue
            decodes.append(Scheduled(seq, seq.num_computed, 1, True))
            budget -= 1
        if self.drafter is not None and decodes:
            decodes, verifies = self._drafts(decodes, min(STEP_DRAFT_TOKENS, budget))
            budget -= sum(len(v.draft) for v in verifies)
        self.in_hand = None

        admitted = collections.Counter(s.tenant for s in itertools.chain(self.running, self.loading))
        prefilling = sorted((s for s in self.running if s.in_prefill), key=lambda s: s.num_tokens - s.num_computed)
        kept = self._admission_reserve(budget, prefilling, admitted)
        budget = self._continue_prefills(prefilling, prefills, budget, kept)

        deferred: list[Sequence] = []
        try:
            while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
                at = self._next_waiting(admitted)
                seq = self.in_hand = self.waiting[at]
                del self.waiting[at]
                reserve = sum(1 for s in self.running if not s.in_prefill)
                admission = self.cache.admit(seq, reserve=reserve, crowded=bool(self.running or self.loading))
                if admission is Admission.NO_ROOM:  # keep the order, try next step
                    self.waiting.insert(at, seq)
                    break
                if admission is Admission.DEFERRED:
                    deferred.append(seq)
                    continue
                self.stats.admitted += 1
                admitted[seq.tenant] += 1
                if admission is Admission.LOADING:
                    seq.state = SeqState.LOADING
                    continue
                self._run(seq)
                prefills.append(self._chunk(seq, budget))
                budget -= prefills[-1].length
            self.in_hand = None
        finally:  # an exception is the sequence in hand's alone: the deferred keep their place
            self.waiting.extendleft(reversed(deferred))
        if kept and budget > 0:  # what admission left (no room, a load, a shorter prompt) goes back
            budget = self._continue_prefills(prefilling, prefills, budget)
        if self.waiting:
            self.cache.prefetch_for(self.waiting, reserve=len(self.running))

        if not decodes and not prefills and not verifies:
            return None
        return StepPlan(decodes, prefills, verifies)

    def _continue_prefills(self, prefilling: list[Sequence], prefills: list[Scheduled], budget: int,
                           kept: int = 0) -> int:
        """Chunks for ``prefilling`` (fewest tokens left first) within ``budget`` less ``kept``,
        growing those already in ``prefills``; returns the budget left."""
        given = {item.seq.seq_id: i for i, item in enumerate(prefills)}
        for seq in prefilling:
            if budget - kept <= 0:
                break
            i = given.get(seq.seq_id)
            had = 0 if i is None else prefills[i].length
            more = min(budget - kept, seq.num_tokens - seq.num_computed - had)
            if more <= 0:
                continue
            item = self._chunk(seq, had + more)
            if i is None:
                prefills.append(item)
            else:
                prefills[i] = item
            budget -= more
        return budget

    def _admission_reserve(self, budget: int, prefilling: list[Sequence],
                           admitted: collections.Counter[str | None]) -> int:
        """The step's tokens kept from running prefills for the sequence admitted next: while a
        slot is free and its prompt is shorter than what a running prefill has left, up to half
        the budget, so it starts now instead of after the long prefill (which keeps the rest)."""
        if not prefilling or not self.waiting or len(self.running) + len(self.loading) >= self.max_num_seqs:
            return 0
        prompt = self.waiting[self._next_waiting(admitted)].num_tokens
        longest = prefilling[-1].num_tokens - prefilling[-1].num_computed
        return min(budget // 2, prompt) if prompt < longest else 0

    def _next_waiting(self, admitted: collections.Counter[str | None]) -> int:
        """Where in ``waiting`` the next sequence to admit is: the first of the tenant with the
        fewest sequences admitted (the head when one tenant waits)."""
        best, fewest = 0, -1
        seen: set[str | None] = set()
        for i, seq in enumerate(self.waiting):
            if seq.tenant in seen:
                continue
            seen.add(seq.tenant)
            n = admitted[seq.tenant]
            if fewest < 0 or n < fewest:
                best, fewest = i, n
                if n == 0:
                    break
        return best

    def _drafts(self, decodes: list[Scheduled], budget: int) -> tuple[list[Scheduled], list[Scheduled]]:
        """The decodes that verify a draft this step (engine/speculation.py chooses which, and how
        much of it, within ``budget`` tokens), each grown by the blocks it needs: a draft never
        preempts, it is cut to the room free blocks leave. Returns (decodes, verifies)."""
        drafter = self.drafter
        assert drafter is not None
        candidates: dict[int, tuple[Scheduled, Candidate]] = {}
        for item in decodes:
            seq = item.seq
            most = min(drafter.max_tokens, seq.params.max_tokens - (seq.num_tokens - seq.num_prompt_tokens) - 1)
            found = drafter.candidate(seq.seq_id, seq.token_ids, most, seq.root)
            if found is not None and seq.constraint is not None:  # only what the grammar allows is worth verifying
                del found.draft[seq.constraint.valid_prefix(found.draft):]
            if found is not None and found.draft:
                candidates[id(item)] = (item, found)
        if not candidates:
            return decodes, []
        states = self.cache.states
        drafter.choose([c for _, c in candidates.values()], len(decodes), budget)
        plain: list[Scheduled] = []
        verifies: list[Scheduled] = []
        bs = self.cache.block_size
        for item in decodes:
            seq = item.seq
            taken = candidates[id(item)][1].taken if id(item) in candidates else 0
            if taken:
                room = len(seq.blocks) * bs - seq.num_tokens + self.cache.available() * bs
                taken = min(taken, room)
            if not taken:
                plain.append(item)
                continue
            # a hybrid's verification keeps the state before it in a slot; none left: a plain decode
            before = states.take_verify_slot() if states is not None else None
            if states is not None and before is None:
                plain.append(item)
                continue
            draft = tuple(candidates[id(item)][1].draft[:taken])
            needed = self.cache.missing(seq, extra=len(draft))
            if needed > 0:
                self.cache.grow(seq, needed)
            verifies.append(Scheduled(seq, item.start, 1 + len(draft), True, draft, before))
        return plain, verifies

    def _chunk(self, seq: Sequence, budget: int) -> Scheduled:
        length = min(seq.num_tokens - seq.num_computed, budget)
        start = seq.num_computed
        return Scheduled(seq, start, length, start + length == seq.num_tokens)

    def _ensure_slot(self, seq: Sequence, planned: list[Scheduled]) -> bool:
        """Make room for the KV of token ``num_tokens - 1``; preempt others if needed.
        Returns False if ``seq`` itself had to be preempted."""
        needed = self.cache.missing(seq)
        while needed > self.cache.available():
            victim = self._victim()
            self._preempt(victim)
            planned[:] = [p for p in planned if p.seq is not victim]
            if victim is seq:
                return False
        if needed > 0:
            self.cache.grow(seq, needed)
        return True

    def _victim(self) -> Sequence:
        """The sequence to preempt: the most recently admitted of the tenant holding the most
        blocks (the most recently admitted when one tenant runs), so a tenant short of room
        takes it from its own backlog before another's."""
        held: collections.Counter[str | None] = collections.Counter()
        for seq in self.running:
            held[seq.tenant] += len(seq.blocks)
        tenant = max(held, key=held.__getitem__)
        return next(seq for seq in reversed(self.running) if seq.tenant == tenant)

    # ---- after the forward ----------------------------------------------------------------

    def commit(self, item: Scheduled) -> None:
        """Advance ``item.seq`` past the tokens computed this step."""
        self.cache.commit(item.seq, item.start + item.length)
