"""Fixtures for the storage tests: tiers that are always closed, and small real
filesystems (tmpfs, ext4 on a loop device) mounted for fault tests (root only)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcellar.storage import BlockSpec, DiskTier, DiskTierConfig
from tests.storage.helpers import SPEC


@pytest.fixture
def open_tier() -> Iterator[Callable[..., DiskTier]]:
    """``open_tier(root, ns="ns", spec=SPEC, **config)``; every tier is closed at teardown."""
    opened: list[DiskTier] = []

    def make(root: Path, ns: str = "ns", spec: BlockSpec = SPEC, descriptor: dict | None = None,
             **cfg: Any) -> DiskTier:
        tier = DiskTier(root, ns, spec, DiskTierConfig(**cfg), descriptor=descriptor)
        opened.append(tier)
        return tier

    yield make
    for t in opened:
        t.close(10)


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True)


class Mount:
    """A real filesystem mounted for one test."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def remount(self, mode: str) -> None:
        r = _run("mount", "-o", f"remount,{mode}", str(self.path))
        assert r.returncode == 0, r.stderr

    def statvfs_free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """``tmpfs(size="4m", nr_inodes=None)`` mounts a size-limited tmpfs."""
    mounted: list[Path] = []

    def make(size: str = "4m", nr_inodes: int | None = None) -> Mount:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        opts = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
        r = _run("mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt))
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(mnt)
        return Mount(mnt)

    yield make
    for mnt in mounted:
        _run("mount", "-o", "remount,rw", str(mnt))
        if _run("umount", str(mnt)).returncode != 0:
            _run("umount", "-l", str(mnt))


_EXT4_IOC_SHUTDOWN = 0x8004587D
_EXT4_GOING_FLAGS_NOLOGFLUSH = 2


class Ext4Mount(Mount):
    def __init__(self, path: Path, image: Path) -> None:
        super().__init__(path)
        self.image = image

    def shut_down(self) -> None:
        """EXT4_IOC_SHUTDOWN: from now on the filesystem answers EIO, like a dead disk."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("<I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def remount_image(self) -> None:
        """Unmount and mount the image again (the disk "came back")."""
        r = _run("umount", str(self.path))
        assert r.returncode == 0, r.stderr
        r = _run("mount", "-o", "loop", str(self.image), str(self.path))
        assert r.returncode == 0, r.stderr


@pytest.fixture
def ext4_loop(tmp_path: Path) -> Iterator[Callable[[], Ext4Mount]]:
    """A 64 MiB ext4 filesystem on a loop device (for EIO via EXT4_IOC_SHUTDOWN)."""
    state: dict[str, Path] = {}

    def make() -> Ext4Mount:
        img = tmp_path / "ext4.img"
        mnt = tmp_path / "ext4"
        mnt.mkdir()
        with open(img, "wb") as f:
            f.truncate(64 << 20)
        r = _run("mkfs.ext4", "-q", "-F", str(img))
        if r.returncode != 0:
            pytest.skip(f"mkfs.ext4 unavailable: {r.stderr.strip()}")
        r = _run("mount", "-o", "loop", str(img), str(mnt))
        if r.returncode != 0:
            pytest.skip(f"cannot loop-mount ext4 here: {r.stderr.strip()}")
        state["mnt"], state["img"] = mnt, img
        return Ext4Mount(mnt, img)

    yield make
    if "mnt" in state:
        with contextlib.suppress(Exception):
            if _run("umount", str(state["mnt"])).returncode != 0:
                _run("umount", "-l", str(state["mnt"]))
