"""The link between the RAM tier and the tiers below it: RAM -> [SSD, remote, ...].

The scheduler and block manager talk to ``LowerTierLink`` in their own vocabulary
(digests, pool blocks); it speaks ``storage.base.KVTier`` (keys, tensors) to each tier, in
the order they were attached (fastest first). It never sees requests; tiers never see
blocks of the pool.

Reads: ``lookup`` asks each tier in turn how many of the next keys it holds, from where
the previous one stopped, and returns a ``LoadPlan`` (tier -> run of keys); only keys a
tier answered present are loaded, so nothing is staged for a block nobody holds.
``start_load`` reads every run straight into the pool blocks the scheduler reserved (a
pinned staging copy on accelerators), all tiers in parallel, while the engine keeps
stepping other sequences; ``finish_load`` polls and returns the leading run that every
tier verified (digest, token ids, checksum). The scheduler calls these for a sequence it
admits and, ahead of admission, for one still waiting in the queue (prefetch,
``cache/prefetch.py``, which reads ``plan.head(n)`` when its cap allows only part of a
prefix); the link does not tell the two apart.

Writes, per tier and its policy:
* ``write_through``: every block registered in RAM (computed from a prompt or from
  generated tokens) is copied out and stored, at the end of the step that registered it.
* ``evict_only``: a block is stored when the RAM tier drops it.
* ``read_only``: never stored (e.g. a remote store filled by other replicas).
A block loaded from tier i is stored only into the faster tiers 0..i-1 (promotion: a
remote hit lands in RAM and, per the SSD's policy, on the SSD), never back into i or
below, and only after the forward of the step that loaded it (``flush``: the first token
of a lower-tier hit does not wait for those copies). Each tier is asked ``wants(key)``
right before the block is copied off the pool and stored, one block at a time, so a block
that a full queue would drop is never copied; one copy is shared by every tier that wants
it (tiers never modify what they are given).
A write-through store a tier dropped (queue full, fault) is not lost while the block is in
RAM: when the RAM tier evicts it, or at shutdown, the link offers it again if the tier
``wants`` it (a block the tier already holds costs no copy). Eviction is the block's last
chance, so there ``wants`` may wait for room in a full queue, up to the tier's
``evict_wait_s``; at shutdown, until the close deadline. Shutdown drops every block RAM holds,
so an evict-only tier is offered all of them then (a graceful restart keeps them; a crash
does not).

Snapshots (hybrid models' recurrent state at a block boundary, ``cache/state_pool.py``): a tier
may be attached with a second tier of the same kind beside it, in a namespace of its own, that
stores snapshots as entries of the same verified format (``snapshot_spec``: the state's bytes,
keyed, digested and token-checked as the block before the boundary). A snapshot kept in RAM is
stored into the write-through tiers at once and into the evict-only ones when RAM evicts it
(at shutdown, RAM's blocks and snapshots are offered again, ``close``);
``find_snapshot`` says which tier holds one; a load reads it beside the blocks it resumes after
(``start_load``'s ``snapshot``), and the load is whole only if every block and the snapshot
verified. A snapshot is of use only with every block before it: the SSD tier deletes it with the block it
ends when it evicts that block (``DiskTier.drops_with_its_blocks``; tails first, so never while a
block before it stays); in Redis, whose own policy evicts keys, one left without its blocks ages out
unused.

The engine always has a link; with no tier attached every call is a no-op, so nobody
checks whether there are lower tiers.

Threading: every method is called from the engine thread, except the wake-up callback
the tiers' futures run on their own threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvcellar.cache.block_manager import Block
from kvcellar.cache.kv_pool import KVPool
from kvcellar.cache.state_pool import Snapshot, StateLayout, StatePool
from kvcellar.stats import Stats, counter
from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest
from kvcellar.storage.guard import GuardedTier

POLICIES = ("write_through", "evict_only", "read_only")
SNAPSHOTS = "snapshots_"  # the prefix of a snapshot tier's counters


@dataclass
class LinkStats(Stats):
    """What the link asked of one tier and got, exported as ``<tier>_link_*``."""

    lookups: int = counter()
    queried_blocks: int = counter()  # blocks asked of the tier
    lookup_blocks: int = counter()  # of those, the tier said it holds
    loaded_blocks: int = counter()
    load_failed_blocks: int = counter()
    stored_blocks: int = counter()
    declined_blocks: int = counter()
    hit_tokens: int = counter()  # prompt tokens of requests served from this tier (once per request)


@dataclass
class SnapshotLinkStats(Stats):
    """What the link asked of one tier's snapshots and got, exported as ``<tier>_link_snapshots_*``."""

    lookups: int = counter()
    found: int = counter()
    loaded: int = counter()
    load_failed: int = counter()
    stored: int = counter()
    declined: int = counter()


