"""Prefetch: lower-tier reads for sequences that are still waiting in the queue.

A sequence that is not admitted this step (no sequence slot, no token budget, no room)
waits. If the blocks right after its RAM-tier prefix sit in a lower tier, the prefix
cache (``cache/prefix_cache.py``) starts reading them now, into free pool blocks, so the
read overlaps the other sequences' compute instead of following the wait. Once the tier has verified them they
are published into the RAM prefix cache as ordinary cached blocks (registered,
``ref_count == 0``, evictable, promoted into faster tiers like any loaded block), and
admission later finds them as a plain RAM hit. The sequence remembers which tier each of
them came from, so its ``cached_tokens_by_tier`` and the RAM/lower-tier hit counters
credit the tier that served them, not the RAM tier.

Bounds, so that a prefetch never takes what admitted sequences need:

* blocks come from the free list first, then from the least recently used cached blocks
  nobody references (a long-running server's pool is full of those; it is what admission
  would evict for the same request a little later), but never from the RAM prefix of the
  sequence being prefetched nor from blocks already prefetched for sequences that still
  wait (both are held while the read's blocks are allocated);
* ``reserve`` blocks stay untouched (the scheduler passes one per running sequence, for
  its next decode block);
* at most ``max_blocks`` pool blocks (``EngineConfig.prefetch_pool_fraction`` of the pool)
  are being read into or sit prefetched for sequences that still wait, by at most
  ``max_reads`` reads in flight (``EngineConfig.prefetch_max_reads``); a prefix longer
  than what is left is read in part, and admission loads the rest. So a long queue of
  disk hits cannot churn more than that fraction of the RAM tier;
* each waiting sequence is looked up once per wait (a remote lookup is a round trip on
  the engine thread), front of the queue first, at most ``max_reads`` lookups per step.

A read belongs to the pool, not to its sequence, which may be admitted, preempted,
cancelled or finish while the read is in flight: the read holds its blocks until the
tier is done with them, whatever happens to the sequence, then publishes the verified
ones (valid KV: a cancelled request's prefix still serves the next one) and releases the
rest. A block that fails to load, and every block after it, is released unpublished and
computed later. While a read is in flight, a sequence whose prefix continues into its
keys is not admitted (``reading``; admission defers it a step, as it does for a block
another sequence is computing): it waits for the read instead of reading the same keys
again into other blocks.

Counters: ``PrefetchStats`` (exported as ``sched_prefetch_reads``, ``sched_prefetched_blocks``).

Threading: not thread-safe; only the engine thread calls in (through the prefix cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvcellar.cache.block_manager import Block, BlockManager
from kvcellar.cache.cached_sequence import CachedSequence
from kvcellar.stats import Stats, counter

if TYPE_CHECKING:
    from kvcellar.cache.tiering import LowerTierLink, PendingLoad


@dataclass(eq=False)
class PrefetchRead:
    """One read in flight: blocks ``first..first+len(blocks)`` of ``seq``'s prompt."""

    seq: CachedSequence | None  # None once the sequence is gone (cancelled, finished)
    first: int
    digests: list[bytes]
    token_blocks: list[tuple[int, ...]]
    parent: bytes | None  # digest of block ``first - 1`` (None: the chain's first block)
    blocks: list[Block]  # referenced by the read until it is over
    pending: PendingLoad


@dataclass
class PrefetchStats(Stats):
    PREFIX: ClassVar[str] = "sched_"  # the names dashboards know, from when the scheduler counted them
    prefetch_reads: int = counter()  # reads started
    prefetched_blocks: int = counter()  # blocks verified by a prefetch read


