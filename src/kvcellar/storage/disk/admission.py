"""Write admission of the disk tier: whether a block is written, where it goes, and writing it.

``WriteAdmission`` owns the ``writer_`` counters, the in-flight claims (a key queued or
being written is written once) and the record of dropped write-through stores (keys.py).
A store passes three gates:

1. ``admit`` (caller's thread, cheap): not already on disk (unless a suspect), the write
   direction is not backing off after a fault, the key is not claimed; claims it.
2. ``write`` (writer thread, or the caller's with ``async_writes=False``): the session is
   open and not backing off, the file is absent (or a suspect that fails its check), and
   the capacity guard makes room under the byte limit and the free-space floor. A block
   whose parent is not on disk may use free space but never evicts for it.
3. The atomic write (writer.py), with bounded retries when ``durability`` is persistent.

``probe`` is how a fault episode ends: the upkeep thread calls it while the write
direction is degraded, and a successful small write clears the episode.

Thread-safety: ``_claims_lock`` protects ``_claims``; every method may be called from any
thread. Counters merge into ``DiskTier.stats``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path

import torch

from kvcellar.paths import full_fsync
from kvcellar.storage.base import LoadRequest, StoreRequest
from kvcellar.storage.block_format import header_of
from kvcellar.storage.disk.keys import KeyRecord
from kvcellar.storage.disk.namespace import OpenNamespace
from kvcellar.storage.disk.reader import Outcome, read_block_into, tensor_bytes
from kvcellar.storage.disk.stats import DiskWriterStats
from kvcellar.storage.disk.writer import BlockWriter, write_block_file

_PROBE_BYTES = 4096


class WriteAdmission:
    """Decides and performs the writes of one open namespace."""

    def __init__(self, ns: OpenNamespace) -> None:
        self._ns = ns
        self.counters = DiskWriterStats()
        # _claims_lock protects _claims: keys queued or being written (in-flight dedup).
        self._claims_lock = threading.Lock()
        self._claims: set[bytes] = set()
        self.dropped = KeyRecord(1 << 16)  # write-through stores dropped (keys.py)

    @property
    def pending_keys(self) -> int:
        return len(self._claims)

    # ------------------------------------------------------------------ admission
    def submit(self, r: StoreRequest, writer: BlockWriter | None, deadline: float) -> None:
        """Admit ``r``, then write it now (no writer) or queue it until ``deadline``;
        a queue still full then drops it."""
        if not self.admit(r):
            return
        if writer is None:
            try:
                self.write(r)
            finally:
                self.release(r)
        elif not writer.offer(r, deadline):  # the writer counts the drop
            self.release(r)
            self.dropped.add([r.key])

    def admit(self, r: StoreRequest) -> bool:
        """Cheap checks in the caller's thread; claims the key if admitted."""
        ns = self._ns
        if r.key not in ns.suspects and self._on_disk(r.key):
            ns.counters.store_skipped_existing.add()
            ns.table.touch([r.key], persist=True)
            return False
        if ns.wfault.backing_off():
            self.dropped.add([r.key])
            self.counters.dropped_backoff.add()
            return False
        with self._claims_lock:
            if r.key in self._claims:
                self.counters.dedup_inflight.add()
                return False
            self._claims.add(r.key)
        return True

    def wants(self, key: bytes) -> bool:
        """True if a store of ``key`` now would be admitted (see ``DiskTier.wants``)."""
        ns = self._ns
        if ns.session is None or ns.wfault.backing_off() or not ns.capacity.has_room(ns.file_size):
            return False
        if key not in ns.suspects and self._on_disk(key):
            return False
        with self._claims_lock:
            return key not in self._claims

    def release(self, r: StoreRequest) -> None:
        with self._claims_lock:
            self._claims.discard(r.key)

    def _on_disk(self, key: bytes) -> bool:
        """The table knows ``key`` and its file still exists. The table can be stale (a
        ``cache clear`` or another process's eviction removes files behind our back): an
        entry whose file is gone is dropped here, so the block is written again instead of
        skipped until the next rescan. One stat, only for keys the table knows."""
        ns = self._ns
        if not ns.table.contains(key):
            return False
        if os.path.exists(ns.layout.block_path(key)):
            return True
        ns.forget_missing(key)
        return False

    def _parent_present(self, parent: bytes) -> bool:
        if self._ns.table.contains(parent):
            return True
        with self._claims_lock:
            if parent in self._claims:
                return True
        return os.path.exists(self._ns.layout.block_path(parent))

    # ------------------------------------------------------------------ writing
    def write(self, r: StoreRequest) -> None:
        """Write one claimed block: skip if present, make room, write
        atomically (with retries when persistent), account. Never raises for
        OS errors."""
        ns, c = self._ns, self._ns.counters
        if ns.session is None or ns.wfault.backing_off():
            self.dropped.add([r.key])
            self.counters.dropped_backoff.add()
            return
        final = ns.layout.block_path(r.key)
        repairing = False
        try:
            st = os.stat(final)
            if st.st_size == ns.file_size:
                if r.key not in ns.suspects:
                    ns.table.add(r.key, ns.file_size, st.st_atime_ns, parent=r.parent)
                    c.store_skipped_existing.add()
                    return
                kept = self._check_existing(final, r)
                if kept is not False:
                    return
                repairing = True
        except FileNotFoundError:
            pass
        except OSError as e:
            ns.wfault.failure(e, f"checking {final.name}")
            return
        # A block whose parent is not on disk is unreachable until the parent is written
        # (a dropped write RAM offers again): it may use free space, never evict for it.
        orphan = r.parent is not None and not self._parent_present(r.parent)
        if not ns.capacity.make_room(ns.file_size, r.parent, may_evict=not orphan):
            self.dropped.add([r.key])
            if orphan:
                self.counters.dropped_no_parent.add()
            return
        payload = tensor_bytes(r.data)
        header = header_of(ns.spec, r.key, r.digest, tuple(r.token_ids), payload, time.time_ns(), r.parent, ns.seal)
        persistent = ns.config.durability == "persistent"
        retries = ns.config.persistent_retries if persistent else 0
        dir_retry = True  # one extra try if the shard directory vanished (cache clear)
        attempt = 0
        while True:
            try:
                ns.ensure_dir(final.parent, fsync_parent=persistent)
                write_block_file(final, ns.tmp_path(final), [header, payload], fsync=persistent,
                                 on_leftover=ns.add_leftover)
                break
            except FileNotFoundError as e:
                ns.forget_dir(final.parent)
                if dir_retry:
                    dir_retry = False
                    continue
                self.dropped.add([r.key])
                ns.wfault.failure(e, f"writing {final.name}")
                return
            except OSError as e:
                if attempt < retries:
                    attempt += 1
                    self.counters.retries.add()
                    time.sleep(min(0.05 * 2 ** (attempt - 1), 0.5))
                    continue
                if retries:
                    self.counters.retry_final_fail.add()
                self.dropped.add([r.key])
                ns.wfault.failure(e, f"writing {final.name}")
                return
        ns.table.add(r.key, ns.file_size, parent=r.parent)
        ns.suspects.pop(r.key)
        if self.dropped.pop(r.key):
            self.counters.written_after_drop.add()
        if repairing:
            c.store_repaired.add()
        c.stored_blocks.add()
        c.stored_bytes.add(ns.file_size)
        ns.wfault.success()

    def _check_existing(self, path: Path, r: StoreRequest) -> bool | None:
        """Verify the existing file of a suspect key in full, as a load would. True: it
        is this block, intact, and is kept. False: it was corrupt (counted, deleted) or
        vanished; write it. None: it could not be read (a read fault); drop the store."""
        ns = self._ns
        scratch = torch.empty(ns.spec.shape, dtype=ns.spec.dtype)
        res = read_block_into(str(path), ns.spec, ns.header_size,
                              LoadRequest(r.key, r.digest, r.token_ids, scratch), ns.seal)
        ns.counters.store_verified_existing.add()
        if res.outcome is Outcome.OK:
            ns.suspects.pop(r.key)
            ns.table.add(r.key, ns.file_size, parent=r.parent)
            ns.counters.store_skipped_existing.add()
            return True
        if res.outcome is Outcome.IO_ERROR:
            assert res.error is not None
            ns.rfault.failure(res.error, f"reading {path.name}")
            self.dropped.add([r.key])
            return None
        if res.outcome is Outcome.CORRUPT:
            ns.corrupt(path, r.key, res.reason, res.ino, res.dev)
        return False

    # ------------------------------------------------------------------ probing
    def probe(self) -> None:
        """Try a small write on the open namespace; success ends the write fault episode.
        A failed probe neither counts as a write error nor lengthens the back-off. On
        ENOSPC the probe makes room as a write would (a full disk that was read-only can
        only show it is writable again by evicting)."""
        ns = self._ns
        try:
            try:
                self._probe_write()
            except OSError as e:
                if e.errno != errno.ENOSPC or not ns.capacity.make_room(_PROBE_BYTES, count=False):
                    raise
                self._probe_write()
            if not ns.layout.descriptor_path.exists():
                ns.write_descriptor()
        except OSError as e:
            ns.counters.probe_failures.add()
            ns.wfault.failure(e, "probe write", probe=True)
            return
        ns.wfault.success(probe=True)
        ns.remove_leftovers()

    def _probe_write(self) -> None:
        ns = self._ns
        path = ns.tmp_path(ns.layout.dir / ".probe")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, bytes(_PROBE_BYTES))
            if ns.config.durability == "persistent":
                full_fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