@dataclass
class AttachedTier:
    tier: KVTier
    policy: str
    # Every call the link makes goes through here: the tier's faults stay the tier's.
    calls: GuardedTier
    stats: LinkStats = field(default_factory=LinkStats)
    snapshots: GuardedTier | None = None  # the tier beside it that keeps snapshots (hybrid models)
    snapshot_stats: SnapshotLinkStats = field(default_factory=SnapshotLinkStats)


@dataclass(frozen=True)
class SnapshotLoad:
    """A snapshot to read from tier ``index`` into ``dest`` (``StatePool.export``'s bytes)."""

    index: int
    digest: bytes
    token_ids: tuple[int, ...]
    dest: torch.Tensor


@dataclass(frozen=True)
class LoadPlan:
    """Where the next blocks of a prefix are: ``runs`` of (tier index, count), in prefix
    order. ``num_blocks`` is their total, the blocks the scheduler reserves."""

    runs: tuple[tuple[int, int], ...] = ()

    @property
    def num_blocks(self) -> int:
        return sum(n for _, n in self.runs)

    def head(self, n: int) -> LoadPlan:
        """The plan for its first ``n`` blocks only."""
        runs: list[tuple[int, int]] = []
        for index, count in self.runs:
            if n <= 0:
                break
            runs.append((index, min(count, n)))
            n -= count
        return LoadPlan(tuple(runs))


@dataclass
class PendingLoad:
    blocks: list[Block]
    plan: LoadPlan
    futures: list[concurrent.futures.Future[int]]  # one per run of the plan
    staging: list[torch.Tensor] = field(default_factory=list)  # CPU buffers when the pool is not on CPU
    loaded_by_tier: dict[str, int] = field(default_factory=dict)  # verified blocks per tier name (when done)
    deadline: float = float("inf")  # monotonic time past which the read is overdue (``LowerTierLink.overdue``)
    limit_s: float = float("inf")  # the seconds from its start to ``deadline``
    snapshot: SnapshotLoad | None = None
    snapshot_future: concurrent.futures.Future[int] | None = None
    snapshot_ok: bool = False  # (when done) the snapshot verified and is in ``snapshot.dest``

    @property
    def settled(self) -> bool:
        """Every tier is done with the blocks and the snapshot (whatever it read)."""
        return all(f.done() for f in self._all_futures())

    def _all_futures(self) -> list[concurrent.futures.Future[int]]:
        return [*self.futures, *([self.snapshot_future] if self.snapshot_future is not None else [])]

    def block_tiers(self) -> list[str]:
        """The tier name of each verified leading block (when done): runs are in prefix order."""
        return [name for name, n in self.loaded_by_tier.items() for _ in range(n)]