class Prefetcher:
    def __init__(self, blocks: BlockManager, *, max_blocks: int, max_reads: int) -> None:
        self.bm = blocks
        self.block_size = blocks.block_size
        self.max_blocks = max(0, max_blocks)
        self.max_reads = max(0, max_reads)
        self.reads: list[PrefetchRead] = []
        self.abandoned: list[PrefetchRead] = []  # overdue reads: blocks held until the tiers are done
        self._by_digest: dict[bytes, PrefetchRead] = {}
        self._by_seq: dict[CachedSequence, PrefetchRead] = {}
        # Blocks published for a sequence that has not been admitted yet (with the digest
        # they were published under: the pool may have reused a block since).
        self._published: dict[CachedSequence, list[tuple[Block, bytes]]] = {}
        self.stats = PrefetchStats()

    @property
    def num_blocks(self) -> int:
        """Pool blocks held by reads in flight."""
        return sum(len(r.blocks) for r in self.reads)

    def _held_for_waiting(self) -> list[Block]:
        """Unreferenced blocks prefetched for sequences that still wait (still holding what
        was published)."""
        out: list[Block] = []
        for published in self._published.values():
            out.extend(b for b, d in published if b.digest == d and b.ref_count == 0)
        return out

    def reading(self, digests: Iterable[bytes]) -> bool:
        """Whether a read in flight is loading any of ``digests``."""
        return any(d in self._by_digest for d in digests)

    def start(self, waiting: Iterable[CachedSequence], lower: LowerTierLink, *, reserve: int,
              computing: Callable[[bytes], bool]) -> None:
        """Start reads for ``waiting`` sequences (queue order) within the bounds.
        ``computing(digest)``: another sequence is computing that block right now."""
        bs = self.block_size
        lookups = 0
        held = self._held_for_waiting()  # changes only when a read ends (poll)
        for seq in waiting:
            room = min(self.max_blocks - self.num_blocks - len(held), self.bm.available() - len(held) - reserve)
            if room <= 0 or len(self.reads) >= self.max_reads or lookups >= self.max_reads:
                return
            if seq.prefetch_checked:
                continue
            n_full = seq.num_tokens // bs
            digests = seq.digests(n_full, bs)
            matched = self.bm.match(digests, [seq.block_tokens(i, bs) for i in range(n_full)])
            first = len(matched)
            if first < n_full and (computing(digests[first]) or self.reading(digests[first:])):
                continue  # it will be in RAM soon; look again then
            seq.prefetch_checked = True
            if first == n_full:
                continue
            lookups += 1
            protect = {b.block_id: b for b in [*held, *matched] if b.ref_count == 0}
            plan = lower.lookup(digests[first:n_full]).head(room - (len(protect) - len(held)))
            n = plan.num_blocks
            if n <= 0:
                continue
            # Held while allocating, so only other cached blocks are evicted; released
            # right after (they return as the most recently used).
            self.bm.acquire(list(protect.values()))
            try:
                blocks = self.bm.allocate(n)
            finally:
                self.bm.release(list(protect.values()))
            span = range(first, first + n)
            token_blocks = [tuple(seq.block_tokens(i, bs)) for i in span]
            read = PrefetchRead(seq, first, digests[first: first + n], token_blocks,
                                digests[first - 1] if first else None, blocks,
                                lower.start_load(plan, blocks, digests[first: first + n], token_blocks))
            self.reads.append(read)
            self._by_seq[seq] = read
            self._by_digest.update((d, read) for d in read.digests)
            self.stats.prefetch_reads += 1

    def poll(self, lower: LowerTierLink) -> None:
        """Publish the verified blocks of every read that is over; release all its blocks."""
        for read in list(self.abandoned):
            if read.pending.settled:
                self.abandoned.remove(read)
                self.bm.release(read.blocks)
        for read in list(self.reads):
            n = lower.finish_load(read.pending)
            if n is None:
                if lower.overdue(read.pending):  # given up: its sequence is admitted without it
                    self._end(read)
                    self.abandoned.append(read)
                continue
            tiers = read.pending.block_tiers()
            for i in range(n):
                parent = read.digests[i - 1] if i else read.parent
                block = read.blocks[i]
                if self.bm.register(block, read.digests[i], read.token_blocks[i], parent):
                    lower.published(block)
                    if read.seq is not None:
                        read.seq.prefetched[read.digests[i]] = tiers[i]
                        self._published.setdefault(read.seq, []).append((block, read.digests[i]))
                # else: the same block was computed meanwhile; this copy stays private and is freed
            self.bm.release(read.blocks)
            self.stats.prefetched_blocks += n
            self._end(read)

    def _end(self, read: PrefetchRead) -> None:
        self.reads.remove(read)
        for d in read.digests:
            if self._by_digest.get(d) is read:
                del self._by_digest[d]
        if read.seq is not None:
            del self._by_seq[read.seq]

    def admitted(self, seq: CachedSequence) -> None:
        """``seq`` was admitted: what was prefetched for it is no longer held for a waiting
        sequence (it is part of ``seq``'s blocks now, or ordinary cached blocks)."""
        self._published.pop(seq, None)

    def forget(self, seq: CachedSequence) -> None:
        """``seq`` is gone: a read of its prefix goes on, for the prefix cache only."""
        read = self._by_seq.pop(seq, None)
        if read is not None:
            read.seq = None
        self._published.pop(seq, None)
        seq.prefetched.clear()
