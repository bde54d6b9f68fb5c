"""Capacity rules of one namespace: the byte limit, the filesystem free-space
floor and the TTL, enforced by evicting least-recently-used blocks, tail of a
chain first (BlockTable evicts leaves only).

``make_room`` runs before every write; ``enforce`` and ``prune_ttl`` run on the
maintenance timer. The byte limit counts file sizes (header + payload) of the
blocks this process knows of; the floor is read from ``statvfs`` each time, so
it also reflects other processes and other files on the filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvcellar.storage.counters import Counters
from kvcellar.storage.disk.table import BlockTable


class CapacityGuard:
    """Stateless apart from its collaborators; thread-safe because BlockTable is."""

    def __init__(
        self,
        table: BlockTable,
        fs_path: Path,
        capacity_bytes: int,
        min_free_bytes: int,
        ttl_s: float,
        unlink: Callable[[bytes], bool],
        counters: Counters,
    ) -> None:
        self._table = table
        self._fs_path = fs_path
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.ttl_s = ttl_s
        self._unlink = unlink
        self._c = counters

    def free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self._fs_path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _evict(self, need: int, keep_chain_of: bytes | None = None) -> None:
        n, freed = self._table.evict(need, self._unlink, keep_chain_of=keep_chain_of)
        if n:
            self._c.inc("evicted_blocks", n)
            self._c.inc("evicted_bytes", freed)

    def make_room(self, nbytes: int, parent: bytes | None = None, *, may_evict: bool = True) -> bool:
        """Evict until a write of ``nbytes`` fits under the byte limit and
        above the free-space floor. False (counted) if it cannot. ``parent``:
        the chain the new block continues, which eviction must not cut (a chain
        longer than the space is truncated at its tail, never orphaned).
        ``may_evict=False``: only free space will do."""
        over = self._table.total_bytes + nbytes - self.capacity_bytes
        if over > 0 and not may_evict:
            self._c.inc("dropped_capacity")
            return False
        if over > 0:
            self._evict(over, parent)
            if self._table.total_bytes + nbytes > self.capacity_bytes:
                self._c.inc("dropped_capacity")
                return False
        free = self.free_bytes()
        if free is None:
            return True  # cannot tell; the write itself will report a fault
        deficit = self.min_free_bytes + nbytes - free
        if deficit > 0 and not may_evict:
            self._c.inc("dropped_no_space")
            return False
        if deficit > 0:
            self._evict(deficit, parent)
            free = self.free_bytes()
            if free is not None and self.min_free_bytes + nbytes > free:
                self._c.inc("dropped_no_space")
                return False
        return True

    def enforce(self) -> None:
        """Bring the namespace back under both limits (limits may have been
        exceeded by other processes' writes, or lowered)."""
        over = self._table.total_bytes - self.capacity_bytes
        if over > 0:
            self._evict(over)
        free = self.free_bytes()
        if free is not None and free < self.min_free_bytes:
            self._evict(self.min_free_bytes - free)

    def prune_ttl(self, now_ns: int) -> int:
        n, freed = self._table.expire(now_ns - int(self.ttl_s * 1e9), self._unlink)
        if n:
            self._c.inc("ttl_pruned_blocks", n)
            self._c.inc("ttl_pruned_bytes", freed)
        return n
