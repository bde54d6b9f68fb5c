"""Reconcile a namespace directory with what is really on disk.

Runs in the background at start-up (lookups are correct meanwhile: they stat
the files) and again on every prune tick, to adopt blocks written by other
processes and forget blocks they deleted. One pass over ``blocks/``:

- temporary files whose owner session is dead are orphans of a crash: removed;
- block files whose name is not a key, that sit in the wrong shard, or whose
  size is not this namespace's block size: removed;
- after an unclean shutdown, files written since the dead session started get
  their header read and checked (magic, version, header checksum, geometry,
  key), because a best-effort write can reach the directory before its data
  reaches the disk on power loss. Payload checksums are left to the load,
  which verifies every block it serves anyway;
- everything else is reported with its size and last access (atime) so that
  BlockTable can rebuild LRU order and byte totals, and, for the keys the caller
  asks about (those whose chain parent it does not know yet: every block at
  start-up), the parent key from the header, so eviction goes tail first.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvcellar.storage.base import BlockSpec
from kvcellar.storage.block_format import BlockHeader, HeaderError, check_geometry, file_size_for, header_size_for
from kvcellar.storage.disk.layout import NamespaceLayout, key_from_block_name, shard_of, tmp_owner
from kvcellar.storage.disk.reader import open_noatime, read_header


@dataclass
class ScanReport:
    found: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> (size, atime_ns)
    parents: dict[bytes, bytes | None] = field(default_factory=dict)  # key -> chain parent (headers read)
    bytes: int = 0
    orphan_tmp_removed: int = 0
    bad_size_removed: int = 0
    bad_header_removed: int = 0
    misplaced_removed: int = 0
    headers_checked: int = 0
    unknown_files: int = 0
    errors: int = 0
    seconds: float = 0.0


def read_block_header(path: str | Path, spec: BlockSpec, key: bytes) -> BlockHeader | str:
    """The file's header if it is a valid header of block ``key`` of ``spec``;
    otherwise the reason. Raises OSError if the file cannot be read."""
    fd = open_noatime(path)
    try:
        h = read_header(fd, header_size_for(spec.block_size))
        check_geometry(h, spec)
    except HeaderError as e:
        return e.reason
    finally:
        os.close(fd)
    return h if h.key == key else "key"


def remove_file(path: str, on_error: Callable[[], None] = lambda: None) -> bool:
    """Delete ``path``; True if this call removed it. Already gone: False. Any other
    failure: ``on_error()``, then False."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        on_error()
        return False


def walk_block_files(
    blocks_dir: Path,
    *,
    on_error: Callable[[], None] = lambda: None,
    on_stray: Callable[[os.DirEntry[str]], None] = lambda entry: None,
    stop: Callable[[], bool] = lambda: False,
    each_shard: Callable[[list[os.DirEntry[str]]], Iterable[os.DirEntry[str]]] = iter,
) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """``(shard name, entry)`` for every file in the shard directories of ``blocks_dir``,
    shards in name order: the one walk of a namespace's files, for this scan and for the
    offline commands (maintenance.py). A missing ``blocks_dir`` has no shards; one that
    cannot be listed, or a shard that cannot, calls ``on_error()`` and is skipped; an entry
    of ``blocks_dir`` that is not a directory goes to ``on_stray``. ``stop()`` is asked
    before each shard; ``each_shard`` wraps the list of shards (a progress bar)."""
    try:
        with os.scandir(blocks_dir) as it:
            shards = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        shards = []
    except OSError:
        on_error()
        shards = []
    for shard in each_shard(shards):
        if stop():
            return
        if not shard.is_dir(follow_symlinks=False):
            on_stray(shard)
            continue
        try:
            with os.scandir(shard.path) as it:
                entries = list(it)
        except OSError:
            on_error()
            continue
        for e in entries:
            yield shard.name, e


def scan_namespace(
    layout: NamespaceLayout,
    spec: BlockSpec,
    *,
    live_tokens: set[str],
    tmp_older_than_ns: int,
    check_headers_since_ns: int | None,
    stop: Callable[[], bool] = lambda: False,
    wants_parent: Callable[[bytes], bool] = lambda key: False,
) -> ScanReport:
    """One reconciliation pass; see the module docstring. ``stop()`` aborts
    early (the report is then partial and must not drop anything);
    ``wants_parent(key)``: read that block's header for its chain parent."""
    t0 = time.perf_counter()
    rep = ScanReport()
    expected = file_size_for(spec)

    def count_error() -> None:
        rep.errors += 1

    def count_stray(entry: os.DirEntry[str]) -> None:
        rep.unknown_files += 1

    def remove(path: str) -> bool:
        return remove_file(path, count_error)

    # Probe and descriptor temp files live at the namespace top level.
    with contextlib.suppress(OSError), os.scandir(layout.dir) as top:
        for e in top:
            owner = tmp_owner(e.name)
            if owner is not None and owner not in live_tokens and _mtime(e) < tmp_older_than_ns:
                rep.orphan_tmp_removed += remove(e.path)
    for shard, e in walk_block_files(layout.blocks_dir, on_error=count_error, on_stray=count_stray, stop=stop):
        name = e.name
        owner = tmp_owner(name)
        if owner is not None:
            if owner not in live_tokens and _mtime(e) < tmp_older_than_ns:
                rep.orphan_tmp_removed += remove(e.path)
            continue
        key = key_from_block_name(name)
        if key is None:
            rep.unknown_files += 1
            continue
        if shard_of(key.hex()) != shard:
            rep.misplaced_removed += remove(e.path)
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError:
            rep.errors += 1
            continue
        if st.st_size != expected:
            rep.bad_size_removed += remove(e.path)
            continue
        check = check_headers_since_ns is not None and st.st_mtime_ns >= check_headers_since_ns
        if check or wants_parent(key):
            rep.headers_checked += check
            try:
                h = read_block_header(e.path, spec, key)
            except FileNotFoundError:
                continue
            except OSError:
                rep.errors += 1
                continue
            if isinstance(h, str):
                if check:
                    rep.bad_header_removed += remove(e.path)
                    continue
            else:
                rep.parents[key] = h.parent
        rep.found[key] = (st.st_size, st.st_atime_ns)
        rep.bytes += st.st_size
    rep.seconds = time.perf_counter() - t0
    return rep


def _mtime(e: os.DirEntry[str]) -> int:
    try:
        return e.stat(follow_symlinks=False).st_mtime_ns
    except OSError:
        return 1 << 62  # vanished or unreadable: treat as too young to touch
