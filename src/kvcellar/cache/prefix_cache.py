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
* Hybrid models (``states``, ``cache/state_pool.py``): an admitted sequence also holds a
  live recurrent-state slot and a checkpoint slot. Its cached blocks are reusable only up to a
  boundary where a snapshot of the state was kept: ``admit`` resumes from the longest such
  prefix (restoring the snapshot into the live slot; the blocks after it are computed again),
  ``commit`` records the boundary the step checkpointed and keeps the checkpoint as a snapshot
  when the prompt is done and every ``snapshot_every_blocks`` blocks, ``release`` keeps the
  last one (where a generation ended). Kept snapshots go to the lower tiers that keep them
  (``cache/tiering.py``), and ``admit`` resumes from the furthest boundary whose blocks and
  snapshot are held anywhere: blocks past RAM's and the snapshot (when RAM lacks it) are read
  like any load; if any of them fails to verify, the sequence is admitted again (the tier
  deleted what failed; the next lookup finds less). Without a tier below RAM, a snapshot is
  dropped with the block it ends (``StatePool.discard``).
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
from kvcellar.cache.state_pool import capture_point, history_point
from kvcellar.cache.tiering import LoadPlan, SnapshotLoad
from kvcellar.stats import Stats, counter

if TYPE_CHECKING:
    from kvcellar.cache.state_pool import Snapshot, StatePool
    from kvcellar.cache.tiering import LowerTierLink, PendingLoad

