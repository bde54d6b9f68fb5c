"""The prefix cache: what a sequence reuses, reserves, loads and publishes.

The scheduler decides who runs (budgets, sequence slots, preemption); this layer decides
what each admitted sequence's KV is made of, over the RAM tier (``BlockManager``) and the
tiers below it (``LowerTierLink``), the way vLLM v1 pairs a block pool with a KV-cache
manager. Its verbs, all in the block vocabulary of one sequence:

* ``admit``: reuse the longest cached prefix of full blocks and reserve blocks for the rest
  of the prompt, up front, so a chunked prefill never runs out half-way. Answers with an
  ``Admission``:
  - ``RUNNING``: compute the rest now;
  - ``LOADING``: the next blocks sit in a lower tier; they are being read straight into the
    reserved blocks while the engine steps everyone else (``poll`` says when they are in);
  - ``DEFERRED``: its next block is being computed right now by another sequence, or read
    by a prefetch (same prefix: ``n > 1``, concurrent clients sharing a system prompt):
    wait a step or more and reuse it instead of computing or reading it twice;
  - ``NO_ROOM``: not enough blocks now; nothing was taken.
  The last prompt token is always computed, to get logits: when the whole prompt is cached
  and ends on a block boundary, the last cached block is copied into a private block and
  only its last token is recomputed there (the shared block is never written).
* ``poll``: loads that are over. The leading run every tier verified is published like
  computed blocks; a block that failed to load (and every one after it) is computed.
  Returns the sequences that can run now. Also ends prefetch reads (``cache/prefetch.py``)
  and frees the blocks of sequences cancelled while loading, once their reader is done.
* ``commit``: after a forward, publish the blocks that became full and computed (prompt
  and generated blocks alike) for reuse.
* ``grow``/``missing``: blocks for the next decode token; ``release``: a sequence is done
  with its blocks (finished, cancelled, preempted: its published blocks stay cached).
* Hybrid models (``states``): an admitted sequence also holds a recurrent-state slot
  (``cache/state_pool.py``), zeroed, which ``release`` takes back.
* ``prefetch``: reads for sequences that still wait, within a cap (``cache/prefetch.py``).

What it keeps of each sequence is the counters documented on ``engine.sequence.Sequence``
(``blocks``, ``num_computed``, ``num_registered``, ``num_cached_tokens``, ...), which it is
the only writer of; ``CachedSequence`` (``cache/cached_sequence.py``) names the part it
uses, so this package does not import the engine.

Counters: ``PrefixCacheStats``, exported under the scheduler's prefix (``sched_*``: they
predate this layer and dashboards use them).

Threading: not thread-safe; only the engine thread calls in.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from kvcellar.cache.block_manager import Block, BlockManager
from kvcellar.cache.cached_sequence import CachedSequence
from kvcellar.cache.prefetch import Prefetcher
from kvcellar.stats import Stats, counter

if TYPE_CHECKING:
    from kvcellar.cache.state_pool import StatePool
    from kvcellar.cache.tiering import LowerTierLink, PendingLoad


class Admission(enum.Enum):
    RUNNING = "running"
    LOADING = "loading"
    DEFERRED = "deferred"
    NO_ROOM = "no_room"


S = TypeVar("S", bound=CachedSequence)


def _no_copy(src: int, dst: int) -> None:
    raise RuntimeError("this prefix cache was built without a copy_block function")


@dataclass
class PrefixCacheStats(Stats):
    PREFIX: ClassVar[str] = "sched_"
    deferred_for_shared_prefix: int = counter()  # admissions that waited for a block another sequence computes
    deferred_for_prefetch: int = counter()  # admissions that waited for a prefetch read
    lower_tier_hit_tokens: int = counter()  # prompt tokens read from any tier below RAM


class PrefixCache(Generic[S]):
    """Over sequences of type ``S`` (the engine's ``Sequence``)."""

    def __init__(
        self,
        blocks: BlockManager,
        lower: LowerTierLink,
        *,
        enabled: bool = True,
        copy_block: Callable[[int, int], None] | None = None,
        prefetch_pool_fraction: float = 0.25,
        prefetch_max_reads: int = 4,
        states: StatePool | None = None,
    ) -> None:
        self.bm = blocks
        self.states = states  # hybrid models: a recurrent-state slot per admitted sequence
        self.block_size = blocks.block_size
        self.enabled = enabled  # off: no reuse at all (comparisons and tests)
        self.lower = lower  # the tiers below RAM (maybe none)
        self.copy_block = copy_block or _no_copy  # one pool block's KV into another (engine-owned storage)
        self.loading: list[S] = []  # admitted; blocks being read from a lower tier
        # Loads given up on (cancelled, or overdue: then not counted by ``busy``, which must
        # end): their blocks are freed when the tiers are done writing into them.
        self._draining: list[PendingLoad] = []
        self._abandoned: list[PendingLoad] = []
        # digest -> the sequence computing that block right now (reserved, not yet published)
        self._computing: dict[bytes, S] = {}
        self.stats = PrefixCacheStats()
        self.prefetch = Prefetcher(blocks, max_blocks=int(prefetch_pool_fraction * (blocks.num_blocks - 1)),
                                   max_reads=prefetch_max_reads)

    def busy(self) -> bool:
        """Reads in flight (loads, prefetches, or cancelled loads still writing into the pool)."""
        return bool(self.loading or self._draining or self.prefetch.reads)

    def _give_up(self, pending: PendingLoad, blocks: list[Block], *, overdue: bool) -> None:
        (self._abandoned if overdue else self._draining).append(pending)
        pending.blocks = blocks  # every block to free once settled (the sequence's RAM hits too)

    def available(self) -> int:
        return self.bm.available()

    # ---- admission ------------------------------------------------------------------------

    def admit(self, seq: S, *, reserve: int, crowded: bool) -> Admission:
        """Reuse ``seq``'s cached prefix and reserve the blocks for the rest of its prompt.
        ``reserve``: blocks to leave free (one per running decode, so that admitting does not
        force an immediate preemption); honoured only when ``crowded`` (others are running
        or loading: alone, a sequence may take every block)."""
        bs = self.block_size
        n_full = seq.num_tokens // bs
        hits: list[Block] = []
        digests: list[bytes] = []
        cow: Block | None = None
        plan = None
        if self.enabled:
            digests = seq.digests(n_full, bs)
            hits = self.bm.match(digests, [seq.block_tokens(i, bs) for i in range(n_full)])
            if len(hits) < n_full and digests[len(hits)] in self._computing:
                self.stats.deferred_for_shared_prefix += 1
                return Admission.DEFERRED
            if len(hits) < n_full and self.prefetch.reading(digests[len(hits):]):
                self.stats.deferred_for_prefetch += 1
                return Admission.DEFERRED
            if hits and len(hits) * bs == seq.num_tokens:
                cow = hits.pop()
            elif len(hits) < n_full:
                plan = self.lower.lookup(digests[len(hits):n_full])
        need = -(-seq.num_tokens // bs) - len(hits)
        held = [*hits, cow] if cow is not None else hits
        available = self.bm.available(held)
        if need > available or (crowded and need + reserve > available):
            return Admission.NO_ROOM
        self.bm.acquire(held)
        if held:
            self.lower.touch(digests[:len(held)])
        seq.hit_tiers = [self._tier_of_hit(seq, b) for b in held]
        seq.blocks = hits + self.bm.allocate(need)
        if self.states is not None:
            seq.state_slot = self.states.acquire()
        seq.num_computed = len(hits) * bs
        seq.num_registered = len(hits)
        if cow is not None:
            self.copy_block(cow.block_id, seq.blocks[len(hits)].block_id)
            self.bm.release([cow])
            seq.num_computed = seq.num_tokens - 1
        for i in range(len(hits), len(digests)):
            self._computing.setdefault(digests[i], seq)
        self.prefetch.admitted(seq)
        if plan is not None and plan.num_blocks:
            span = range(len(hits), len(hits) + plan.num_blocks)
            seq.pending_load = self.lower.start_load(
                plan, [seq.blocks[i] for i in span], [digests[i] for i in span],
                [tuple(seq.block_tokens(i, bs)) for i in span])
            self.loading.append(seq)
            return Admission.LOADING
        self._first_admission(seq)
        return Admission.RUNNING

    @staticmethod
    def _tier_of_hit(seq: CachedSequence, block: Block) -> str:
        """A RAM hit on a block prefetched for ``seq`` counts for the tier it was read from."""
        tier = seq.prefetched.get(block.digest) if block.digest is not None else None
        return tier if tier is not None and block.loaded_from else "ram"

    def _first_admission(self, seq: CachedSequence, loaded_tiers: Iterable[str] = ()) -> None:
        """Credit the reused prompt tokens, per tier, once per request (a resumption after
        preemption reuses its own blocks, which is not a cache hit to report)."""
        if seq.num_cached_tokens is None:
            bs = self.block_size
            seq.num_cached_tokens = seq.num_computed
            seq.cached_tokens_by_tier = _split_by_tier([*seq.hit_tiers, *loaded_tiers], seq.num_computed, bs)
            ram = seq.cached_tokens_by_tier["ram"]
            self.bm.record_lookup(-(-ram // bs), seq.num_tokens // bs)
            self.stats.lower_tier_hit_tokens += seq.num_computed - ram
            self.lower.credit_hits(seq.cached_tokens_by_tier)
        seq.prefetched.clear()

    # ---- reads in flight ------------------------------------------------------------------

    def poll(self) -> tuple[list[S], list[S]]:
        """Finish what the lower tiers have read. Returns the sequences whose loads are over,
        in admission order (they can run now), and those whose loads are overdue (given up:
        they wait to be admitted again, when the tier that hung is no longer asked)."""
        lower = self.lower
        if not (self.busy() or self._abandoned or self.prefetch.abandoned):
            return [], []
        self.prefetch.poll(lower)
        ready, again = [], []
        for seq in list(self.loading):
            assert seq.pending_load is not None  # set by admit() before it joins ``loading``
            n = lower.finish_load(seq.pending_load)
            if n is None:
                if lower.overdue(seq.pending_load):
                    self._release(seq, overdue=True)
                    again.append(seq)
                continue
            self.loading.remove(seq)
            loaded_tiers = seq.pending_load.block_tiers()
            seq.pending_load = None
            first = seq.num_registered
            seq.num_computed = min((first + n) * self.block_size, seq.num_tokens - 1)
            # A loaded block whose last token is about to be recomputed is published after
            # that (by commit), not before.
            self._publish(seq, first, seq.num_computed // self.block_size)
            self._first_admission(seq, loaded_tiers)
            ready.append(seq)
        for pending in list(self._draining):
            if lower.overdue(pending):
                self._draining.remove(pending)
                self._abandoned.append(pending)
        for queue in (self._draining, self._abandoned):
            for pending in list(queue):
                if pending.settled:
                    queue.remove(pending)
                    self.bm.release(pending.blocks)
        return ready, again

    def prefetch_for(self, waiting: Iterable[S], *, reserve: int) -> None:
        """Start lower-tier reads for sequences still waiting (``cache/prefetch.py``)."""
        if self.enabled and self.lower.tiers:
            self.prefetch.start(waiting, self.lower, reserve=reserve, computing=self._computing.__contains__)

    # ---- running sequences ----------------------------------------------------------------

    def missing(self, seq: S) -> int:
        """Blocks ``seq`` still needs to hold the KV of all its tokens."""
        return -(-seq.num_tokens // self.block_size) - len(seq.blocks)

    def grow(self, seq: S, n: int) -> None:
        seq.blocks.extend(self.bm.allocate(n))

    def commit(self, seq: S, num_computed: int) -> None:
        """``seq``'s KV now covers its first ``num_computed`` tokens: publish full blocks."""
        seq.num_computed = num_computed
        full = num_computed // self.block_size
        if self.enabled and full > seq.num_registered:
            self._publish(seq, seq.num_registered, full)

    def _publish(self, seq: S, start: int, end: int) -> None:
        """Register blocks [start, end) of ``seq`` (computed or loaded) for reuse."""
        digests = seq.digests(end, self.block_size)
        for i in range(start, end):
            block = seq.blocks[i]
            if self._computing.get(digests[i]) is seq:
                del self._computing[digests[i]]
            parent = digests[i - 1] if i > 0 else None
            if self.bm.register(block, digests[i], seq.block_tokens(i, self.block_size), parent):
                self.lower.published(block)
        seq.num_registered = max(seq.num_registered, end)

    def release(self, seq: S) -> None:
        """``seq`` gives its blocks back (its published ones stay cached). Those of a
        sequence still loading are held until the tier is done writing into them."""
        self._release(seq, overdue=False)

    def _release(self, seq: S, *, overdue: bool) -> None:
        for digest, owner in list(self._computing.items()):
            if owner is seq:
                del self._computing[digest]
        if seq in self.loading:
            self.loading.remove(seq)
            assert seq.pending_load is not None
            self._give_up(seq.pending_load, seq.blocks, overdue=overdue)
            seq.pending_load = None
        else:
            self.bm.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_registered = 0
        if seq.state_slot is not None and self.states is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None

    def forget(self, seq: S) -> None:
        """``seq`` is gone (finished or cancelled): release it; a prefetch read of its
        prefix goes on, for the prefix cache only."""
        self.prefetch.forget(seq)
        self.release(seq)


def _split_by_tier(block_tiers: list[str], cached_tokens: int, block_size: int) -> dict[str, int]:
    """Cached prompt tokens per tier ("ram" always present), from the tier of each leading
    block. The last cached block may be partly recomputed (the last prompt token always
    is): its tier is credited with the tokens actually reused."""
    split = {"ram": 0}
    for i, name in enumerate(block_tiers):
        n = min(block_size, cached_tokens - i * block_size)
        if n <= 0:
            break
        split[name] = split.get(name, 0) + n
    return split
