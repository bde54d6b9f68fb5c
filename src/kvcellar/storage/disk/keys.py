"""Records of block keys the tier must remember about, never data (one file, two uses):

* **dropped**: keys whose write-through store was dropped (queue full, fault back-off,
  failed write). A dropped block is not lost: its KV is still in RAM, and the RAM tier
  offers it again when it evicts the block or shuts down (``DiskTier.wants`` says yes: not
  stored, not queued). The record only accounts for that second chance: a later
  successful write of a recorded key counts as ``writer_written_after_drop``.
* **suspects**: keys whose file may be damaged although it has the right size. Per-block
  files of one prompt are often damaged together (a bad sector run, a faulty copy), but a
  load stops at the first bad block of a chain: the blocks after it are never read, and
  when the recomputed chain is stored again their files "already exist", so the damage
  would stay on disk until a later read or ``cache verify``. A store of a
  suspect checks the existing file and rewrites it if it is bad.

Both forget their oldest keys beyond ``limit``: a forgotten drop loses only its
written-later attribution (the drop count stays exact), a forgotten suspect is checked
on its next read, as before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class KeyRecord:
    """A bounded set of keys, oldest forgotten first. ``_lock`` protects ``_keys``; any
    thread may call any method."""

    def __init__(self, limit: int) -> None:
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

    def pop(self, key: bytes) -> bool:
        """Forget ``key``; True if it was recorded."""
        with self._lock:
            return self._keys.pop(key, 0) is None

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
