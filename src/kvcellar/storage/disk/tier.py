"""DiskTier: the persistent SSD tier of the KV cache (SPEC §5).

Composition (one file per concept beside this one):
  layout.py    where files live; ../block_format.py what a block file holds
  writer.py    atomic writes + the writer thread and its bounded queue
  reader.py    verified reads straight into the caller's tensors + reader threads
  table.py     in-memory LRU/size bookkeeping, pins and lookup leases
  capacity.py  byte limit, free-space floor, TTL
  recovery.py  the reconciliation scan (start-up and periodic)
  sessions.py  live/dead openers and last_shutdown_clean
  keys.py      keys to remember: dropped write-through stores, suspect files
  faults.py    fault episodes, logging once, back-off

Threads (all named, none daemon):
  kvcellar-disk-writer-<ns>     writes queued blocks (absent with async_writes=False)
  kvcellar-disk-reader-<ns>-<i> reads load batches
  kvcellar-disk-maint-<ns>      start-up scan, then a timer: access-time flush,
                                rescan + TTL prune + capacity, fault probes

Faults: a failed write, delete (eviction, corrupt block) or probe puts the
write direction in a fault episode: ``health()`` says "degraded" with the last
error until a write or a probe succeeds. Probes run every ``probe_interval_s``
during an episode. ``health()`` says "no_space" when the byte limit or the
free-space floor leaves no room for one block even after evicting every block
this tier holds (also logged at start-up).

Shutdown: call ``close(timeout)``. If the program exits without it, the
maintenance thread notices that the main thread has ended and performs the
same close with ``config.exit_drain_s``; the process exits after that. A
SIGKILL leaves this process's session file unlocked: the next opener reports
``last_shutdown_clean = False`` and its scan removes the orphans.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest, tier_health
from kvcellar.storage.block_format import (
    FORMAT_VERSION,
    MAX_KEY_LEN,
    check_identity,
    encode_header,
    header_size_for,
    payload_checksum,
)
from kvcellar.storage.counters import Counters
from kvcellar.storage.disk.capacity import CapacityGuard
from kvcellar.storage.disk.config import DiskTierConfig
from kvcellar.storage.disk.keys import KeyRecord
from kvcellar.storage.disk.layout import NamespaceLayout
from kvcellar.storage.disk.reader import Outcome, ReaderPool, read_block_into, tensor_bytes
from kvcellar.storage.disk.recovery import scan_namespace
from kvcellar.storage.disk.sessions import Session, StaleSession, close_session, open_session, scan_sessions
from kvcellar.storage.disk.table import BlockTable
from kvcellar.storage.disk.writer import BlockWriter, fsync_dir, write_block_file
from kvcellar.storage.faults import FaultTracker

_log = logging.getLogger("kvcellar.storage.disk")

_SSD_COUNTERS = (
    "lookup_calls", "lookup_hit_blocks",
    "load_calls", "load_hits", "load_misses", "load_bytes", "load_missing",
    "stored_blocks", "stored_bytes", "store_skipped_existing", "store_verified_existing", "store_repaired",
    "evicted_blocks", "evicted_bytes", "ttl_pruned_blocks", "ttl_pruned_bytes",
    "dropped_capacity", "dropped_no_space",
    "write_errors", "read_errors", "probe_failures", "atime_errors", "delete_errors",
    "corrupt_total", "corrupt_deleted", "corrupt_size", "corrupt_magic", "corrupt_version",
    "corrupt_header_checksum", "corrupt_padding", "corrupt_geometry", "corrupt_key", "corrupt_digest", "corrupt_tokens",
    "corrupt_checksum",
    "recovered_orphan_tmp", "recovered_bad_size", "recovered_bad_header", "recovered_misplaced",
    "recovered_adopted", "recovered_unclean_sessions", "rescan_adopted", "rescan_dropped",
    "scans", "scan_seconds",
)
_WRITER_COUNTERS = (
    "enqueued", "dedup_inflight", "dropped_queue_full", "dropped_backoff", "dropped_closed",
    "dropped_abort", "retries", "retry_final_fail", "failed", "deferred_timeouts", "enqueue_wait_s_total",
    "written_after_drop", "dropped_no_parent", "deferred_for_reads",
)
_MAIN_THREAD_POLL_S = 0.25
_PROBE_BYTES = 4096


def _mkdir_private(path: Path) -> bool:
    """Create ``path`` and missing parents with mode 0700. True if created."""
    if path.is_dir():
        return False
    _mkdir_private(path.parent)
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        return False


class DiskTier(KVTier):
    """Persistent tier of KV blocks under ``<root>/<namespace>-v<FORMAT_VERSION>/``.

    ``root`` is the KV root (``<cache_dir>/kv``); ``namespace`` a fingerprint
    of everything that changes KV bytes (safe as a path component);
    ``descriptor`` a small JSON-able dict describing it for humans and the
    cache CLI. The constructor does not raise for I/O faults: an unusable
    directory gives a degraded tier that misses and retries in the background.
    """

    name = "ssd"
    gauges = frozenset({
        "ssd_blocks", "ssd_bytes", "ssd_capacity_bytes", "ssd_free_bytes", "ssd_pinned_blocks",
        "ssd_scan_complete", "writer_queue_depth", "writer_in_flight", "writer_pending_keys",
        "ssd_load_batches_in_flight",
    })

    def __init__(
        self,
        root: Path | str,
        namespace: str,
        spec: BlockSpec,
        config: DiskTierConfig | None = None,
        descriptor: dict | None = None,
    ) -> None:
        self.spec = spec
        self.config = config = config or DiskTierConfig()
        self.layout = NamespaceLayout(Path(root), namespace)  # validates the namespace
        self._descriptor = descriptor
        self._header_size = header_size_for(spec.block_size)
        self.file_size = self._header_size + spec.nbytes
        self._ssd = Counters("ssd_", _SSD_COUNTERS)
        self._wc = Counters("writer_", _WRITER_COUNTERS)
        self._table = BlockTable()
        where = str(self.layout.dir)
        self._wfault = FaultTracker("write", self._ssd, _log, where,
                                    config.fault_backoff_initial_s, config.fault_backoff_max_s)
        self._rfault = FaultTracker("read", self._ssd, _log, where)
        self._capacity = CapacityGuard(self._table, Path(root), config.capacity_bytes, config.min_free_bytes,
                                       config.ttl_s, self._unlink_block, self._ssd)
        # _claims_lock protects _claims: keys queued or being written (in-flight dedup).
        self._claims_lock = threading.Lock()
        self._claims: set[bytes] = set()
        self._dropped = KeyRecord(1 << 16)  # write-through stores dropped (keys.py)
        self._suspects = KeyRecord(1 << 14)  # files to check when stored again (keys.py)
        # _misc_lock protects _leftovers and _known_dirs.
        self._misc_lock = threading.Lock()
        self._leftovers: set[Path] = set()
        self._known_dirs: set[Path] = set()
        self._seq = itertools.count()
        # _life protects _closing and _entering (store() calls in progress).
        self._life = threading.Lock()
        self._no_entering = threading.Condition(self._life)
        self._closing = False
        self._entering = 0
        self._close_lock = threading.Lock()
        self._close_result: bool | None = None
        self._stop = threading.Event()
        self._scan_done = threading.Event()
        self._opened_ns = time.time_ns()
        self._session: Session | None = None
        self._stale: list[StaleSession] = []
        self._last_shutdown_clean = True

        self._open_namespace()
        no_space = self._capacity.no_space_reason(self.file_size)
        if no_space:
            _log.warning("disk tier %s will store nothing: %s", self.layout.dir, no_space)
        ns8 = namespace[:8]
        self._reader = ReaderPool(config.io_threads, f"kvcellar-disk-reader-{ns8}", self._read_one, self._batch_done)
        self._writer: BlockWriter | None = None
        if config.async_writes:
            self._writer = BlockWriter(f"kvcellar-disk-writer-{ns8}", config.queue_blocks, self._write_one,
                                       self._release_claim, self._defer_to_reads, config.write_defer_max_s,
                                       self._wc)
        self._maint = threading.Thread(target=self._maintenance, name=f"kvcellar-disk-maint-{ns8}", daemon=False)
        self._maint.start()

    # ------------------------------------------------------------------ opening
    def _open_namespace(self, *, probe: bool = False) -> bool:
        """Directories, session, descriptor. On an OS error the tier stays
        degraded and the maintenance thread retries as its probe."""
        try:
            _mkdir_private(self.layout.blocks_dir)
            _mkdir_private(self.layout.sessions_dir)
            scan = scan_sessions(self.layout.sessions_dir, remove_stale=True)
            self._session = open_session(self.layout.sessions_dir)
            self._stale = scan.stale
            self._last_shutdown_clean = not scan.stale
            if scan.stale:
                self._ssd.inc("recovered_unclean_sessions", len(scan.stale))
                _log.warning("disk tier %s: %d previous session(s) ended without a clean shutdown (%s)",
                             self.layout.dir, len(scan.stale), scan.stale[0].reason)
            self._write_descriptor()
            return True
        except OSError as e:
            self._wfault.failure(e, "opening the namespace directory", probe=probe)
            return False

    def _write_descriptor(self) -> None:
        doc = {
            "namespace": self.layout.namespace,
            "format_version": FORMAT_VERSION,
            "spec": {
                "dtype": str(self.spec.dtype).removeprefix("torch."),
                "shape": list(self.spec.shape),
                "block_size": self.spec.block_size,
                "block_nbytes": self.spec.nbytes,
                "file_nbytes": self.file_size,
            },
            "descriptor": self._descriptor,
        }
        path = self.layout.descriptor_path
        try:
            old = json.loads(path.read_text())
            if {k: old.get(k) for k in doc} == doc:
                return
            doc["created"] = old.get("created")
        except (OSError, ValueError):
            pass
        doc["created"] = doc.get("created") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data = json.dumps(doc, indent=2, sort_keys=True, default=str).encode() + b"\n"
        assert self._session is not None
        tmp = NamespaceLayout.tmp_path(path, self._session.token, next(self._seq))
        write_block_file(path, tmp, [data], fsync=False, on_leftover=self._add_leftover)

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Stat the derived paths until the first absent key. Present keys are
        leased (see BlockTable) before they are checked, so this process's
        eviction cannot delete them between this answer and the load."""
        keys = list(keys)
        self._table.lease(keys, self.config.lookup_lease_s)
        n = 0
        for k in keys:
            try:
                st = os.stat(self.layout.block_path(k))
            except OSError:
                self._table.discard_if_known(k)  # removed behind our back (cache clear, another process)
                break
            if st.st_size != self.file_size:
                # Final names only ever come from renaming a complete file: a wrong size is a
                # damaged block. A miss, deleted and counted like any corrupt block.
                self._corrupt(self.layout.block_path(k), k, "size", st.st_ino, st.st_dev)
                self._suspects.add(keys[n + 1:])
                break
            if not self._table.contains(k):  # written by another process, or not scanned yet
                self._table.add(k, self.file_size, st.st_atime_ns)
            n += 1
        self._table.link_chain(keys[:n])
        self._table.release_leases(keys[n:])
        self._table.touch(keys[:n], persist=False)
        self._ssd.inc("lookup_calls")
        self._ssd.inc("lookup_hit_blocks", n)
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        self._table.touch(keys, persist=True)

    def pin(self, keys: Sequence[bytes]) -> None:
        self._table.pin(list(keys))

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._table.unpin(list(keys))

    def remove(self, keys: Sequence[bytes]) -> int:
        """Unlink the block files of ``keys``. A read in progress keeps its open file
        (POSIX unlink), so removing a block that is being loaded is safe."""
        n = 0
        for k in keys:
            existed = self.layout.block_path(k).exists()
            self._table.discard(k)
            if self._unlink_block(k) and existed:
                n += 1
        return n

    # ------------------------------------------------------------------ load
    def load(self, requests: Sequence[LoadRequest]) -> concurrent.futures.Future[int]:
        for r in requests:
            self.spec.check_tensor(r.dest, "LoadRequest.dest")
        keys = [r.key for r in requests]
        self._table.pin(keys)
        fut = self._reader.submit(list(requests)) if requests else None
        if fut is None:
            self._table.unpin(keys)
            fut = concurrent.futures.Future()
            fut.set_result(0)
        return fut

    def _read_one(self, req: LoadRequest) -> bool:
        path = self.layout.block_path(req.key)
        res = read_block_into(str(path), self.spec, self._header_size, req)
        if res.outcome is Outcome.OK:
            self._table.add(req.key, self.file_size, persist=True)
            self._ssd.inc("load_bytes", self.spec.nbytes)
            self._rfault.success()
            return True
        if res.outcome is Outcome.MISSING:
            self._ssd.inc("load_missing")
            self._table.discard(req.key)
        elif res.outcome is Outcome.IO_ERROR:
            assert res.error is not None
            self._rfault.failure(res.error, f"reading {path.name}")
        else:
            self._corrupt(path, req.key, res.reason, res.ino, res.dev)
        return False

    def _corrupt(self, path: Path, key: bytes, reason: str, ino: int, dev: int) -> None:
        """Count, forget and delete a block that failed a check. Its chain's later
        blocks become suspects (see keys.py) where the caller knows them."""
        self._ssd.inc("corrupt_total")
        self._ssd.inc(f"corrupt_{reason}")
        self._table.discard(key)
        self._suspects.add([key])  # marks the load batch's failure as a corruption (_batch_done)
        try:
            st = os.stat(path)
            # A writer may have renamed a good copy over it since we opened it.
            if (st.st_ino, st.st_dev) == (ino, dev):
                os.unlink(path)
                self._ssd.inc("corrupt_deleted")
        except FileNotFoundError:
            pass
        except OSError as e:
            self._wfault.failure(e, f"deleting corrupt {path.name}", counter="delete")
        total = self._ssd.get("corrupt_total")
        if total & (total - 1) == 0:  # 1, 2, 4, 8, ...: bounded logging
            _log.warning("disk tier %s: deleted a block that failed its %s check (%d so far)",
                         self.layout.dir, reason, total)

    def _batch_done(self, requests: Sequence[LoadRequest], leading: int) -> None:
        if leading < len(requests) and requests[leading].key in self._suspects:
            # The run ended at a corrupt block: the rest of the chain was not read.
            self._suspects.add(r.key for r in requests[leading + 1:])
        self._table.link_chain([r.key for r in requests[:leading]])
        self._table.unpin([r.key for r in requests])
        self._ssd.inc("load_calls")
        self._ssd.inc("load_hits", leading)
        self._ssd.inc("load_misses", len(requests) - leading)

    # ------------------------------------------------------------------ store
    def store(self, requests: Sequence[StoreRequest]) -> None:
        for r in requests:
            self.spec.check_tensor(r.data, "StoreRequest.data")
            check_identity(self.spec, r.key, r.digest, tuple(r.token_ids))
            if r.parent is not None and not 1 <= len(r.parent) <= MAX_KEY_LEN:
                raise ValueError(f"StoreRequest.parent must be 1..{MAX_KEY_LEN} bytes, got {len(r.parent)}")
        with self._life:
            if self._closing:
                self._wc.inc("dropped_closed", len(requests))
                return
            self._entering += 1
        try:
            deadline = time.monotonic() + self.config.enqueue_timeout_s
            for r in requests:
                if not self._admit(r):
                    continue
                if self._writer is None:
                    try:
                        self._write_one(r)
                    finally:
                        self._release_claim(r)
                elif self._writer.enqueue(r, deadline):
                    self._wc.inc("enqueued")
                else:
                    self._release_claim(r)
                    self._dropped.add([r.key])
                    self._wc.inc("dropped_queue_full")
        finally:
            with self._life:
                self._entering -= 1
                if self._entering == 0:
                    self._no_entering.notify_all()

    def _on_disk(self, key: bytes) -> bool:
        """The table knows ``key`` and its file still exists. The table can be stale (a
        ``cache clear`` or another process's eviction removes files behind our back): an
        entry whose file is gone is dropped here, so the block is written again instead of
        skipped until the next rescan. One stat, only for keys the table knows."""
        if not self._table.contains(key):
            return False
        if os.path.exists(self.layout.block_path(key)):
            return True
        self._table.discard_if_known(key)
        return False

    def _parent_present(self, parent: bytes) -> bool:
        if self._table.contains(parent):
            return True
        with self._claims_lock:
            if parent in self._claims:
                return True
        return os.path.exists(self.layout.block_path(parent))

    def _admit(self, r: StoreRequest) -> bool:
        """Cheap checks in the caller's thread; claims the key if admitted."""
        if r.key not in self._suspects and self._on_disk(r.key):
            self._ssd.inc("store_skipped_existing")
            self._table.touch([r.key], persist=True)
            return False
        if self._wfault.backing_off():
            self._dropped.add([r.key])
            self._wc.inc("dropped_backoff")
            return False
        with self._claims_lock:
            if r.key in self._claims:
                self._wc.inc("dedup_inflight")
                return False
            self._claims.add(r.key)
        return True

    def wants(self, key: bytes) -> bool:
        """True if a ``store`` of ``key`` now would write it: not known to be on disk, not
        queued or being written, and writes are not backing off. The RAM tier asks this
        before copying a block it evicts, so a write-through block whose store was dropped
        gets its second chance without a copy of every evicted block."""
        if self._closing or self._session is None or self._wfault.backing_off():
            return False
        if key not in self._suspects and self._on_disk(key):
            return False
        with self._claims_lock:
            return key not in self._claims

    def _defer_to_reads(self, max_s: float) -> bool:
        """Reads before writes: the writer waits (up to ``max_s``) while loads are in flight."""
        if self._reader.active:
            self._wc.inc("deferred_for_reads")
        return self._reader.wait_idle(max_s)

    def _release_claim(self, r: StoreRequest) -> None:
        with self._claims_lock:
            self._claims.discard(r.key)

    def _write_one(self, r: StoreRequest) -> None:
        """Write one claimed block: skip if present, make room, write
        atomically (with retries when persistent), account. Never raises for
        OS errors."""
        if self._session is None or self._wfault.backing_off():
            self._dropped.add([r.key])
            self._wc.inc("dropped_backoff")
            return
        final = self.layout.block_path(r.key)
        repairing = False
        try:
            st = os.stat(final)
            if st.st_size == self.file_size:
                if r.key not in self._suspects:
                    self._table.add(r.key, self.file_size, st.st_atime_ns, parent=r.parent)
                    self._ssd.inc("store_skipped_existing")
                    return
                kept = self._check_existing(final, r)
                if kept is not False:
                    return
                repairing = True
        except FileNotFoundError:
            pass
        except OSError as e:
            self._wfault.failure(e, f"checking {final.name}")
            return
        # A block whose parent is not on disk is unreachable until the parent is written
        # (a dropped write RAM offers again): it may use free space, never evict for it.
        orphan = r.parent is not None and not self._parent_present(r.parent)
        if not self._capacity.make_room(self.file_size, r.parent, may_evict=not orphan):
            self._dropped.add([r.key])
            if orphan:
                self._wc.inc("dropped_no_parent")
            return
        payload = tensor_bytes(r.data)
        header = encode_header(self.spec, r.key, r.digest, tuple(r.token_ids), payload_checksum(payload),
                               time.time_ns(), r.parent)
        persistent = self.config.durability == "persistent"
        retries = self.config.persistent_retries if persistent else 0
        dir_retry = True  # one extra try if the shard directory vanished (cache clear)
        attempt = 0
        while True:
            try:
                self._ensure_dir(final.parent, fsync_parent=persistent)
                tmp = NamespaceLayout.tmp_path(final, self._session.token, next(self._seq))
                write_block_file(final, tmp, [header, payload], fsync=persistent, on_leftover=self._add_leftover)
                break
            except FileNotFoundError as e:
                with self._misc_lock:
                    self._known_dirs.discard(final.parent)
                if dir_retry:
                    dir_retry = False
                    continue
                self._dropped.add([r.key])
                self._wfault.failure(e, f"writing {final.name}")
                return
            except OSError as e:
                if attempt < retries:
                    attempt += 1
                    self._wc.inc("retries")
                    time.sleep(min(0.05 * 2 ** (attempt - 1), 0.5))
                    continue
                if retries:
                    self._wc.inc("retry_final_fail")
                self._dropped.add([r.key])
                self._wfault.failure(e, f"writing {final.name}")
                return
        self._table.add(r.key, self.file_size, parent=r.parent)
        self._suspects.pop(r.key)
        if self._dropped.pop(r.key):
            self._wc.inc("written_after_drop")
        if repairing:
            self._ssd.inc("store_repaired")
        self._ssd.inc("stored_blocks")
        self._ssd.inc("stored_bytes", self.file_size)
        self._wfault.success()

    def _check_existing(self, path: Path, r: StoreRequest) -> bool | None:
        """Verify the existing file of a suspect key in full, as a load would. True: it
        is this block, intact, and is kept. False: it was corrupt (counted, deleted) or
        vanished; write it. None: it could not be read (a read fault); drop the store."""
        scratch = torch.empty(self.spec.shape, dtype=self.spec.dtype)
        res = read_block_into(str(path), self.spec, self._header_size,
                              LoadRequest(r.key, r.digest, r.token_ids, scratch))
        self._ssd.inc("store_verified_existing")
        if res.outcome is Outcome.OK:
            self._suspects.pop(r.key)
            self._table.add(r.key, self.file_size, parent=r.parent)
            self._ssd.inc("store_skipped_existing")
            return True
        if res.outcome is Outcome.IO_ERROR:
            assert res.error is not None
            self._rfault.failure(res.error, f"reading {path.name}")
            self._dropped.add([r.key])
            return None
        if res.outcome is Outcome.CORRUPT:
            self._corrupt(path, r.key, res.reason, res.ino, res.dev)
        return False

    def _ensure_dir(self, d: Path, *, fsync_parent: bool) -> None:
        with self._misc_lock:
            if d in self._known_dirs:
                return
        if _mkdir_private(d) and fsync_parent:
            fsync_dir(d.parent)
        with self._misc_lock:
            self._known_dirs.add(d)

    def _add_leftover(self, path: Path) -> None:
        with self._misc_lock:
            self._leftovers.add(path)

    def _unlink_block(self, key: bytes) -> bool:
        """Delete a block's file (eviction, TTL, remove). A failure (EROFS, EIO, EACCES)
        is a fault of the write direction like a failed write: without room, writes
        cannot succeed either (issue 14, F1: a full disk remounted read-only said "ok")."""
        path = self.layout.block_path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._wfault.failure(e, f"deleting {path.name}", counter="delete")
            return False
        return True

    # ------------------------------------------------------------------ maintenance thread
    def _maintenance(self) -> None:
        cfg = self.config
        try:
            self._reconcile(startup=True)
        except Exception:
            _log.exception("disk tier start-up scan failed")
        finally:
            self._scan_done.set()
        now = time.monotonic()
        next_flush = now + cfg.flush_interval_s
        next_prune = now + cfg.prune_interval_s
        last_probe = 0.0
        while not self._stop.is_set():
            if not threading.main_thread().is_alive():
                _log.info("disk tier %s was not closed; draining for up to %.1fs at exit",
                          self.layout.dir, cfg.exit_drain_s)
                self.close(cfg.exit_drain_s)
                return
            now = time.monotonic()
            faulty = self._session is None or self._wfault.in_episode
            try:
                if faulty and now - last_probe >= cfg.probe_interval_s:
                    last_probe = now
                    self._probe()
                if now >= next_flush:
                    next_flush = now + cfg.flush_interval_s
                    self._flush_access_times()
                if now >= next_prune:
                    self._reconcile(startup=False)
                    next_prune = time.monotonic() + cfg.prune_interval_s
            except Exception:
                _log.exception("disk tier maintenance failed")
            wake = min(next_flush, next_prune, now + _MAIN_THREAD_POLL_S)
            if faulty:
                wake = min(wake, last_probe + cfg.probe_interval_s)
            self._stop.wait(max(0.001, wake - time.monotonic()))

    def _reconcile(self, *, startup: bool) -> None:
        """Scan the namespace, adopt/drop table entries, remove orphans, then
        apply TTL and capacity. See recovery.py."""
        if not self.layout.blocks_dir.is_dir():
            return
        try:
            live = scan_sessions(self.layout.sessions_dir, remove_stale=False).live_tokens
            tmp_cutoff = self._opened_ns if startup else time.time_ns() - 60 * 10**9
        except OSError:
            live, tmp_cutoff = set(), 0  # cannot tell who is alive: remove no temp file
        if self._session is not None:
            live.add(self._session.token)
        check_since = None
        if startup and self._stale:
            starts = [s.start_ns for s in self._stale if isinstance(s.start_ns, int)]
            check_since = min(starts) if starts else 0
        started = self._table.now_ns()
        rep = scan_namespace(
            self.layout, self.spec,
            live_tokens=live,
            tmp_older_than_ns=tmp_cutoff,
            check_headers_since_ns=check_since,
            stop=self._stop.is_set,
            wants_parent=lambda key: not self._table.knows_parent(key),
        )
        if self._stop.is_set():
            return  # partial: must not drop entries it did not reach
        adopted, dropped = self._table.merge_scan(rep.found, started, rep.parents)
        c = self._ssd
        c.inc("scans")
        c.inc("scan_seconds", rep.seconds)
        c.inc("recovered_orphan_tmp", rep.orphan_tmp_removed)
        c.inc("recovered_bad_size", rep.bad_size_removed)
        c.inc("recovered_bad_header", rep.bad_header_removed)
        c.inc("recovered_misplaced", rep.misplaced_removed)
        c.inc("recovered_adopted" if startup else "rescan_adopted", adopted)
        c.inc("rescan_dropped", dropped)
        removed = rep.orphan_tmp_removed + rep.bad_size_removed + rep.bad_header_removed + rep.misplaced_removed
        if startup:
            _log.info("disk tier %s: %d blocks (%.1f MiB) found in %.2fs; removed %d orphan temp file(s), "
                      "%d bad file(s); checked %d header(s)", self.layout.dir, len(rep.found),
                      rep.bytes / 2**20, rep.seconds, rep.orphan_tmp_removed, removed - rep.orphan_tmp_removed,
                      rep.headers_checked)
        self._capacity.prune_ttl(self._table.now_ns())
        self._capacity.enforce()

    def _probe(self) -> None:
        """Try a small write; success ends the write fault episode. A failed probe
        neither counts as a write error nor lengthens the back-off. On ENOSPC the
        probe makes room as a write would (a full disk that was read-only can
        only show it is writable again by evicting)."""
        if self._session is None:
            if not self._open_namespace(probe=True):
                self._ssd.inc("probe_failures")
                return
            self._reconcile(startup=True)
        assert self._session is not None
        try:
            try:
                self._probe_write()
            except OSError as e:
                if e.errno != errno.ENOSPC or not self._capacity.make_room(_PROBE_BYTES, count=False):
                    raise
                self._probe_write()
            if not self.layout.descriptor_path.exists():
                self._write_descriptor()
        except OSError as e:
            self._ssd.inc("probe_failures")
            self._wfault.failure(e, "probe write", probe=True)
            return
        self._wfault.success(probe=True)
        with self._misc_lock:
            leftovers, self._leftovers = self._leftovers, set()
        for p in leftovers:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError:
                self._add_leftover(p)

    def _probe_write(self) -> None:
        assert self._session is not None
        path = NamespaceLayout.tmp_path(self.layout.dir / ".probe", self._session.token, next(self._seq))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, bytes(_PROBE_BYTES))
            if self.config.durability == "persistent":
                os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _flush_access_times(self) -> None:
        for key, t in self._table.take_dirty():
            path = self.layout.block_path(key)
            try:
                st = os.stat(path)
                os.utime(path, ns=(t, st.st_mtime_ns))
            except FileNotFoundError:
                pass
            except OSError:
                self._ssd.inc("atime_errors")

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int | float]:
        out = self._ssd.snapshot()
        out.update(self._wc.snapshot())
        free = self._capacity.free_bytes()
        out.update({
            "ssd_blocks": len(self._table),
            "ssd_bytes": self._table.total_bytes,
            "ssd_capacity_bytes": self.config.capacity_bytes,
            "ssd_free_bytes": -1 if free is None else free,
            "ssd_pinned_blocks": self._table.pinned_count(),
            "ssd_scan_complete": int(self._scan_done.is_set()),
            "writer_queue_depth": self._writer.queue_depth if self._writer else 0,
            "writer_in_flight": self._writer.in_flight if self._writer else 0,
            "writer_pending_keys": len(self._claims),
            "ssd_load_batches_in_flight": self._reader.active,
        })
        return out

    def health(self) -> dict[str, object]:
        degraded = self._session is None or self._wfault.in_episode or self._rfault.in_episode
        errors = [(f.last_error_time or 0.0, f.last_error) for f in (self._wfault, self._rfault) if f.last_error]
        last_time, last_error = max(errors) if errors else (None, None)
        no_space = self._capacity.no_space_reason(self.file_size)
        return tier_health(
            self.name, degraded=degraded, no_space=no_space is not None,
            last_error=last_error, last_error_time=last_time,
            writer_queue_depth=self._writer.queue_depth if self._writer else 0,
            closed=self._close_result is not None, last_shutdown_clean=self._last_shutdown_clean,
            detail={
                "unclean_previous_sessions": len(self._stale),
                "writer_in_flight": (self._writer.in_flight if self._writer else 0),
                "write_backoff_s": round(self._wfault.backoff_remaining(), 3),
                "no_space": no_space,
                "min_free_bytes": self._capacity.floor_bytes(),
                "suspect_blocks": len(self._suspects),
                "scan_complete": self._scan_done.is_set(),
                "path": str(self.layout.dir),
                "durability": self.config.durability,
                "async_writes": self.config.async_writes,
            })

    # ------------------------------------------------------------------ waiting and closing
    def wait_idle(self, timeout: float) -> bool:
        """Wait until every admitted block has been written or dropped."""
        deadline = time.monotonic() + timeout
        with self._life:
            if not self._no_entering.wait_for(lambda: self._entering == 0, timeout):
                return False
        return self._writer is None or self._writer.wait_idle(max(0.0, deadline - time.monotonic()))

    def wait_scanned(self, timeout: float) -> bool:
        """Wait until the start-up reconciliation scan has finished."""
        return self._scan_done.wait(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        with self._close_lock:
            if self._close_result is not None:
                return self._close_result
            deadline = time.monotonic() + timeout
            with self._life:
                self._closing = True
                admitted_done = self._no_entering.wait_for(lambda: self._entering == 0, timeout)
            drained = admitted_done
            if self._writer is not None:
                drained = self._writer.close(max(0.0, deadline - time.monotonic())) and drained
            self._stop.set()
            self._reader.close(max(0.0, deadline - time.monotonic()))
            if threading.current_thread() is not self._maint:
                self._maint.join(max(0.0, deadline - time.monotonic()))
            self._flush_access_times()
            if self._session is not None:
                close_session(self._session, clean=drained,
                              reason="" if drained else f"writer not drained within {timeout:.1f}s")
            self._close_result = drained
            return drained

    def __repr__(self) -> str:
        return f"DiskTier({str(self.layout.dir)!r}, {self.spec})"
