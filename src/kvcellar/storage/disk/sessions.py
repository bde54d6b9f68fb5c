"""Who has a namespace open, and whether the previous users shut down cleanly.

Each open DiskTier owns ``sessions/<token>.session`` and holds an exclusive
``flock`` on it for its whole life. The kernel drops the lock when the process
dies, however it dies (SIGKILL included), so:

- a session file whose lock can be taken belongs to a dead process that did
  not shut down cleanly (a clean close deletes its file);
- a session file whose lock cannot be taken belongs to a live process, whose
  temporary files must not be touched.

This works with several processes on one cache directory, where a single
"clean" marker file would be overwritten by whichever process closed last.
The file is created under a temporary name, locked, then renamed, so a
session file is never visible unlocked while its owner is alive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvcellar.storage.disk.layout import SESSION_SUFFIX, TMP_SUFFIX

_TMP_GRACE_NS = 60 * 10**9


@dataclass
class StaleSession:
    token: str
    pid: int | None
    start_ns: int | None
    reason: str


@dataclass
class SessionScan:
    stale: list[StaleSession] = field(default_factory=list)
    live_tokens: set[str] = field(default_factory=set)


@dataclass
class Session:
    token: str
    path: Path
    fd: int
    start_ns: int


def new_token() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def _try_lock(path: Path) -> int | None:
    """An fd holding the exclusive lock, or None if someone alive holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def scan_sessions(sessions_dir: Path, *, remove_stale: bool) -> SessionScan:
    """Classify session files as live or stale; optionally delete stale ones."""
    out = SessionScan()
    try:
        entries = list(os.scandir(sessions_dir))
    except FileNotFoundError:
        return out
    now = time.time_ns()
    for e in entries:
        name = e.name
        is_tmp = name.endswith(SESSION_SUFFIX + TMP_SUFFIX)
        if not (name.endswith(SESSION_SUFFIX) or is_tmp):
            continue
        path = Path(e.path)
        try:
            fd = _try_lock(path)
        except FileNotFoundError:
            continue
        token = name.split(".", 1)[0]
        if fd is None:
            if not is_tmp:
                out.live_tokens.add(token)
            continue
        try:
            if is_tmp:
                # A session file that never got renamed: its owner died while
                # opening. Leave young ones alone, their owner may be starting.
                if remove_stale and now - os.fstat(fd).st_mtime_ns > _TMP_GRACE_NS:
                    with contextlib.suppress(OSError):
                        path.unlink()
                continue
            try:
                info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (ValueError, OSError):
                info = {}
            pid = info.get("pid")
            out.stale.append(StaleSession(
                token=token,
                pid=pid,
                start_ns=info.get("start_ns"),
                # No recorded reason: the process never reached close() (killed, crashed, power lost).
                reason=str(info.get("unclean_reason")
                           or f"process {pid if pid is not None else '?'} ended without recording a shutdown "
                              "(killed or crashed)"),
            ))
            if remove_stale:
                with contextlib.suppress(OSError):
                    path.unlink()
        finally:
            os.close(fd)
    return out


def unclean_summary(stale: list[StaleSession]) -> str | None:
    """One line for /health: the most recently started dead session's reason, and how many
    more there were (several processes can share a namespace). None when there were none."""
    if not stale:
        return None
    latest = max(stale, key=lambda s: s.start_ns if isinstance(s.start_ns, int) else -1)
    more = len(stale) - 1
    return latest.reason + (f" (and {more} more unclean session(s))" if more else "")


def open_session(sessions_dir: Path) -> Session:
    """Create, lock and publish this process's session file."""
    sessions_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = new_token()
    start_ns = time.time_ns()
    final = sessions_dir / f"{token}{SESSION_SUFFIX}"
    tmp = final.with_name(final.name + TMP_SUFFIX)
    # The lock is held through a read-only descriptor: no file of ours stays
    # open for writing, so an administrator can still remount read-only.
    wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fd = -1
    try:
        try:
            os.write(wfd, json.dumps({"pid": os.getpid(), "start_ns": start_ns}).encode())
        finally:
            os.close(wfd)
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return Session(token, final, fd, start_ns)


def close_session(session: Session, *, clean: bool, reason: str = "") -> bool:
    """Clean: delete the file (nothing left to report). Unclean: leave it with
    ``reason`` for the next opener. Returns whether the outcome was recorded."""
    recorded = True
    try:
        if clean:
            session.path.unlink()
        else:
            payload = json.dumps({"pid": os.getpid(), "start_ns": session.start_ns, "unclean_reason": reason})
            wfd = os.open(session.path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
            try:
                os.write(wfd, payload.encode())
            finally:
                os.close(wfd)
    except OSError:
        recorded = False
    finally:
        os.close(session.fd)
    return recorded
