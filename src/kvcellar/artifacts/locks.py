"""Advisory file locks (``fcntl.flock``) that coordinate processes sharing one models dir.

Two locks per entry key, both files under ``<models>/locks/`` that are never deleted (deleting
a lock file that another process has open would let two processes "hold" it at once):

* ``<key>.use``: held **shared** for as long as an entry is being validated or served;
  eviction, ``clear`` and ``prune`` take it **exclusive and non-blocking** and skip the entry
  when they can't, so an entry in use is never removed by them.
* ``<key>.build``: held **exclusive** around building an entry, so concurrent starts on the
  same model prepare it once; the others wait, then find the entry built.

Lock order: ``use`` (shared, blocking) before ``build`` (exclusive, blocking). Exclusive
``use`` locks are only ever tried non-blocking, and their holders wait on nothing, so no
cycle can form. flock locks belong to an open file description: two ``FileLock`` objects in
one process conflict like two processes would, and a process that dies releases its locks.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class FileLock:
    """One flock on one lock file. Not thread-safe; one owner at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self.mode: str | None = None  # "shared" | "exclusive" while held

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, exclusive: bool, blocking: bool = True) -> bool:
        """Take the lock; False only when ``blocking`` is False and another holder conflicts."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held ({self.mode}); release it first")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, op)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.mode = "exclusive" if exclusive else "shared"
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd, self.mode = self._fd, None, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # A lock must never outlive its owner silently; closing the fd drops it.
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
