"""Small real filesystems for fault tests: a size-limited tmpfs mounted (as root) on a
directory, remounted read-only and back, unmounted afterwards. Shared by the storage
fixtures and the server-level tests that put ``<cache-dir>/kv`` on one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True)


class Mount:
    """A real filesystem mounted for one test."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def remount(self, mode: str) -> None:
        r = run("mount", "-o", f"remount,{mode}", str(self.path))
        assert r.returncode == 0, r.stderr

    def statvfs_free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


def mount_tmpfs(path: Path, size: str, nr_inodes: int | None = None) -> Mount | str:
    """Mount a tmpfs of ``size`` on ``path`` (created if missing). The Mount, or why not."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    r = run("mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path))
    if r.returncode != 0:
        return f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}"
    return Mount(path)


def unmount(path: Path) -> None:
    """Make it writable again (so nothing else fails on it) and unmount, lazily if busy."""
    run("mount", "-o", "remount,rw", str(path))
    if run("umount", str(path)).returncode != 0:
        run("umount", "-l", str(path))
