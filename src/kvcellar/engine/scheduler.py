"""Continuous batching with chunked prefill over the paged KV pool.

Every step the scheduler builds a plan under a token budget: ``max_step_tokens`` while
any sequence is decoding, else the larger ``max_prefill_step_tokens`` (no one is waiting
for a next token, so prefill takes bigger, more efficient chunks):

1. every running sequence that is decoding gets one token (decodes never wait behind a
   prefill); a decode that needs a new block and finds none preempts the most recently
   admitted sequence (its full blocks stay in the prefix cache, so resuming is cheap);
2. sequences in the middle of a prefill continue with a chunk of what budget is left;
3. waiting sequences are admitted in arrival order while budget, sequence slots and
   blocks allow. Admission reuses the longest cached prefix of full blocks (never the
   last prompt token: it is always computed, so there are logits to sample from), and
   reserves blocks for the rest of the prompt up front so a chunked prefill never runs
   out half-way. A sequence whose next block is being computed right now by
   another sequence (same prefix, e.g. ``n > 1`` or concurrent clients sharing a system
   prompt) waits a step or more and then reuses it instead of computing it twice;
4. waiting sequences that were not admitted may start reading their next blocks from a
   lower tier now (prefetch, ``engine/prefetch.py``), into free or least recently used
   cached blocks (never their own RAM prefix) within a cap,
   so the read overlaps this step's compute; the verified blocks are published as
   ordinary cached blocks and admission finds them as RAM hits. A sequence whose prefix
   continues into a read still in flight waits for it, like for a block being computed.

When the RAM tier's prefix ends, the next blocks may sit in lower tiers (``lower``: the
SSD, a remote store): admission then reserves pool blocks, starts loading them and parks the sequence in
LOADING while the engine keeps stepping everyone else; once the tier has verified them
they are published like computed blocks and the prefill goes on from there. A block
that fails to load is simply computed. A sequence cancelled while loading keeps its
blocks until the reader is done with them. A prefetch read (step 4) is the same load
started earlier, for a sequence still waiting; it owns its blocks itself, so the
sequence may be cancelled or admitted meanwhile. Blocks that a prefetch read for a
sequence count, in its ``cached_tokens_by_tier`` and the hit counters, for the tier
they came from, though admission finds them in RAM.

After the forward, ``commit`` advances each sequence and publishes blocks that became
full and computed to the prefix cache (prompt and generated blocks alike).

Threading: not thread-safe; only the engine thread calls in.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcellar.cache.block_manager import Block, BlockManager
from kvcellar.engine.prefetch import Prefetcher
from kvcellar.engine.sequence import SeqState, Sequence

if TYPE_CHECKING:
    from kvcellar.cache.tiering import LoadPlan, LowerTierLink


def _no_copy(src: int, dst: int) -> None:
    raise RuntimeError("this scheduler was built without a copy_block function")


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # tokens computed before this step
    length: int  # tokens fed this step
    sample: bool  # the sequence's last token is fed: sample the next one


@dataclass
class StepPlan:
    decodes: list[Scheduled]
    prefills: list[Scheduled]

    @property
    def items(self) -> list[Scheduled]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.length for s in self.prefills)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_step_tokens: int,
        max_prefill_step_tokens: int = 0,
        prefix_caching: bool = True,
        lower: LowerTierLink | None = None,
        copy_block: Callable[[int, int], None] | None = None,
        prefetch_pool_fraction: float = 0.25,
        prefetch_max_reads: int = 4,
    ) -> None:
        self.bm = blocks
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.max_prefill_step_tokens = max(max_step_tokens, max_prefill_step_tokens)
        self.prefix_caching = prefix_caching
        self.lower = lower
        # Copies one pool block's KV into another (engine-owned storage).
        self.copy_block = copy_block or _no_copy
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # admitted, blocks being read from the lower tier
        self._draining: list[Sequence] = []  # cancelled while loading; freed when the read ends
        # digest -> sequence computing that block right now (prompt blocks not yet published)
        self._inflight: dict[bytes, Sequence] = {}
        self.stats = {
            "sched_preemptions": 0,
            "sched_deferred_for_shared_prefix": 0,
            "sched_admitted": 0,
            "sched_lower_tier_hit_tokens": 0,
        }
        self.prefetch = Prefetcher(blocks, max_blocks=int(prefetch_pool_fraction * (blocks.num_blocks - 1)),
                                   max_reads=prefetch_max_reads, stats=self.stats)

    # ---- queue management -----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.state = SeqState.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self._draining or self.prefetch.reads)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or cancelled) and free its blocks."""
        self.prefetch.forget(seq)  # a read of its prefix goes on, for the prefix cache
        if seq.state == SeqState.LOADING:
            # The tier is still writing into its blocks: free them when the read is over.
            self.loading.remove(seq)
            self._drop_inflight(seq)
            self._draining.append(seq)
            seq.state = SeqState.FINISHED
            return
        if seq.state == SeqState.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq in self.running:
            self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.FINISHED

    def _drop_inflight(self, seq: Sequence) -> None:
        for digest, owner in list(self._inflight.items()):
            if owner is seq:
                del self._inflight[digest]

    def _free(self, seq: Sequence) -> None:
        self._drop_inflight(seq)
        self.bm.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_registered = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.WAITING
        seq.prefetch_checked = False
        self.waiting.appendleft(seq)
        self.stats["sched_preemptions"] += 1

    # ---- planning -------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        if self.loading or self._draining or self.prefetch.reads:
            self._poll_loads()
        decoding = any(not seq.in_prefill for seq in self.running)
        budget = self.max_step_tokens if decoding else self.max_prefill_step_tokens
        decodes: list[Scheduled] = []
        prefills: list[Scheduled] = []

        for seq in list(self.running):
            if seq.in_prefill or seq not in self.running:
                continue
            if not self._ensure_slot(seq, decodes):
                continue
            decodes.append(Scheduled(seq, seq.num_computed, 1, True))
            budget -= 1

        for seq in self.running:
            if budget <= 0:
                break
            if seq.in_prefill:
                prefills.append(self._chunk(seq, budget))
                budget -= prefills[-1].length

        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            seq = self.waiting.popleft()
            admitted = self._admit(seq)
            if admitted is None:  # not enough blocks: keep arrival order, try next step
                self.waiting.appendleft(seq)
                break
            if admitted is False:  # its next block is being computed by another sequence
                skipped.append(seq)
                continue
            if seq.state == SeqState.LOADING:
                continue
            prefills.append(self._chunk(seq, budget))
            budget -= prefills[-1].length
        self.waiting.extendleft(reversed(skipped))
        if self.waiting and self.lower is not None and self.prefix_caching:
            self.prefetch.start(self.waiting, self.lower, reserve=len(self.running),
                                computing=self._inflight.__contains__)

        if not decodes and not prefills:
            return None
        return StepPlan(decodes, prefills)

    def _chunk(self, seq: Sequence, budget: int) -> Scheduled:
        length = min(seq.num_tokens - seq.num_computed, budget)
        start = seq.num_computed
        return Scheduled(seq, start, length, start + length == seq.num_tokens)

    def _ensure_slot(self, seq: Sequence, planned: list[Scheduled]) -> bool:
        """Make room for the KV of token ``num_tokens - 1``; preempt others if needed.
        Returns False if ``seq`` itself had to be preempted."""
        needed = (seq.num_tokens + self.block_size - 1) // self.block_size - len(seq.blocks)
        while needed > self.bm.available():
            victim = self.running[-1]
            self._preempt(victim)
            planned[:] = [p for p in planned if p.seq is not victim]
            if victim is seq:
                return False
        if needed > 0:
            seq.blocks.extend(self.bm.allocate(needed))
        return True

    def _admit(self, seq: Sequence) -> bool | None:
        """Reserve blocks and reuse the cached prefix. None: no room; False: deferred.

        The last token is always computed, to get logits. When the whole prompt is cached
        and ends on a block boundary, the last cached block is copied into a private block
        and only its last token is recomputed there (one token of work instead of a block;
        the shared block is never written)."""
        bs = self.block_size
        n_full = seq.num_tokens // bs
        hits: list[Block] = []
        digests: list[bytes] = []
        cow: Block | None = None
        lower = 0
        plan: LoadPlan | None = None
        if self.prefix_caching:
            digests = seq.digests(n_full, bs)
            tokens = [seq.block_tokens(i, bs) for i in range(n_full)]
            hits = self.bm.match(digests, tokens)
            if len(hits) < n_full and digests[len(hits)] in self._inflight:
                self.stats["sched_deferred_for_shared_prefix"] += 1
                return False
            if len(hits) < n_full and self.prefetch.reading(digests[len(hits):]):
                self.stats["sched_deferred_for_prefetch"] += 1
                return False
            if hits and len(hits) * bs == seq.num_tokens:
                cow = hits.pop()
            elif self.lower is not None and len(hits) < n_full:
                plan = self.lower.lookup(digests[len(hits) : n_full])
                lower = plan.num_blocks
        total = (seq.num_tokens + bs - 1) // bs
        need = total - len(hits)
        # Keep one block per running decode in reserve so admission does not force an
        # immediate preemption.
        reserve = sum(1 for s in self.running if not s.in_prefill)
        held = [*hits, cow] if cow is not None else hits
        seq.hit_tiers = [self._tier_of_hit(seq, b) for b in held]
        available = self.bm.available(held)
        if need > available or (need + reserve > available and (self.running or self.loading)):
            return None
        self.bm.acquire(held)
        if held and self.lower is not None:
            self.lower.touch(digests[: len(held)])
        seq.blocks = hits + self.bm.allocate(need)
        seq.num_computed = len(hits) * bs
        seq.num_registered = len(hits)
        if cow is not None:
            self.copy_block(cow.block_id, seq.blocks[len(hits)].block_id)
            self.bm.release([cow])
            seq.num_computed = seq.num_tokens - 1
        for i in range(len(hits), len(digests)):
            self._inflight.setdefault(digests[i], seq)
        self.stats["sched_admitted"] += 1
        if lower:
            assert self.lower is not None
            first = len(hits)
            span = range(first, first + lower)
            assert plan is not None
            seq.pending_load = self.lower.start_load(
                plan, [seq.blocks[i] for i in span], [digests[i] for i in span],
                [tuple(seq.block_tokens(i, bs)) for i in span])
            seq.state = SeqState.LOADING
            self.loading.append(seq)
            return True
        self._start_running(seq)
        return True

    @staticmethod
    def _tier_of_hit(seq: Sequence, block: Block) -> str:
        """A RAM hit on a block prefetched for ``seq`` counts for the tier it was read from."""
        tier = seq.prefetched.get(block.digest) if block.digest is not None else None
        return tier if tier is not None and block.loaded_from else "ram"

    def _start_running(self, seq: Sequence, loaded_tiers: list[str] | None = None) -> None:
        if seq.num_cached_tokens is None:  # first admission (not a resumption after preemption)
            bs = self.block_size
            seq.num_cached_tokens = seq.num_computed
            seq.cached_tokens_by_tier = _split_by_tier([*seq.hit_tiers, *(loaded_tiers or ())],
                                                       seq.num_computed, bs)
            ram = seq.cached_tokens_by_tier["ram"]
            self.bm.record_lookup(-(-ram // bs), seq.num_tokens // bs)
            self.stats["sched_lower_tier_hit_tokens"] += seq.num_computed - ram
        seq.prefetched.clear()
        seq.state = SeqState.RUNNING
        self.running.append(seq)

    def _poll_loads(self) -> None:
        assert self.lower is not None
        if self.prefetch.reads:
            self.prefetch.poll(self.lower)
        for seq in list(self.loading):
            n = self.lower.finish_load(seq.pending_load)
            if n is None:
                continue
            self.loading.remove(seq)
            first = seq.num_registered
            loaded_tiers = seq.pending_load.block_tiers()
            seq.pending_load = None
            done = first + n
            seq.num_computed = min(done * self.block_size, seq.num_tokens - 1)
            # A loaded block whose last token is about to be recomputed is published after
            # that (by commit), not before.
            self._publish(seq, first, seq.num_computed // self.block_size)
            self._start_running(seq, loaded_tiers)
        for seq in list(self._draining):
            if self.lower.finish_load(seq.pending_load) is not None:
                self._draining.remove(seq)
                seq.pending_load = None
                self.bm.release(seq.blocks)
                seq.blocks = []

    def _publish(self, seq: Sequence, start: int, end: int) -> None:
        """Register blocks [start, end) of ``seq`` (computed or loaded) for reuse."""
        digests = seq.digests(end, self.block_size)
        for i in range(start, end):
            block = seq.blocks[i]
            if self._inflight.get(digests[i]) is seq:
                del self._inflight[digests[i]]
            parent = digests[i - 1] if i > 0 else None
            if self.bm.register(block, digests[i], seq.block_tokens(i, self.block_size), parent) and \
                    self.lower is not None:
                self.lower.published(block)
        seq.num_registered = max(seq.num_registered, end)

    # ---- after the forward ----------------------------------------------------------------

    def commit(self, item: Scheduled) -> None:
        """Advance ``item.seq`` past the tokens computed this step; publish full blocks."""
        seq = item.seq
        seq.num_computed = item.start + item.length
        if self.prefix_caching:
            full = seq.num_computed // self.block_size
            if full > seq.num_registered:
                self._publish(seq, seq.num_registered, full)


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
