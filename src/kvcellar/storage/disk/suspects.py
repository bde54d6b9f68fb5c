"""Keys whose block file may be damaged although it has the right size.

Per-block files of one prompt are often damaged together (a bad sector run, a
faulty copy), but a load stops at the first bad block of a chain: the blocks
after it are never read, and when the recomputed chain is stored again their
files "already exist", so the damage stayed on disk until a later read or
``cache verify`` (issue 14, F5). The tier records those keys here; a store of
a recorded key checks the existing file and rewrites it if it is bad.

Holds keys, never data, and forgets the oldest beyond ``limit`` (a forgotten
key is only checked on its next read, as before).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class SuspectKeys:
    """``_lock`` protects ``_keys``; any thread may call any method."""

    def __init__(self, limit: int = 1 << 14) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._keys[k] = None
                self._keys.move_to_end(k)
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        """``key``'s file was checked or written whole."""
        with self._lock:
            self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