class LowerTierLink:
    def __init__(
        self,
        pool: KVPool,
        key_of: Callable[[bytes], bytes],
        *,
        wake: Callable[[], None] | None = None,
        guard_backoff_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.pool = pool
        self._guard = {"backoff_initial_s": guard_backoff_s[0], "backoff_max_s": guard_backoff_s[1]}
        self.key_of = key_of
        self.tiers: list[AttachedTier] = []
        self._wake = wake
        self._on_cpu = pool.device.type == "cpu"
        # Blocks published this step, with the digest they were published under: stored at
        # ``flush``, after the step's forward, so a lower-tier hit's first token does not
        # wait for its copies off the pool.
        self._published: list[tuple[Block, bytes]] = []

    def attach(self, tier: KVTier, policy: str = "write_through", snapshots: KVTier | None = None) -> None:
        """Add ``tier`` below the ones attached so far (attach the fastest first);
        ``snapshots``: the tier beside it that keeps a hybrid model's snapshots."""
        if policy not in POLICIES:
            raise ValueError(f"unknown tier policy {policy!r}; use one of {', '.join(POLICIES)}")
        if any(t.tier.name == tier.name for t in self.tiers):
            raise ValueError(f"a tier named {tier.name!r} is already attached")
        self.tiers.append(AttachedTier(tier, policy, GuardedTier(tier, **self._guard),
                                       snapshots=GuardedTier(snapshots, **self._guard) if snapshots else None))

    @property
    def keeps_snapshots(self) -> bool:
        return any(a.snapshots is not None for a in self.tiers)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside, no tier is asked or given anything (the engine's warm-up: its blocks
        must never reach a tier)."""
        tiers, self.tiers = self.tiers, []
        try:
            yield
        finally:
            self.tiers = tiers

    @staticmethod
    def block_spec(pool: KVPool) -> BlockSpec:
        layout = pool.layout
        return BlockSpec(dtype=layout.storage_dtype, shape=layout.storage_shape, block_size=layout.block_size,
                         kv_bits=layout.kv_bits, kv_group_size=layout.kv_group_size if layout.quantized else 0)

    @staticmethod
    def snapshot_spec(layout: StateLayout, block_size: int) -> BlockSpec:
        """Geometry of one snapshot as the tiers store it: ``StatePool.export``'s bytes."""
        return BlockSpec(dtype=torch.uint8, shape=(layout.bytes_per_slot,), block_size=block_size)

    # ---- reads ----------------------------------------------------------------------------

    def lookup(self, digests: Sequence[bytes]) -> LoadPlan:
        """Which tiers hold the leading ``digests``: each tier is asked for the keys after
        the run of the tier above it, and its answer is taken per key."""
        if not self.tiers:
            return LoadPlan(())
        keys = [self.key_of(d) for d in digests]
        runs: list[tuple[int, int]] = []
        pos = 0
        for i, attached in enumerate(self.tiers):
            if pos == len(keys):
                break
            self.tiers[i].stats.lookups += 1
            self.tiers[i].stats.queried_blocks += len(keys) - pos
            n = max(0, min(int(attached.calls.lookup(keys[pos:])), len(keys) - pos))
            if n:
                self.tiers[i].stats.lookup_blocks += n
                runs.append((i, n))
                pos += n
        return LoadPlan(tuple(runs))

    def find_snapshot(self, digest: bytes) -> int | None:
        """The first tier that holds the snapshot keyed by ``digest`` (leased as a block
        lookup is, until its load), or None."""
        key = self.key_of(digest)
        for i, attached in enumerate(self.tiers):
            if attached.snapshots is None:
                continue
            attached.snapshot_stats.lookups += 1
            if attached.snapshots.lookup([key]) == 1:
                attached.snapshot_stats.found += 1
                return i
        return None

    def start_load(self, plan: LoadPlan, blocks: list[Block], digests: list[bytes],
                   token_blocks: list[tuple[int, ...]], snapshot: SnapshotLoad | None = None) -> PendingLoad:
        """Read the blocks of ``plan`` into ``blocks`` (one per digest, in order), and
        ``snapshot`` beside them."""
        staging: list[torch.Tensor] = []
        requests = []
        for block, digest, tokens in zip(blocks, digests, token_blocks, strict=True):
            if self._on_cpu:
                dest = self.pool.block(block.block_id)
            else:
                dest = torch.empty(self.pool.layout.storage_shape, dtype=self.pool.layout.storage_dtype,
                                   pin_memory=True)
                staging.append(dest)
            requests.append(LoadRequest(self.key_of(digest), digest, tokens, dest))
        futures = []
        pos = 0
        wake = self._wake
        for index, n in plan.runs:
            future = self.tiers[index].calls.load(requests[pos: pos + n])
            if wake is not None:
                future.add_done_callback(lambda _f: wake())
            futures.append(future)
            pos += n
        nbytes = self.pool.layout.bytes_per_block
        timeout = max((self.tiers[index].tier.load_timeout_for(n * nbytes) for index, n in plan.runs), default=0.0)
        snapshot_future = None
        if snapshot is not None:
            attached = self.tiers[snapshot.index]
            assert attached.snapshots is not None
            snapshot_future = attached.snapshots.load(
                [LoadRequest(self.key_of(snapshot.digest), snapshot.digest, snapshot.token_ids, snapshot.dest)])
            if wake is not None:
                snapshot_future.add_done_callback(lambda _f: wake())
            timeout = max(timeout, attached.snapshots.tier.load_timeout_for(snapshot.dest.numel()))
        return PendingLoad(blocks, plan, futures, staging, deadline=time.monotonic() + timeout, limit_s=timeout,
                           snapshot=snapshot, snapshot_future=snapshot_future)

    def overdue(self, pending: PendingLoad) -> bool:
        """Whether ``pending`` is still reading past its tiers' ``load_timeout_for``; then it is
        a fault of each tier still reading (which stops answering lookups while it backs
        off), and the caller gives up on it: its blocks stay held until ``settled``."""
        if pending.settled or time.monotonic() < pending.deadline:
            return False
        for (index, _), future in zip(pending.plan.runs, pending.futures, strict=True):
            if not future.done():
                self.tiers[index].calls.overdue(pending.deadline, pending.limit_s)
        snapshots = self.tiers[pending.snapshot.index].snapshots if pending.snapshot is not None else None
        if snapshots is not None and pending.snapshot_future is not None and not pending.snapshot_future.done():
            snapshots.overdue(pending.deadline, pending.limit_s)
        return True

    def finish_load(self, pending: PendingLoad) -> int | None:
        """Number of leading blocks now valid in the pool, or None while still reading.
        Blocks after the first one that failed are not used, even if a later tier's run
        read fine: a prefix has no holes. A snapshot's outcome is ``pending.snapshot_ok``."""
        if not pending.settled:
            return None
        if pending.snapshot is not None and pending.snapshot_future is not None:
            try:
                pending.snapshot_ok = int(pending.snapshot_future.result()) == 1
            except Exception:  # as for blocks: a miss
                pending.snapshot_ok = False
            counters = self.tiers[pending.snapshot.index].snapshot_stats
            if pending.snapshot_ok:
                counters.loaded += 1
            else:
                counters.load_failed += 1
        valid = 0
        pos = 0
        broken = False
        for (index, n), future in zip(pending.plan.runs, pending.futures, strict=True):
            try:
                got = max(0, min(int(future.result()), n))
            except Exception:  # the contract says this does not happen; a miss is the safe answer
                got = 0
            if broken:
                got = 0
            for block in pending.blocks[pos: pos + got]:
                if not self._on_cpu:
                    self.pool.block(block.block_id).copy_(pending.staging[valid], non_blocking=True)
                block.loaded_from = index + 1
                valid += 1
            self.tiers[index].stats.loaded_blocks += got
            if got:
                pending.loaded_by_tier[self.tiers[index].tier.name] = got
            self.tiers[index].stats.load_failed_blocks += n - got
            broken = broken or got < n
            pos += n
        return valid

    def touch(self, digests: Sequence[bytes]) -> None:
        """RAM hits: keep the write-through tiers' copies recently used, so hot blocks do
        not age out there."""
        if not digests or not self.tiers:
            return
        keys = [self.key_of(d) for d in digests]
        for attached in self.tiers:
            if attached.policy == "write_through":
                attached.calls.touch(keys)

    # ---- writes ---------------------------------------------------------------------------

    def published(self, block: Block) -> None:
        """A block was registered in RAM: stored into the write-through tiers (a loaded one
        only into those above the tier it came from) at this step's ``flush``."""
        if self.tiers:
            assert block.digest is not None
            self._published.append((block, block.digest))

    def evicted(self, block: Block) -> None:
        """The RAM tier is about to reuse ``block`` (its data is still intact)."""
        if block.digest is not None:
            # evict_only tiers take it now; write-through ones only if their store was dropped
            self._store(block, ("evict_only", "write_through"), last_chance=True)

    def flush(self) -> None:
        """Store the blocks published this step into the write-through tiers (unless the
        pool reused one meanwhile: its eviction already offered it), in bounded time. The
        engine calls it after the step's forward."""
        if self._published:
            published, self._published = self._published, []
            for block, digest in published:
                if block.digest == digest:
                    self._store(block, ("write_through",), last_chance=False)

    def _store(self, block: Block, policies: tuple[str, ...], *, last_chance: bool) -> None:
        """Store ``block`` into each tier above the one it came from whose policy is in
        ``policies`` and that ``wants`` it; one copy off the pool serves them all.
        ``last_chance``: RAM is dropping the block (eviction), so a full queue is waited on,
        up to each tier's ``evict_wait_s``, rather than declined."""
        if not self.tiers:
            return
        assert block.digest is not None and block.token_ids is not None
        above = block.loaded_from - 1 if block.loaded_from else len(self.tiers)
        key = self.key_of(block.digest)
        request: StoreRequest | None = None
        for i, attached in enumerate(self.tiers[:above]):
            if attached.policy not in policies:
                continue
            if not attached.calls.wants(key, attached.tier.evict_wait_s if last_chance else 0.0):
                if not last_chance:  # on eviction, "already stored" is the normal answer: not a decline
                    self.tiers[i].stats.declined_blocks += 1
                continue
            if request is None:
                request = self._store_request(block, key)
            self.tiers[i].stats.stored_blocks += 1
            attached.calls.store([request])

    def snapshot_kept(self, digest: bytes, token_ids: tuple[int, ...], export: Callable[[], torch.Tensor],
                      loaded_from: int | None = None) -> None:
        """RAM kept a snapshot keyed by ``digest``: stored into the write-through tiers now
        (``export``: its bytes, taken once for all of them); one read from tier
        ``loaded_from`` only into the tiers above it."""
        self._store_snapshot(digest, token_ids, export, ("write_through",), last_chance=False,
                             above=len(self.tiers) if loaded_from is None else loaded_from)

    def snapshot_evicted(self, digest: bytes, token_ids: tuple[int, ...], export: Callable[[], torch.Tensor]) -> None:
        """RAM is about to reuse a snapshot's slot: the evict-only tiers take it, and the
        write-through ones whose store was dropped."""
        self._store_snapshot(digest, token_ids, export, ("evict_only", "write_through"), last_chance=True)

    def _store_snapshot(self, digest: bytes, token_ids: tuple[int, ...], export: Callable[[], torch.Tensor],
                        policies: tuple[str, ...], *, last_chance: bool, above: int | None = None) -> None:
        key = self.key_of(digest)
        request: StoreRequest | None = None
        for attached in self.tiers[:above]:
            snapshots = attached.snapshots
            if snapshots is None or attached.policy not in policies:
                continue
            if not snapshots.wants(key, snapshots.tier.evict_wait_s if last_chance else 0.0):
                if not last_chance:
                    attached.snapshot_stats.declined += 1
                continue
            if request is None:
                request = StoreRequest(key, digest, token_ids, export())
            attached.snapshot_stats.stored += 1
            snapshots.store([request])

    def _store_request(self, block: Block, key: bytes) -> StoreRequest:
        assert block.digest is not None and block.token_ids is not None
        data = self.pool.block(block.block_id)
        data = data.clone() if self._on_cpu else data.to("cpu")
        parent = self.key_of(block.parent) if block.parent is not None else None
        return StoreRequest(key, block.digest, block.token_ids, data, parent)

    # ---- reporting and shutdown -------------------------------------------------------------

    def credit_hits(self, tokens_by_tier: dict[str, int]) -> None:
        """A request's prompt tokens read from each tier (``Sequence.cached_tokens_by_tier``)."""
        for attached in self.tiers:
            attached.stats.hit_tokens += tokens_by_tier.get(attached.tier.name, 0)

    def stats_by_tier(self) -> dict[str, dict[str, float]]:
        """Each tier's own counters and this link's for it (``<name>_link_*``), by tier name;
        its snapshots' tier's as ``snapshots_<its names>`` and ``<name>_link_snapshots_*``."""
        return {a.tier.name: {**a.stats.as_dict(a.tier.name + "_link_"), **a.calls.stats(), **(
            {**a.snapshot_stats.as_dict(a.tier.name + "_link_snapshots_"),
             **{SNAPSHOTS + k: v for k, v in a.snapshots.stats().items()}} if a.snapshots is not None else {})}
            for a in self.tiers}

    def gauge_keys(self) -> frozenset[str]:
        """The keys of ``stats_by_tier`` that are levels."""
        return frozenset().union(*(a.tier.gauges for a in self.tiers),
                                 *({SNAPSHOTS + k for k in a.snapshots.gauges} for a in self.tiers if a.snapshots))

    def health(self) -> dict[str, dict[str, object]]:
        """Each tier's ``health()`` with its policy, by tier name (and its snapshots' tier's,
        under ``snapshots``)."""
        return {a.tier.name: {"policy": a.policy, **a.calls.health(),
                              **({"snapshots": a.snapshots.health()} if a.snapshots is not None else {})}
                for a in self.tiers}

    def close(self, timeout: float, cached: Iterable[Block] = (), states: StatePool | None = None) -> bool:
        """Flush; RAM is about to drop everything, so offer each tier that stores the
        ``cached`` RAM blocks, then the snapshots ``states`` keeps, that it lacks: an
        evict-only tier all of them, a write-through one those whose store it dropped (no
        step waits on the tiers any more, so wait for room in a full queue); then close
        every tier, all within ``timeout`` (shared, in order)."""
        deadline = time.monotonic() + timeout
        self.flush()
        blocks = [b for b in cached if b.digest is not None]
        snapshots = states.stored() if states is not None else []
        clean = True
        for i, attached in enumerate(self.tiers):
            if attached.policy != "read_only":
                self._offer_again(i, attached, blocks, deadline)
                if attached.snapshots is not None and states is not None:
                    self._offer_snapshots_again(attached, states, snapshots, deadline)
            clean = attached.calls.close(max(0.5, deadline - time.monotonic())) and clean
            if attached.snapshots is not None:
                clean = attached.snapshots.close(max(0.5, deadline - time.monotonic())) and clean
        return clean

    def _offer_again(self, index: int, attached: AttachedTier, blocks: list[Block], deadline: float) -> None:
        tier = attached.calls
        for block in blocks:
            if block.loaded_from and block.loaded_from - 1 <= index:
                continue  # came from this tier or one below it
            assert block.digest is not None
            key = self.key_of(block.digest)
            if not tier.wants(key, max(0.0, deadline - time.monotonic())):
                continue
            self.tiers[index].stats.stored_blocks += 1
            tier.store([self._store_request(block, key)])

    def _offer_snapshots_again(self, attached: AttachedTier, states: StatePool,
                               snapshots: list[tuple[bytes, Snapshot]], deadline: float) -> None:
        tier = attached.snapshots
        assert tier is not None
        for digest, snap in snapshots:
            key = self.key_of(digest)
            if not tier.wants(key, max(0.0, deadline - time.monotonic())):
                continue
            attached.snapshot_stats.stored += 1
            tier.store([StoreRequest(key, digest, snap.block_tokens, states.export(snap.slot))])
