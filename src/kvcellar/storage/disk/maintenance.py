"""Offline maintenance of a KV root (``<cache_dir>/kv``), across namespaces:
the functions behind ``kvcellar cache stats|verify|prune|clear``.

They work on the files alone (no DiskTier needed) and are safe while servers
run on the same directory: deleting a block file is atomic, a server that
wanted it sees a miss. Scans show tqdm progress bars when ``progress``.
Namespaces of an older format version are listed and can be pruned or
cleared; ``verify`` only understands the current format and skips others.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvcellar.storage.base import BlockSpec
from kvcellar.storage.block_format import (
    FILE_SUFFIX,
    FORMAT_VERSION,
    HEADER_ALIGN,
    BlockSeal,
    CacheSecret,
    HeaderError,
    header_size_for,
)
from kvcellar.storage.disk.layout import (
    BLOCKS_DIR,
    DESCRIPTOR_FILE,
    SESSIONS_DIR,
    key_from_block_name,
    parse_namespace_dir,
    tmp_owner,
)
from kvcellar.storage.disk.reader import open_noatime, read_header, verify_block_file
from kvcellar.storage.disk.recovery import remove_file, walk_block_files
from kvcellar.storage.disk.sessions import scan_sessions
from kvcellar.storage.disk.table import BlockTable


@dataclass(frozen=True)
class NamespaceInfo:
    dir_name: str
    namespace: str
    version: int
    path: Path
    descriptor: dict[str, Any] | None  # contents of namespace.json, if readable

    @property
    def current(self) -> bool:
        return self.version == FORMAT_VERSION

    @property
    def spec(self) -> BlockSpec | None:
        """The namespace's block spec from namespace.json, if present and valid."""
        try:
            s = (self.descriptor or {})["spec"]
            dtype = getattr(torch, s["dtype"])
            return BlockSpec(dtype, tuple(int(d) for d in s["shape"]), int(s["block_size"]),
                             int(s.get("kv_bits", 16)), int(s.get("kv_group_size", 0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


@dataclass
class _File:
    path: str
    size: int
    atime_ns: int
    mtime_ns: int


def list_namespaces(kv_root: Path) -> list[NamespaceInfo]:
    out = []
    try:
        entries = sorted(os.scandir(kv_root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    for e in entries:
        parsed = parse_namespace_dir(e.name)
        if parsed is None or not e.is_dir(follow_symlinks=False):
            continue
        desc = None
        with contextlib.suppress(OSError, ValueError):
            desc = json.loads((Path(e.path) / DESCRIPTOR_FILE).read_text())
        out.append(NamespaceInfo(e.name, parsed[0], parsed[1], Path(e.path), desc))
    return out


def _files(ns: NamespaceInfo, progress: bool, desc: str) -> tuple[list[_File], list[_File]]:
    """The namespace's block files and temp files, by the walk the tier's scan uses. Block
    files are judged by their suffix alone: ``verify`` reports a misnamed one."""
    blocks: list[_File] = []
    tmps: list[_File] = []

    def bar(shards: list[os.DirEntry[str]]) -> Iterable[os.DirEntry[str]]:
        wrapped: Iterable[os.DirEntry[str]] = tqdm(shards, desc=desc, unit="dir", disable=not progress, leave=False)
        return wrapped

    for _, e in walk_block_files(ns.path / BLOCKS_DIR, each_shard=bar):
        is_tmp = tmp_owner(e.name) is not None
        if not is_tmp and not e.name.endswith(FILE_SUFFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        f = _File(e.path, st.st_size, st.st_atime_ns, st.st_mtime_ns)
        (tmps if is_tmp else blocks).append(f)
    return blocks, tmps


# ---------------------------------------------------------------------------- stats
@dataclass
class NamespaceStats:
    info: NamespaceInfo
    blocks: int = 0
    bytes: int = 0
    tmp_files: int = 0
    oldest_access_ns: int | None = None
    newest_access_ns: int | None = None
    oldest_write_ns: int | None = None
    newest_write_ns: int | None = None
    live_sessions: int = 0
    unclean_sessions: int = 0
    unreachable_blocks: int = 0  # blocks whose chain parent is gone: no prefix can reach them

    def as_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.info.namespace,
            "format_version": self.info.version,
            "current_format": self.info.current,
            "path": str(self.info.path),
            "descriptor": (self.info.descriptor or {}).get("descriptor"),
            "spec": (self.info.descriptor or {}).get("spec"),
            "blocks": self.blocks,
            "bytes": self.bytes,
            "tmp_files": self.tmp_files,
            "oldest_access": _iso(self.oldest_access_ns),
            "newest_access": _iso(self.newest_access_ns),
            "oldest_write": _iso(self.oldest_write_ns),
            "newest_write": _iso(self.newest_write_ns),
            "live_sessions": self.live_sessions,
            "unclean_sessions": self.unclean_sessions,
            "unreachable_blocks": self.unreachable_blocks,
        }


def cache_stats(kv_root: Path, *, progress: bool = False) -> list[NamespaceStats]:
    out = []
    for ns in list_namespaces(kv_root):
        st = NamespaceStats(ns)
        blocks, tmps = _files(ns, progress, f"scan {ns.namespace[:12]}")
        st.blocks, st.bytes, st.tmp_files = len(blocks), sum(f.size for f in blocks), len(tmps)
        if blocks:
            st.oldest_access_ns = min(f.atime_ns for f in blocks)
            st.newest_access_ns = max(f.atime_ns for f in blocks)
            st.oldest_write_ns = min(f.mtime_ns for f in blocks)
            st.newest_write_ns = max(f.mtime_ns for f in blocks)
            st.unreachable_blocks = len(unreachable_blocks(ns, blocks, progress))
        with contextlib.suppress(OSError):
            sessions = scan_sessions(ns.path / SESSIONS_DIR, remove_stale=False)
            st.live_sessions, st.unclean_sessions = len(sessions.live_tokens), len(sessions.stale)
        out.append(st)
    return out


def chain_parents(ns: NamespaceInfo, blocks: list[_File], progress: bool = False
                  ) -> dict[bytes, tuple[_File, bytes | None]]:
    """Each block's key -> (its file, its chain parent from the header). Reads every
    header; only the current format records parents, so older namespaces give none.
    Unreadable or damaged files are left out (verify's business, not a chain question)."""
    if not ns.current or not blocks:
        return {}
    spec = ns.spec
    size = HEADER_ALIGN if spec is None else header_size_for(spec.block_size)
    out: dict[bytes, tuple[_File, bytes | None]] = {}
    for f in tqdm(blocks, desc=f"chains {ns.namespace[:12]}", unit="block", disable=not progress, leave=False):
        key = key_from_block_name(os.path.basename(f.path))
        if key is None:
            continue
        try:
            fd = open_noatime(f.path)
            try:
                out[key] = (f, read_header(fd, size).parent)
            finally:
                os.close(fd)
        except (OSError, HeaderError):
            continue
    return out


def _unreachable(parents: dict[bytes, tuple[_File, bytes | None]]) -> list[bytes]:
    """The keys no lookup can reach: their chain parent is not on disk, or is itself unreachable."""
    reachable: dict[bytes, bool] = {}
    for key in parents:
        path: list[bytes] = []
        k: bytes | None = key
        while k is not None and k not in reachable:
            if k not in parents:  # the parent is gone
                break
            path.append(k)
            k = parents[k][1]
        ok = k is None or reachable.get(k, False)
        for p in path:
            reachable[p] = ok
    return [k for k, ok in reachable.items() if not ok]


def unreachable_blocks(ns: NamespaceInfo, blocks: list[_File], progress: bool = False) -> list[_File]:
    """The blocks no lookup can reach any more (``_unreachable``)."""
    parents = chain_parents(ns, blocks, progress)
    return [parents[k][0] for k in _unreachable(parents)]


# ---------------------------------------------------------------------------- verify
@dataclass
class NamespaceVerify:
    info: NamespaceInfo
    checked: int = 0
    ok: int = 0
    bad: dict[str, int] = field(default_factory=dict)  # reason -> count
    deleted: int = 0
    unreadable: int = 0
    skipped: str | None = None  # why the namespace was not verified
    # With a secret: whether seals were checked, and the good blocks (in ``ok``) that a
    # previous secret sealed, which a rotation must keep accepting until they are gone.
    seals_checked: bool = False
    previous_secret: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"namespace": self.info.namespace, "format_version": self.info.version, "checked": self.checked,
                "ok": self.ok, "bad": dict(self.bad), "deleted": self.deleted, "unreadable": self.unreadable,
                "skipped": self.skipped, "seals_checked": self.seals_checked,
                "sealed_by_previous_secret": self.previous_secret}


def verify_cache(kv_root: Path, *, delete: bool = True, progress: bool = False,
                 secret: bytes | CacheSecret | None = None) -> list[NamespaceVerify]:
    """Check every block of every namespace; with ``secret`` (the servers'), seals too: an
    unsealed or forged block is bad, as the tiers count it."""
    out = []
    for ns in list_namespaces(kv_root):
        rep = NamespaceVerify(ns, seals_checked=secret is not None)
        seal = BlockSeal(secret, ns.namespace) if secret is not None else None
        out.append(rep)
        if not ns.current:
            rep.skipped = f"format version {ns.version} (this kvcellar reads version {FORMAT_VERSION})"
            continue
        spec = ns.spec
        blocks, _ = _files(ns, progress, f"list {ns.namespace[:12]}")
        buf = bytearray(spec.nbytes) if spec else None
        for f in tqdm(blocks, desc=f"verify {ns.namespace[:12]}", unit="block", disable=not progress):
            rep.checked += 1
            try:
                reason = verify_block_file(f.path, spec, buf, seal)
            except FileNotFoundError:
                rep.checked -= 1
                continue
            except OSError:
                rep.unreadable += 1
                continue
            if reason in (None, "previous_secret"):
                rep.ok += 1
                rep.previous_secret += reason is not None
                continue
            rep.bad[reason] = rep.bad.get(reason, 0) + 1
            if delete:
                rep.deleted += remove_file(f.path)
    return out


# ---------------------------------------------------------------------------- prune
@dataclass
class PruneReport:
    ttl_removed: int = 0
    ttl_bytes: int = 0
    capacity_removed: int = 0
    capacity_bytes: int = 0
    orphan_tmp_removed: int = 0
    unreachable_removed: int = 0
    unreachable_bytes: int = 0
    namespaces_removed: list[str] = field(default_factory=list)
    remaining_blocks: int = 0
    remaining_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_ORPHAN_TMP_AGE_NS = 10 * 60 * 10**9


def prune_cache(
    kv_root: Path,
    *,
    ttl_s: float,
    capacity_bytes: int | None = None,
    progress: bool = False,
    now_ns: int | None = None,
) -> PruneReport:
    """The tier's own policy (``BlockTable``: least recently accessed leaves first, so a
    chain is cut at its tail, never orphaned), over every namespace at once: blocks not
    accessed for ``ttl_s``; blocks left unreachable (their chain parent is gone); then, if
    ``capacity_bytes`` is given, until the whole root fits. Also orphan temp files of dead
    sessions (older than 10 minutes) and old-format namespace directories left empty."""
    now = time.time_ns() if now_ns is None else now_ns
    rep = PruneReport()
    table = BlockTable()
    files: dict[bytes, _File] = {}  # the table's key (namespace number + block key) -> file
    namespaces = list_namespaces(kv_root)
    unreachable: list[bytes] = []
    for i, ns in enumerate(namespaces):
        try:
            live = scan_sessions(ns.path / SESSIONS_DIR, remove_stale=False).live_tokens
        except OSError:
            live = None
        blocks, tmps = _files(ns, progress, f"scan {ns.namespace[:12]}")
        for f in tmps:
            owner = tmp_owner(os.path.basename(f.path))
            if live is not None and owner not in live and now - f.mtime_ns > _ORPHAN_TMP_AGE_NS:
                rep.orphan_tmp_removed += remove_file(f.path)
        prefix = i.to_bytes(4, "big")
        parents = chain_parents(ns, blocks, progress)
        for f in blocks:  # a block without a readable name or header is a leaf of its own
            key = key_from_block_name(os.path.basename(f.path)) or f.path.encode()
            parent = parents[key][1] if key in parents else None
            files[prefix + key] = f
            table.add(prefix + key, f.size, f.atime_ns, parent=None if parent is None else prefix + parent)
        unreachable += [prefix + k for k in _unreachable(parents)]

    def unlink(key: bytes) -> bool:  # gone is gone, whoever removed it (a server may, meanwhile)
        path = files[key].path
        return remove_file(path) or not os.path.lexists(path)

    rep.ttl_removed, rep.ttl_bytes = table.expire(now - int(ttl_s * 1e9), unlink)
    for key in unreachable:
        if table.contains(key) and unlink(key):
            table.discard(key)
            rep.unreachable_removed += 1
            rep.unreachable_bytes += files[key].size
    if capacity_bytes is not None and table.total_bytes > capacity_bytes:
        rep.capacity_removed, rep.capacity_bytes = table.evict(table.total_bytes - capacity_bytes, unlink)
    rep.remaining_blocks, rep.remaining_bytes = len(table), table.total_bytes
    for ns in namespaces:
        if ns.current:
            continue
        blocks, tmps = _files(ns, False, "")
        try:
            live = scan_sessions(ns.path / SESSIONS_DIR, remove_stale=False).live_tokens
        except OSError:
            continue
        if not blocks and not tmps and not live:
            shutil.rmtree(ns.path, ignore_errors=True)
            rep.namespaces_removed.append(ns.dir_name)
    return rep


# ---------------------------------------------------------------------------- clear
@dataclass
class ClearReport:
    # {"namespace", "dir", "blocks", "bytes", "live_sessions"}
    namespaces: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"namespaces": self.namespaces}


def clear_cache(kv_root: Path, namespaces: Iterable[str] | None = None, *, progress: bool = False) -> ClearReport:
    """Delete every namespace directory (or only those whose namespace or
    directory name is in ``namespaces``). Reports what was deleted,
    including servers that still had it open (they will see misses and
    recreate their directories on the next write)."""
    wanted = set(namespaces) if namespaces is not None else None
    rep = ClearReport()
    for st in cache_stats(kv_root, progress=progress):
        ns = st.info
        if wanted is not None and ns.namespace not in wanted and ns.dir_name not in wanted:
            continue
        shutil.rmtree(ns.path, ignore_errors=True)
        rep.namespaces.append({"namespace": ns.namespace, "dir": ns.dir_name, "blocks": st.blocks,
                               "bytes": st.bytes, "live_sessions": st.live_sessions})
    return rep


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))