# Lower-tier snapshot lookups an admission makes at any boundary (then only at the boundaries
# every ``snapshot_every_blocks``): a long prefix whose blocks a tier holds without snapshots
# must not cost a lookup per block.
SNAPSHOT_PROBES = 64


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
        snapshot_every_blocks: int = 16,
    ) -> None:
        self.bm = blocks
        self.states = states  # hybrid models: recurrent-state slots and snapshots
        self.snapshot_every_blocks = snapshot_every_blocks
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
        self._history_slots = 0  # held by sequences for the snapshot where their messages end
        self.stats = PrefixCacheStats()
        self.prefetch = Prefetcher(blocks, max_blocks=int(prefetch_pool_fraction * (blocks.num_blocks - 1)),
                                   max_reads=prefetch_max_reads)
        if states is not None:  # evict-only tiers take snapshots RAM drops
            states.on_evict = lambda key, snap: lower.snapshot_evicted(key, snap.block_tokens,
                                                                       lambda: states.export(snap.slot))
            blocks.on_evict = self._block_dropped_with_its_snapshot(blocks.on_evict, states)

    def _block_dropped_with_its_snapshot(self, offer: Callable[[Block], None] | None, states: StatePool
                                         ) -> Callable[[Block], None]:
        """RAM drops a block: offered to the tiers below as before; where no tier holds blocks,
        the snapshot at its end goes with it (nothing can resume there any more). The chain's
        later snapshots follow as their own blocks go, tail first (``BlockManager.release``)."""

        def dropped(block: Block) -> None:
            if offer is not None:
                offer(block)
            if not self.lower.tiers and block.digest is not None:
                states.discard(block.digest)

        return dropped

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
        snap: Snapshot | None = None
        snap_tier: int | None = None
        plan = None
        matched = 0
        if self.enabled:
            digests = seq.digests(n_full, bs)
            hits = self.bm.match(digests, [seq.block_tokens(i, bs) for i in range(n_full)])
            # A hybrid model resumes only where a prompt's prefill ended: wait for all of another's
            # that computes blocks of this prompt (they stay "computing" until its snapshot is kept).
            if (any(d in self._computing for d in digests[:n_full]) if self.states is not None
                    else len(hits) < n_full and digests[len(hits)] in self._computing):
                self.stats.deferred_for_shared_prefix += 1
                return Admission.DEFERRED
            if len(hits) < n_full and self.prefetch.reading(digests[len(hits):]):
                self.stats.deferred_for_prefetch += 1
                return Admission.DEFERRED
            matched = len(hits)
            if self.states is not None:
                hits, snap, plan, snap_tier = self._resumable(seq, hits, digests)
            elif hits and len(hits) * bs == seq.num_tokens:
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
            seq.state_slot = self.states.acquire(zeroed=snap is None and snap_tier is None)
            if snap is not None:
                self.states.copy(snap.slot, seq.state_slot)
            seq.checkpoint_slot = self.states.acquire(zeroed=False)
            seq.checkpoint_tokens = 0
            history = history_point(seq.history_tokens, seq.num_prompt_tokens, bs)
            resume = (len(hits) + (plan.num_blocks if plan is not None else 0)) * bs
            # History slots come out of the snapshots' share: with two slots a sequence held and
            # fewer than ``max_snapshots`` of these, a slot is free or a stored snapshot gives it up.
            if (history is not None and history > resume and self.enabled
                    and self._history_slots < self.states.max_snapshots):
                seq.history_slot = self.states.acquire(zeroed=False)
                seq.history_taken = False
                self._history_slots += 1
        seq.num_computed = len(hits) * bs
        seq.num_registered = len(hits)
        if cow is not None:
            self.copy_block(cow.block_id, seq.blocks[len(hits)].block_id)
            self.bm.release([cow])
            seq.num_computed = seq.num_tokens - 1
        # a hybrid model's blocks cached already (before its snapshot) are no one's to compute
        for i in range(matched if self.states is not None else len(hits), len(digests)):
            self._computing.setdefault(digests[i], seq)
        self.prefetch.admitted(seq)
        snapshot = None
        if snap_tier is not None:
            assert self.states is not None and plan is not None
            end = len(hits) + plan.num_blocks
            snapshot = SnapshotLoad(snap_tier, digests[end - 1], tuple(seq.block_tokens(end - 1, bs)),
                                    self.states.staging())
        if plan is not None and (plan.num_blocks or snapshot is not None):
            span = range(len(hits), len(hits) + plan.num_blocks)
            seq.pending_load = self.lower.start_load(
                plan, [seq.blocks[i] for i in span], [digests[i] for i in span],
                [tuple(seq.block_tokens(i, bs)) for i in span], snapshot)
            self.loading.append(seq)
            return Admission.LOADING
        self._first_admission(seq)
        return Admission.RUNNING

    def _resumable(self, seq: S, hits: list[Block], digests: list[bytes]
                   ) -> tuple[list[Block], Snapshot | None, LoadPlan, int | None]:
        """Where a hybrid model resumes: the furthest block boundary (short of the last prompt
        token, which is always computed) whose blocks are cached in RAM or a lower tier and
        whose snapshot is kept in RAM or a lower tier. Returns the RAM hits before it, RAM's
        snapshot, the plan for its blocks past RAM's, and the tier holding the snapshot when
        RAM does not."""
        assert self.states is not None
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        plan = LoadPlan(())
        lower = self.lower.keeps_snapshots
        if lower and len(hits) < limit:
            plan = self.lower.lookup(digests[len(hits):limit])
        cached = len(hits) + plan.num_blocks
        probes = 0
        for i in range(min(cached, limit), 0, -1):
            snap = self.states.find(digests[i - 1], i * bs)
            tier = None
            if snap is None and lower and (probes < SNAPSHOT_PROBES or i % self.snapshot_every_blocks == 0):
                probes += 1
                tier = self.lower.find_snapshot(digests[i - 1])
            if snap is not None or tier is not None:
                self.states.stats.snapshots_loaded += 1
                self.states.stats.resume_distance_tokens += (cached - i) * bs
                return hits[:i], snap, plan.head(max(0, i - len(hits))), tier
        if cached:
            self.states.stats.snapshots_missed += 1
        return [], None, LoadPlan(()), None

    def _keep_checkpoint(self, seq: S, *, renew: bool) -> None:
        """Hand ``seq``'s checkpoint to the snapshots (if its blocks are published up to it);
        ``renew``: take another checkpoint slot for the steps to come."""
        assert self.states is not None and seq.checkpoint_slot is not None
        tokens, bs = seq.checkpoint_tokens, self.block_size
        if tokens == 0 or seq.num_registered * bs < tokens or not self.enabled:
            return
        self._keep(seq.digests(tokens // bs, bs)[-1], seq.checkpoint_slot, tokens,
                   tuple(seq.block_tokens(tokens // bs - 1, bs)))
        seq.checkpoint_slot = self.states.acquire(zeroed=False) if renew else None
        seq.checkpoint_tokens = 0

    def _keep_history(self, seq: S) -> None:
        """Hand ``seq``'s history snapshot (``history_point``) to the snapshots if the state there
        was taken and its blocks are published, else give its slot back."""
        assert self.states is not None
        if seq.history_slot is None:
            return
        bs = self.block_size
        history = history_point(seq.history_tokens, seq.num_prompt_tokens, bs)
        slot, seq.history_slot = seq.history_slot, None
        self._history_slots -= 1
        if seq.history_taken and history is not None and seq.num_registered * bs >= history and self.enabled:
            n = history // bs
            self._keep(seq.digests(n, bs)[-1], slot, history, tuple(seq.block_tokens(n - 1, bs)))
        else:
            self.states.release(slot)
        seq.history_taken = False

    def _restore(self, seq: S, loaded: SnapshotLoad) -> None:
        """A snapshot read from a lower tier: into ``seq``'s live slot, and kept in RAM (and
        so in the tiers above the one it came from) as a snapshot computed here would be."""
        assert self.states is not None and seq.state_slot is not None
        self.states.restore(seq.state_slot, loaded.dest)
        tokens = seq.num_computed
        if self.states.max_snapshots and self.states.find(loaded.digest, tokens) is None:
            slot = self.states.acquire(zeroed=False)
            self.states.copy(seq.state_slot, slot)
            self._keep(loaded.digest, slot, tokens, loaded.token_ids, loaded.index)

    def _keep(self, digest: bytes, slot: int, tokens: int, block_tokens: tuple[int, ...],
              loaded_from: int | None = None) -> None:
        """Keep the state in ``slot`` as the snapshot keyed by ``digest`` (RAM takes the slot),
        and offer it to the write-through tiers (above ``loaded_from``, one it was read from)."""
        assert self.states is not None
        states = self.states
        if states.store(digest, slot, tokens, block_tokens):
            self.lower.snapshot_kept(digest, block_tokens, lambda: states.export(slot), loaded_from)

    def discard_checkpoints(self, seqs: Iterable[S]) -> None:
        """A forward failed half-way: what it wrote into these sequences' checkpoints is no
        state of theirs, so none is kept."""
        for seq in seqs:
            seq.checkpoint_tokens = 0
            seq.history_taken = False

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
            self.bm.record_lookup(ram, seq.num_tokens // bs)
            self.stats.lower_tier_hit_tokens += seq.num_computed - ram
            self.lower.credit_hits(seq.cached_tokens_by_tier)
        seq.prefetched.clear()

    # ---- reads in flight ------------------------------------------------------------------

    def poll(self) -> tuple[list[S], list[S]]:
        """Finish what the lower tiers have read. Returns the sequences whose loads are over,
        in admission order (they can run now), and those to admit again: loads overdue (given
        up; the tier that hung is no longer asked then) and a hybrid model's loads that were not
        whole (it resumes only where its state is)."""
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
            pending, seq.pending_load = seq.pending_load, None
            if self.states is not None and (n < pending.plan.num_blocks
                                            or (pending.snapshot is not None and not pending.snapshot_ok)):
                self._release(seq, overdue=False)  # a hybrid resumes only where its state is
                again.append(seq)
                continue
            loaded_tiers = pending.block_tiers()
            first = seq.num_registered
            seq.num_computed = min((first + n) * self.block_size, seq.num_tokens - 1)
            # A loaded block whose last token is about to be recomputed is published after
            # that (by commit), not before.
            self._publish(seq, first, seq.num_computed // self.block_size)
            if pending.snapshot is not None:
                self._restore(seq, pending.snapshot)
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
        if self.enabled and self.lower.tiers and self.states is None:
            self.prefetch.start(waiting, self.lower, reserve=reserve, computing=self._computing.__contains__)

    # ---- running sequences ----------------------------------------------------------------

    def missing(self, seq: S, extra: int = 0) -> int:
        """Blocks ``seq`` still needs to hold the KV of all its tokens (and ``extra`` more: a
        draft's)."""
        return -(-(seq.num_tokens + extra) // self.block_size) - len(seq.blocks)

    def grow(self, seq: S, n: int) -> None:
        seq.blocks.extend(self.bm.allocate(n))

    def trim(self, seq: S) -> None:
        """Give back the blocks past ``seq``'s tokens: those a draft's rejected tokens took. They
        were never published (a block is published once its tokens are computed and kept)."""
        surplus = -self.missing(seq)
        if surplus > 0:
            kept = len(seq.blocks) - surplus
            assert kept >= seq.num_registered
            self.bm.release(seq.blocks[kept:])
            del seq.blocks[kept:]

    def commit(self, seq: S, num_computed: int) -> None:
        """``seq``'s KV now covers its first ``num_computed`` tokens: publish full blocks (and,
        on a hybrid model, keep the checkpoint the step took where it is due)."""
        start = seq.num_computed
        seq.num_computed = num_computed
        full = num_computed // self.block_size
        if self.enabled and full > seq.num_registered:
            self._publish(seq, seq.num_registered, full)
        if self.states is not None and seq.checkpoint_slot is not None:
            bs, prompt = self.block_size, seq.num_prompt_tokens
            boundary = capture_point(start, num_computed, prompt, bs)
            if boundary is not None:
                seq.checkpoint_tokens = boundary
            history = history_point(seq.history_tokens, prompt, bs)
            if seq.history_slot is not None and history is not None and start < history <= num_computed:
                if history == boundary:  # the step's one capture went to the checkpoint
                    self.states.copy(seq.checkpoint_slot, seq.history_slot)
                seq.history_taken = True
            prompt_done = start < prompt <= num_computed
            if prompt_done:
                self._keep_history(seq)
            if prompt_done or (boundary is not None and boundary % (self.snapshot_every_blocks * bs) == 0):
                self._keep_checkpoint(seq, renew=True)
            if prompt_done:
                self._stop_computing(seq)

    def _publish(self, seq: S, start: int, end: int) -> None:
        """Register blocks [start, end) of ``seq`` (computed or loaded) for reuse."""
        digests = seq.digests(end, self.block_size)
        for i in range(start, end):
            block = seq.blocks[i]
            # a hybrid model's blocks stay "being computed" until the prompt's snapshot is kept
            if self._computing.get(digests[i]) is seq and self.states is None:
                del self._computing[digests[i]]
            parent = digests[i - 1] if i > 0 else None
            if self.bm.register(block, digests[i], seq.block_tokens(i, self.block_size), parent):
                self.lower.published(block)
        seq.num_registered = max(seq.num_registered, end)

    def release(self, seq: S) -> None:
        """``seq`` gives its blocks back (its published ones stay cached). Those of a
        sequence still loading are held until the tier is done writing into them."""
        self._release(seq, overdue=False)

    def _stop_computing(self, seq: S) -> None:
        for digest, owner in list(self._computing.items()):
            if owner is seq:
                del self._computing[digest]

    def _release(self, seq: S, *, overdue: bool) -> None:
        self._stop_computing(seq)
        if seq in self.loading:
            self.loading.remove(seq)
            assert seq.pending_load is not None
            self._give_up(seq.pending_load, seq.blocks, overdue=overdue)
            seq.pending_load = None
        else:
            self.bm.release(seq.blocks)
        if self.states is not None:
            self._keep_history(seq)
            if seq.checkpoint_slot is not None:
                self._keep_checkpoint(seq, renew=False)  # where a generation ended, or was preempted
            for slot in (seq.state_slot, seq.checkpoint_slot):
                if slot is not None:
                    self.states.release(slot)
            seq.state_slot = seq.checkpoint_slot = None
            seq.checkpoint_tokens = 0
        seq.blocks = []
        seq.num_computed = 0
        seq.num_registered = 0

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
