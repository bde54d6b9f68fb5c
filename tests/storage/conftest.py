"""Fixtures for the storage tests: tiers that are always closed, and small real
filesystems (tmpfs, ext4 on a loop device) mounted for fault tests (root only)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcellar.storage import BlockSpec
from kvcellar.storage.disk import DiskConfig, DiskTier
from tests.mounts import Mount, mount_tmpfs, run, unmount
from tests.storage.helpers import SPEC


@pytest.fixture
def open_tier() -> Iterator[Callable[..., DiskTier]]:
    """``open_tier(root, ns="ns", spec=SPEC, **config)``; every tier is closed at teardown.

    The free-space floor is 0 unless a test sets it: only the capacity tests are about how full
    a disk is, and the others must not depend on how full the test machine's disk is."""
    opened: list[DiskTier] = []

    def make(root: Path, ns: str = "ns", spec: BlockSpec = SPEC, descriptor: dict | None = None,
             **cfg: Any) -> DiskTier:
        cfg.setdefault("min_free_bytes", 0)
        tier = DiskTier(root, ns, spec, DiskConfig(**cfg), descriptor=descriptor)
        opened.append(tier)
        return tier

    yield make
    for t in opened:
        t.close(10)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """``tmpfs(size="4m", nr_inodes=None)`` mounts a size-limited tmpfs."""
    mounted: list[Path] = []

    def make(size: str = "4m", nr_inodes: int | None = None) -> Mount:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        m = mount_tmpfs(mnt, size, nr_inodes)
        if isinstance(m, str):
            pytest.skip(m)
        mounted.append(mnt)
        return m

    yield make
    for mnt in mounted:
        unmount(mnt)


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
        r = run("umount", str(self.path))
        assert r.returncode == 0, r.stderr
        r = run("mount", "-o", "loop", str(self.image), str(self.path))
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
        r = run("mkfs.ext4", "-q", "-F", str(img))
        if r.returncode != 0:
            pytest.skip(f"mkfs.ext4 unavailable: {r.stderr.strip()}")
        r = run("mount", "-o", "loop", str(img), str(mnt))
        if r.returncode != 0:
            pytest.skip(f"cannot loop-mount ext4 here: {r.stderr.strip()}")
        state["mnt"], state["img"] = mnt, img
        return Ext4Mount(mnt, img)

    yield make
    if "mnt" in state:
        with contextlib.suppress(Exception):
            if run("umount", str(state["mnt"])).returncode != 0:
                run("umount", "-l", str(state["mnt"]))
