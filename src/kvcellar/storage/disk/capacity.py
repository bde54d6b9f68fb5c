"""Capacity rules of one namespace: the byte limit, the filesystem free-space
floor and the TTL, enforced by evicting least-recently-used blocks, tail of a
chain first (BlockTable evicts leaves only).

``make_room`` runs before every write; ``enforce`` and ``prune_ttl`` run on the
upkeep timer (upkeep.py). The byte limit counts file sizes (header + payload) of the
blocks this process knows of; free space is read from ``statvfs`` each time, so
it also reflects other processes and other files on the filesystem.

The floor is ``min_free_bytes`` when given, else min(1 GiB, 5 % of the
filesystem): a fixed 1 GiB floor silently switched the tier off on a
filesystem smaller than that. ``no_space_reason`` says when the
limits leave no room for a single block even after evicting everything this
tier holds: the tier then reports the state "no_space" instead of "ok", and ``has_room``
(re-read at most once a second) makes ``wants`` say no, so the RAM tier does not copy
blocks off its pool for a tier that would drop them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from kvcellar.stats import Count
from kvcellar.storage.disk.stats import DiskStats
from kvcellar.storage.disk.table import BlockTable

AUTO_FLOOR_MAX_BYTES = 1 << 30
AUTO_FLOOR_FRACTION = 0.05
# How long ``has_room`` trusts its last answer: it is asked before every block is copied.
ROOM_CHECK_INTERVAL_S = 1.0


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class CapacityGuard:
    """Stateless apart from its collaborators and the ``has_room`` memo; thread-safe
    because BlockTable is (the memo is two plain assignments, a stale read is harmless)."""

    def __init__(
        self,
        table: BlockTable,
        fs_path: Path,
        capacity_bytes: int,
        min_free_bytes: int | None,
        ttl_s: float,
        unlink: Callable[[bytes], bool],
        counters: DiskStats,
    ) -> None:
        self._table = table
        self._fs_path = fs_path
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.ttl_s = ttl_s
        self._unlink = unlink
        self._c = counters
        self._room = True
        self._room_checked = float("-inf")

    def _statvfs(self) -> tuple[int, int] | None:
        """(free bytes for us, filesystem size), or None if it cannot be read."""
        try:
            st = os.statvfs(self._fs_path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def free_bytes(self) -> int | None:
        st = self._statvfs()
        return None if st is None else st[0]

    def _floor(self, fs_bytes: int) -> int:
        if self.min_free_bytes is not None:
            return self.min_free_bytes
        return min(AUTO_FLOOR_MAX_BYTES, int(fs_bytes * AUTO_FLOOR_FRACTION))

    def floor_bytes(self) -> int | None:
        """The free-space floor in force (None: the filesystem cannot be read)."""
        st = self._statvfs()
        return None if st is None else self._floor(st[1])

    def _free_and_floor(self) -> tuple[int, int] | None:
        st = self._statvfs()
        return None if st is None else (st[0], self._floor(st[1]))

    def has_room(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` can be written (``no_space_reason`` is None), as
        of at most ``ROOM_CHECK_INTERVAL_S`` ago."""
        now = time.monotonic()
        if now - self._room_checked >= ROOM_CHECK_INTERVAL_S:
            self._room = self.no_space_reason(nbytes) is None
            self._room_checked = now
        return self._room

    def no_space_reason(self, nbytes: int) -> str | None:
        """Why no block of ``nbytes`` can be written even after evicting every block this
        tier holds, or None if one can (or the filesystem cannot be read)."""
        if self.capacity_bytes < nbytes:
            return (f"the byte limit ({_size(self.capacity_bytes)}, --disk-cache-gb) is smaller than one block "
                    f"({_size(nbytes)})")
        st = self._statvfs()
        if st is None:
            return None
        free, fs_bytes = st
        floor = self._floor(fs_bytes)
        if floor + nbytes > fs_bytes:
            return (f"the free-space floor ({_size(floor)}, --disk-min-free-gb) leaves no room for one block "
                    f"on a filesystem of {_size(fs_bytes)}")
        ours = self._table.total_bytes
        if free + ours < floor + nbytes:
            return (f"{_size(free)} free is below the free-space floor ({_size(floor)}, --disk-min-free-gb) "
                    f"plus one block, even after evicting the {_size(ours)} this tier holds")
        return None

    def _evict(self, need: int, keep_chain_of: bytes | None = None) -> None:
        n, freed = self._table.evict(need, self._unlink, keep_chain_of=keep_chain_of)
        if n:
            self._c.evicted_blocks.add(n)
            self._c.evicted_bytes.add(freed)

    def make_room(self, nbytes: int, parent: bytes | None = None, *, may_evict: bool = True,
                  count: bool = True) -> bool:
        """Evict until a write of ``nbytes`` fits under the byte limit and
        above the free-space floor. False (counted unless ``count=False``, for
        writes that are not blocks) if it cannot. ``parent``: the chain the new
        block continues, which eviction must not cut (a chain longer than the
        space is truncated at its tail, never orphaned). ``may_evict=False``:
        only free space will do."""
        over = self._table.total_bytes + nbytes - self.capacity_bytes
        if over > 0 and not may_evict:
            self._count(self._c.dropped_capacity, count)
            return False
        if over > 0:
            self._evict(over, parent)
            if self._table.total_bytes + nbytes > self.capacity_bytes:
                self._count(self._c.dropped_capacity, count)
                return False
        ff = self._free_and_floor()
        if ff is None:
            return True  # cannot tell; the write itself will report a fault
        free, floor = ff
        deficit = floor + nbytes - free
        if deficit > 0 and not may_evict:
            self._count(self._c.dropped_no_space, count)
            return False
        if deficit > 0:
            self._evict(deficit, parent)
            ff = self._free_and_floor()
            if ff is not None and ff[1] + nbytes > ff[0]:
                self._count(self._c.dropped_no_space, count)
                return False
        return True

    @staticmethod
    def _count(counter: Count, count: bool) -> None:
        if count:
            counter.add()

    def enforce(self) -> None:
        """Bring the namespace back under both limits (limits may have been
        exceeded by other processes' writes, or lowered)."""
        over = self._table.total_bytes - self.capacity_bytes
        if over > 0:
            self._evict(over)
        ff = self._free_and_floor()
        if ff is not None and ff[0] < ff[1]:
            self._evict(ff[1] - ff[0])

    def prune_ttl(self, now_ns: int) -> int:
        n, freed = self._table.expire(now_ns - int(self.ttl_s * 1e9), self._unlink)
        if n:
            self._c.ttl_pruned_blocks.add(n)
            self._c.ttl_pruned_bytes.add(freed)
        return n
