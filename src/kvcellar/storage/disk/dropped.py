"""Keys whose write-through store was dropped (queue full, fault back-off, failed write).

A dropped block is not lost: its KV is still in RAM, and the RAM tier offers it again
when it evicts the block or shuts down (``DiskTier.wants`` says yes: not stored, not
queued). This record only accounts for that second chance: a later successful write of
a recorded key counts as ``writer_written_after_drop``. It holds keys, never data, and
forgets the oldest beyond ``limit`` (the count of drops stays exact; only the
written-later attribution of very old drops is lost).
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class DroppedKeys:
    """``_lock`` protects ``_keys``; any thread may call any method."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def written(self, key: bytes) -> bool:
        """``key`` was written now; True if it had been dropped before."""
        with self._lock:
            return self._keys.pop(key, 0) is None

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
