"""The artifact index: per-entry bookkeeping, lifetime counters and memoized source digests.

Why SQLite (stdlib ``sqlite3``, WAL) rather than a JSON file replaced atomically: several
processes update it at once (two servers starting on the same cache dir bump access counts
and counters, a ``models prune`` runs beside a server). A JSON file needs its own lock
around every read-modify-write or updates get lost; SQLite gives transactions, crash safety
and multi-process locking for free, and a lookup costs well under a millisecond. The index
is a cache of facts, not the truth: the entry directories and their manifests are. A
missing, corrupt or older-schema index is recreated and refilled from the manifests (the
store does that on open), so deleting ``index.sqlite`` is always safe.

Tables: ``entries`` (one row per entry: descriptor, size, created, last access, access
count, the stat signatures of its files at their last full verification), ``counters``
(lifetime ``artifact_*`` counters), ``digests`` (sha256 of source files such as a GGUF,
keyed by path and valid while size, mtime, ctime and inode are unchanged; this is what
makes the weights identity of a second start cost nothing), ``meta`` (schema version, the last
LRU eviction: which entry and when, whichever process evicted it).

Thread safety: one connection, guarded by a lock; any thread may call any method.

Opening: processes that open the index at once (servers starting together, test workers) take
turns under an flock on ``index.sqlite.lock``. Switching a new file to WAL needs an exclusive
lock, and SQLite answers "database is locked" at once, without waiting, where two connections
would deadlock; under the flock at most one connection is in that switch. A busy or locked
database is waited for, never taken for a corrupt one: discarding it would delete the index
under the processes using it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    descriptor TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    access_count INTEGER NOT NULL DEFAULT 0,
    verified TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS digests (
    path TEXT PRIMARY KEY,
    signature TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    computed REAL NOT NULL
);
"""


@dataclass
class EntryRow:
    key: str
    descriptor: dict[str, Any]
    size_bytes: int
    created: float
    last_access: float
    access_count: int
    verified: dict[str, list[int]] | None  # file name -> stat signature at last full verification


class ArtifactIndex:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._conn = self._open()
        finally:
            os.close(fd)  # drops the flock

    def _open(self) -> sqlite3.Connection:
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        pause = 0.01
        while True:
            try:
                return self._connect()
            except sqlite3.OperationalError as exc:
                if not _busy(exc):
                    return self._recreate(exc)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(pause)  # another process holds the file; it is not broken
                pause = min(pause * 2, 0.5)
            except sqlite3.DatabaseError as exc:
                return self._recreate(exc)

    def _recreate(self, exc: sqlite3.DatabaseError) -> sqlite3.Connection:
        log.warning("artifact index %s is unusable (%s); recreating it from the entries", self.path, exc)
        self._discard_files()
        return self._connect()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
            if row is None:
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema {row[0]}, expected {SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _discard_files(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(str(self.path) + suffix).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ---- entries ------------------------------------------------------------------------

    @staticmethod
    def _row(r: tuple[Any, ...]) -> EntryRow:
        return EntryRow(r[0], json.loads(r[1]), int(r[2]), float(r[3]), float(r[4]), int(r[5]),
                        json.loads(r[6]) if r[6] else None)

    _COLUMNS = "key, descriptor, size_bytes, created, last_access, access_count, verified"

    def get(self, key: str) -> EntryRow | None:
        with self._lock:
            r = self._conn.execute(f"SELECT {self._COLUMNS} FROM entries WHERE key=?", (key,)).fetchone()
        return self._row(r) if r else None

    def entries(self) -> list[EntryRow]:
        """All rows, least recently used first."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {self._COLUMNS} FROM entries ORDER BY last_access, key").fetchall()
        return [self._row(r) for r in rows]

    def insert(self, key: str, descriptor: dict[str, Any], size_bytes: int, created: float) -> None:
        """Register an entry (or re-register one found on disk); keeps the stats of an existing row."""
        with self._lock:
            self._conn.execute(
                "INSERT INTO entries (key, descriptor, size_bytes, created, last_access, access_count) "
                "VALUES (?, ?, ?, ?, ?, 0) ON CONFLICT(key) DO UPDATE SET descriptor=excluded.descriptor, "
                "size_bytes=excluded.size_bytes, created=excluded.created",
                (key, json.dumps(descriptor, sort_keys=True), size_bytes, created, created),
            )

    def touch(self, key: str, now: float | None = None) -> None:
        with self._lock:
            self._conn.execute("UPDATE entries SET last_access=?, access_count=access_count+1 WHERE key=?",
                               (time.time() if now is None else now, key))

    def set_verified(self, key: str, signatures: dict[str, list[int]] | None) -> None:
        with self._lock:
            self._conn.execute("UPDATE entries SET verified=? WHERE key=?",
                               (json.dumps(signatures) if signatures is not None else None, key))

    def delete(self, key: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM entries WHERE key=?", (key,))

    def total_bytes(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COALESCE(SUM(size_bytes), 0) FROM entries").fetchone()[0])

    # ---- counters -----------------------------------------------------------------------

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value=value+excluded.value",
                (name, n),
            )

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {n: int(v) for n, v in self._conn.execute("SELECT name, value FROM counters").fetchall()}

    def set_last_eviction(self, key: str, label: str, when: float) -> None:
        value = json.dumps({"key": key, "label": label, "time": when})
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('last_eviction', ?)", (value,))

    def last_eviction(self) -> dict[str, Any] | None:
        """``{"key", "label", "time"}`` of the last LRU eviction (unix seconds), or None."""
        with self._lock:
            r = self._conn.execute("SELECT value FROM meta WHERE name='last_eviction'").fetchone()
        if r is None:
            return None
        try:
            found = json.loads(r[0])
        except ValueError:
            return None
        return found if isinstance(found, dict) else None

    # ---- memoized source digests ----------------------------------------------------------

    def digest_get(self, path: str, signature: list[int]) -> str | None:
        with self._lock:
            r = self._conn.execute("SELECT signature, sha256 FROM digests WHERE path=?", (path,)).fetchone()
        if r is None or json.loads(r[0]) != signature:
            return None
        return str(r[1])

    def digest_put(self, path: str, signature: list[int], sha256: str) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?)",
                               (path, json.dumps(signature), sha256, time.time()))

    def digest_paths(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._conn.execute("SELECT path FROM digests").fetchall()]

    def digest_delete(self, path: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM digests WHERE path=?", (path,))


def _busy(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite refused because another connection holds the file (it will free it)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)
