"""In-memory bookkeeping of the blocks of one namespace: sizes, last access
(LRU order), pins and lookup leases.

This is not an index: lookup never consults it (the file is the truth). It
exists for capacity, LRU and TTL decisions, is rebuilt from the files by the
start-up scan, refreshed by the periodic rescan (which also adopts blocks that
other processes wrote), and persists nothing itself — last-access times go to
the files' atimes in batches (``take_dirty``).

Chains: a block whose parent key is known (from the StoreRequest, the file
header at scan time, or the order of a lookup/load batch) counts as a child of
that parent. Eviction takes least-recently-used *leaves* only: a block with
children on disk waits ("parked") until they are gone, so a chain is evicted
from its tail and never leaves blocks that no prefix can reach, even though
its head was written (and is touched) first. Blocks with an unknown parent are
treated as chain heads.

Eviction rule: a key that is pinned (a load is reading it) or leased (lookup
reported it present a moment ago) is never chosen as a victim, and victims
are unlinked while ``_lock`` is held, so a pin taken after the victim was
chosen finds the file already gone (a miss), never a file vanishing mid-read.
Leases are counted per key, not per caller: each load consumes one, so a load
without a preceding lookup can use up another caller's lease (that caller
then risks a miss, never a wrong block); unconsumed leases expire.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    size: int
    last_access_ns: int
    version: int
    seen_ns: int  # when this process last saw the file exist (write, load, scan)
    parent: bytes | None = None  # previous block of the chain, if known


class BlockTable:
    """``_lock`` protects every attribute. All methods are thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        # key -> when this process removed its file (corrupt, evicted, missing). A scan that
        # started before that moment may still list the file; merge_scan must not adopt it.
        self._gone: dict[bytes, int] = {}
        self._heap: list[tuple[int, int, bytes]] = []  # (last_access_ns, version, key), lazily invalidated
        self._versions = itertools.count(1)
        self._bytes = 0
        self._pins: dict[bytes, int] = {}
        self._leases: dict[bytes, list[float]] = {}  # key -> [count, time.monotonic() expiry]
        self._dirty: set[bytes] = set()
        self._clock_ns = 0
        self._children: dict[bytes, int] = {}  # key -> entries whose parent it is
        self._parked: set[bytes] = set()  # popped by eviction while they had children

    # -- time -----------------------------------------------------------------
    def _now_ns_locked(self) -> int:
        # Strictly increasing wall-clock ns: LRU order is exact even for
        # accesses within one clock tick.
        self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
        return self._clock_ns

    def now_ns(self) -> int:
        with self._lock:
            return self._now_ns_locked()

    # -- entries --------------------------------------------------------------
    def _set_locked(self, key: bytes, size: int, last_access_ns: int, seen_ns: int) -> None:
        old = self._entries.get(key)
        if old is not None:
            self._bytes -= old.size
        v = next(self._versions)
        self._entries[key] = _Entry(size, last_access_ns, v, seen_ns, old.parent if old is not None else None)
        self._bytes += size
        self._parked.discard(key)
        heapq.heappush(self._heap, (last_access_ns, v, key))
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._heap = [(e.last_access_ns, e.version, k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)

    def add(self, key: bytes, size: int, last_access_ns: int | None = None, *, persist: bool = False,
            parent: bytes | None = None) -> None:
        """Record a block file (just written or read, or found by lookup/scan).
        Without ``last_access_ns`` it counts as accessed now; ``persist``
        queues that time for the file's atime; ``parent`` is its chain parent if known."""
        with self._lock:
            now = self._now_ns_locked()
            self._gone.pop(key, None)
            old = self._entries.get(key)
            t = now if last_access_ns is None else last_access_ns
            if old is not None:
                t = max(t, old.last_access_ns)
            self._set_locked(key, size, t, now)
            if parent is not None:
                self._link_locked(key, parent)
            if persist:
                self._dirty.add(key)

    def _link_locked(self, key: bytes, parent: bytes) -> None:
        e = self._entries.get(key)
        if e is None or e.parent == parent or parent == key:
            return
        if e.parent is not None:
            self._unchild_locked(e.parent)
        e.parent = parent
        self._children[parent] = self._children.get(parent, 0) + 1

    def _unchild_locked(self, parent: bytes) -> None:
        n = self._children.get(parent, 0) - 1
        if n > 0:
            self._children[parent] = n
            return
        self._children.pop(parent, None)
        if parent in self._parked:  # a leaf now: eviction may take it
            self._parked.discard(parent)
            p = self._entries.get(parent)
            if p is not None:
                heapq.heappush(self._heap, (p.last_access_ns, p.version, parent))

    def link_chain(self, keys: Sequence[bytes]) -> None:
        """``keys`` are consecutive blocks of one chain (a lookup or load batch): each is
        the parent of the next. Links already known are kept."""
        with self._lock:
            for parent, key in itertools.pairwise(keys):
                e = self._entries.get(key)
                if e is not None and e.parent is None:
                    self._link_locked(key, parent)

    def knows_parent(self, key: bytes) -> bool:
        with self._lock:
            e = self._entries.get(key)
            return e is not None and e.parent is not None

    def _remove_locked(self, key: bytes) -> _Entry | None:
        e = self._entries.pop(key, None)
        if e is None:
            return None
        self._bytes -= e.size
        self._dirty.discard(key)
        self._parked.discard(key)
        if e.parent is not None:
            self._unchild_locked(e.parent)
        return e

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def discard(self, key: bytes) -> None:
        """Forget a block whose file is gone (or was deleted as corrupt)."""
        with self._lock:
            self._remove_locked(key)
            self._gone[key] = self._now_ns_locked()

    def discard_if_known(self, key: bytes) -> bool:
        """``discard`` for a key whose file was found missing; True if it was known. Unknown
        keys leave no trace (a miss on a block never written is not a removal)."""
        with self._lock:
            if self._remove_locked(key) is None:
                return False
            self._gone[key] = self._now_ns_locked()
            return True

    def touch(self, keys: Iterable[bytes], *, persist: bool) -> None:
        """Move known ``keys`` to the most-recently-used end. ``persist``
        queues the new time for the file's atime (loads); lookups do not."""
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    continue
                self._set_locked(k, e.size, self._now_ns_locked(), e.seen_ns)
                if persist:
                    self._dirty.add(k)

    def take_dirty(self) -> list[tuple[bytes, int]]:
        with self._lock:
            out = [(k, self._entries[k].last_access_ns) for k in self._dirty if k in self._entries]
            self._dirty.clear()
            return out

    # -- protection -----------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        """End a load's pins; each key also consumes one lookup lease."""
        with self._lock:
            for k in keys:
                n = self._pins.get(k, 0) - 1
                if n > 0:
                    self._pins[k] = n
                else:
                    self._pins.pop(k, None)
                self._release_lease_locked(k)

    def lease(self, keys: Iterable[bytes], seconds: float) -> None:
        """Protect ``keys`` from eviction until a load consumes the lease or
        ``seconds`` pass. Leases count: two lookups need two loads."""
        until = time.monotonic() + seconds
        with self._lock:
            for k in keys:
                lease = self._leases.get(k)
                if lease is None:
                    self._leases[k] = [1, until]
                else:
                    lease[0] += 1
                    lease[1] = max(lease[1], until)

    def release_leases(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._release_lease_locked(k)

    def _release_lease_locked(self, key: bytes) -> None:
        lease = self._leases.get(key)
        if lease is not None:
            lease[0] -= 1
            if lease[0] <= 0:
                del self._leases[key]

    def _protected_locked(self, key: bytes, now_mono: float) -> bool:
        if key in self._pins:
            return True
        lease = self._leases.get(key)
        if lease is None:
            return False
        if lease[1] > now_mono:
            return True
        del self._leases[key]
        return False

    # -- eviction -------------------------------------------------------------
    def evict(self, need_bytes: int, unlink: Callable[[bytes], bool], *, keep_chain_of: bytes | None = None
              ) -> tuple[int, int]:
        """Remove least-recently-used unprotected leaves until ``need_bytes``
        are freed or none is left. ``unlink(key)`` deletes the file and says
        whether it is gone; a failure stops the eviction. ``keep_chain_of``: a
        key whose chain (it and its known ancestors) must stay, because a block
        about to be written continues it. Returns (blocks, bytes) evicted."""
        return self._pop_while(lambda t, freed: freed < need_bytes, unlink, keep_chain_of)

    def expire(self, cutoff_ns: int, unlink: Callable[[bytes], bool]) -> tuple[int, int]:
        """Remove unprotected leaves last accessed before ``cutoff_ns`` (a parent
        whose children all expire goes in the same pass)."""
        return self._pop_while(lambda t, freed: t < cutoff_ns, unlink)

    def _chain_locked(self, key: bytes | None) -> set[bytes]:
        chain: set[bytes] = set()
        while key is not None and key not in chain:
            chain.add(key)
            e = self._entries.get(key)
            key = e.parent if e is not None else None
        return chain

    def _pop_while(self, cond: Callable[[int, int], bool], unlink: Callable[[bytes], bool],
                   keep_chain_of: bytes | None = None) -> tuple[int, int]:
        n = freed = 0
        skipped: list[tuple[int, int, bytes]] = []
        now_mono = time.monotonic()
        with self._lock:
            keep = self._chain_locked(keep_chain_of)
            while self._heap:
                t, v, k = self._heap[0]
                e = self._entries.get(k)
                if e is None or e.version != v:
                    heapq.heappop(self._heap)
                    continue
                if not cond(t, freed):
                    break
                heapq.heappop(self._heap)
                if self._children.get(k, 0) > 0:  # not a leaf: back on the heap once it is
                    self._parked.add(k)
                    continue
                if k in keep or self._protected_locked(k, now_mono):
                    skipped.append((t, v, k))
                    continue
                if not unlink(k):  # under the lock: see the module docstring
                    skipped.append((t, v, k))
                    break
                self._remove_locked(k)
                self._gone[k] = self._now_ns_locked()
                n += 1
                freed += e.size
            for item in skipped:
                heapq.heappush(self._heap, item)
        return n, freed

    # -- rescans --------------------------------------------------------------
    def merge_scan(self, found: dict[bytes, tuple[int, int]], scan_started_ns: int,
                   parents: Mapping[bytes, bytes | None] | None = None) -> tuple[int, int]:
        """Reconcile with a directory scan: ``found`` maps key -> (size,
        atime_ns), ``parents`` key -> chain parent for the headers it read. Unknown
        files are adopted; entries whose file was not found and that were last seen
        before the scan started are dropped. Returns (adopted, dropped)."""
        adopted = dropped = 0
        with self._lock:
            # Files this process removed after the scan began are stale in ``found``.
            found = {k: v for k, v in found.items() if self._gone.get(k, -1) < scan_started_ns}
            self._gone = {k: t for k, t in self._gone.items() if t >= scan_started_ns}
            new = [k for k in found if k not in self._entries]
            if len(new) > len(self._entries):
                # Mostly a fresh table (start-up): build entries and heapify once.
                for k in new:
                    size, atime = found[k]
                    self._entries[k] = _Entry(size, atime, next(self._versions), scan_started_ns)
                    self._bytes += size
                self._heap = [(e.last_access_ns, e.version, k) for k, e in self._entries.items()]
                heapq.heapify(self._heap)
            else:
                for k in new:
                    size, atime = found[k]
                    self._set_locked(k, size, atime, scan_started_ns)
            adopted = len(new)
            for k, (size, atime) in found.items():
                e = self._entries[k]
                if e.seen_ns != scan_started_ns and (atime > e.last_access_ns or size != e.size):
                    self._set_locked(k, size, max(atime, e.last_access_ns), max(e.seen_ns, scan_started_ns))
            for k in [k for k, e in self._entries.items() if k not in found and e.seen_ns < scan_started_ns]:
                self._remove_locked(k)
                dropped += 1
            for k, parent in (parents or {}).items():
                if parent is not None:
                    self._link_locked(k, parent)
            if found:
                self._clock_ns = max(self._clock_ns, max(a for _, a in found.values()))
        return adopted, dropped

    # -- gauges ---------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def pinned_count(self) -> int:
        with self._lock:
            return len(self._pins)
