"""Where things live under the KV root: one directory per namespace, one file
per block, named only from the block key.

    <kv_root>/<namespace>-v<FORMAT_VERSION>/
        namespace.json                 descriptor given by the engine + block spec
        sessions/<token>.session       one per open DiskTier, flock-ed while alive
        blocks/<kk>/<keyhex>.kvb       kk = first two hex digits of the key
        blocks/<kk>/<keyhex>.kvb.<token>.<n>.tmp   a write in progress

Decisions, measured with benchmarks/bench_disk_io.py on this machine (ext4 on
a virtio disk, 2 vCPUs shared with other workloads; figures vary ±40 % between
runs, ranges below span several runs):

- One file per block, not grouped segment files. Cold read of a 4096-token
  prompt (256 x 364 KiB, page cache, dentries and inodes dropped): per-block
  files 0.6-1.2 GB/s with 4-8 reader threads (O_DIRECT or buffered alike); a
  segment read with the same 360 KiB requests 0.6-1.3 GB/s, so opening a file
  per block itself costs 5-25 %. A segment read sequentially, buffered, got
  1.4-2.3 GB/s, 1.5-3x the per-block files: kernel readahead merges adjacent
  blocks into multi-MiB requests, which this disk rewards. That gain needs a
  prompt's blocks contiguous in one segment and none evicted, hence a
  persistent key->(segment, offset) index, compaction after per-block
  eviction, and coordination of appends between processes. Per-block files
  keep lookup stateless, free exactly the evicted bytes, are atomic by
  rename and need no compaction. At block size 64 (1.4 MiB files) files run
  at 0.75-0.95 of the segment rate. If disk-hit TTFT misses its target at the
  engine's block size, the next format version should write runs of
  consecutive blocks of one chain per file.
- No persistent index. ``stat`` of the derived path answers lookup: 2-3 us
  warm, ~200 us cold (metadata I/O the following load would pay anyway). A
  SQLite WAL index of 100k blocks measured 0.17-0.22 s cold open+load and
  5-7 us point lookups, fast enough, but it can disagree with the files after
  a crash or with a second process and must be reconciled; the files cannot
  disagree with themselves. Capacity and LRU bookkeeping is an in-memory
  table rebuilt by a background scan (``recovery.py``) while lookups already
  work: over 100k blocks the constructor took 2-15 ms and the scan finished
  after 1.1 s warm / 2.2 s cold.
- One level of 256 shard directories, not two. Scanning 100k files took
  1.2-1.5 s cold / 0.4 s warm with one level, 8.8-11 s cold / 1.2-2.1 s warm
  with two (65,536 mostly near-empty directories). One level keeps ~4k files
  per directory at a million blocks, which ext4/xfs/btrfs/APFS index well.
- Last access for LRU and TTL is the file's atime, set explicitly with
  ``utime`` for loaded blocks, in batches (survives restarts, shared by every
  process, works on noatime mounts); mtime stays the write time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvcellar.storage.block_format import FILE_SUFFIX, FORMAT_VERSION

BLOCKS_DIR = "blocks"
SESSIONS_DIR = "sessions"
DESCRIPTOR_FILE = "namespace.json"
SESSION_SUFFIX = ".session"
TMP_SUFFIX = ".tmp"
SHARD_HEX = 2

_NAMESPACE_RE = re.compile(r"^[0-9A-Za-z_][0-9A-Za-z_.-]{0,127}$")
_NS_DIR_RE = re.compile(r"^(?P<ns>[0-9A-Za-z_][0-9A-Za-z_.-]*)-v(?P<ver>[0-9]+)$")


def namespace_dir_name(namespace: str, version: int = FORMAT_VERSION) -> str:
    if not _NAMESPACE_RE.match(namespace):
        raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {namespace!r}")
    return f"{namespace}-v{version}"


def parse_namespace_dir(name: str) -> tuple[str, int] | None:
    """``("abc", 1)`` for ``"abc-v1"``; None for names that are not namespaces."""
    m = _NS_DIR_RE.match(name)
    return (m["ns"], int(m["ver"])) if m else None


def shard_of(key_hex: str) -> str:
    """The shard directory of a key: its first two hex digits (keys are >= 1 byte)."""
    return key_hex[:SHARD_HEX]


def key_from_block_name(name: str) -> bytes | None:
    """The key of ``<hex>.kvb``; None for any other name."""
    if not name.endswith(FILE_SUFFIX):
        return None
    stem = name[: -len(FILE_SUFFIX)]
    if not 2 <= len(stem) <= 128:
        return None
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return key if key.hex() == stem else None  # canonical lower-case hex only


def tmp_owner(name: str) -> str | None:
    """The session token embedded in a temporary file name, else None."""
    if not name.endswith(TMP_SUFFIX):
        return None
    parts = name[: -len(TMP_SUFFIX)].split(".")
    # <hex>.kvb.<token>.<n>  |  namespace.json.<token>.<n>  |  .probe.<token>.<n>
    return parts[-2] if len(parts) >= 3 else None


@dataclass(frozen=True)
class NamespaceLayout:
    """Paths of one namespace directory. Pure functions of names: no I/O."""

    root: Path  # the KV root
    namespace: str

    @property
    def dir(self) -> Path:
        return self.root / namespace_dir_name(self.namespace)

    @property
    def blocks_dir(self) -> Path:
        return self.dir / BLOCKS_DIR

    @property
    def sessions_dir(self) -> Path:
        return self.dir / SESSIONS_DIR

    @property
    def descriptor_path(self) -> Path:
        return self.dir / DESCRIPTOR_FILE

    def shard_dir(self, key: bytes) -> Path:
        return self.blocks_dir / shard_of(key.hex())

    def block_path(self, key: bytes) -> Path:
        h = key.hex()
        return self.blocks_dir / shard_of(h) / f"{h}{FILE_SUFFIX}"

    @staticmethod
    def tmp_path(final: Path, token: str, seq: int) -> Path:
        return final.with_name(f"{final.name}.{token}.{seq}{TMP_SUFFIX}")
