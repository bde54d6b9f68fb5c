"""DiskTier: the persistent SSD tier of the KV cache, the KVTier verbs.

This file is the facade: lookup, load, store, remove, pin/unpin, touch, wants, stats,
health, close. The parts behind it, one file per concept beside this one:
  namespace.py  the open namespace: directories, session, descriptor, ssd_ counters,
                and the state every part shares (table, capacity, faults, suspects)
  admission.py  whether and where a block is written, the write itself, fault probes
  upkeep.py     the upkeep thread: start-up scan, access times, rescan, TTL, capacity
  layout.py     where files live; ../block_format.py what a block file holds
  writer.py     atomic writes + the writer thread and its bounded queue
  reader.py     verified reads straight into the caller's tensors + reader threads
  table.py      in-memory LRU/size bookkeeping, pins and lookup leases
  capacity.py   byte limit, free-space floor, TTL
  recovery.py   the reconciliation scan (start-up and periodic)
  sessions.py   live/dead openers and last_shutdown_clean
  keys.py       keys to remember: dropped write-through stores, suspect files
  faults.py     fault episodes, logging once, back-off
(maintenance.py is the offline ``kvcellar cache`` side, which needs no DiskTier.)

Threads (all named, none daemon):
  kvcellar-disk-writer-<ns>     writes queued blocks (absent with async_writes=False)
  kvcellar-disk-reader-<ns>-<i> reads load batches
  kvcellar-disk-upkeep-<ns>     start-up scan, then a timer: access-time flush,
                                rescan + TTL prune + capacity, fault probes

Faults: a failed write, delete (eviction, corrupt block) or probe puts the
write direction in a fault episode: ``health()`` says "degraded" with the last
error until a write or a probe succeeds. Probes run every ``probe_interval_s``
during an episode. ``health()`` says "no_space" when the byte limit or the
free-space floor leaves no room for one block even after evicting every block
this tier holds (also logged at start-up).

Shutdown: call ``close(timeout)``. If the program exits without it, the
upkeep thread notices that the main thread has ended and performs the
same close with ``config.exit_drain_s``; the process exits after that. A
SIGKILL leaves this process's session file unlocked: the next opener reports
``last_shutdown_clean = False`` and its scan removes the orphans. A close that
could not drain records why in the session file; ``health()`` shows the
previous session's reason as ``last_shutdown_reason``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest, tier_health
from kvcellar.storage.block_format import MAX_KEY_LEN, CacheSecret, check_identity
from kvcellar.storage.disk.admission import WriteAdmission
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.namespace import OpenNamespace
from kvcellar.storage.disk.reader import Outcome, ReaderPool, read_block_into
from kvcellar.storage.disk.sessions import close_session
from kvcellar.storage.disk.upkeep import Upkeep
from kvcellar.storage.disk.writer import BlockWriter

_log = logging.getLogger("kvcellar.storage.disk")


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
    # A load may take ``KVTier.load_timeout_s`` plus its bytes at this rate: the gigabytes
    # of a long prefix of a large model, on a slow disk, are still a hit.
    load_bytes_per_s = 64 * 2**20

    def __init__(
        self,
        root: Path | str,
        namespace: str,
        spec: BlockSpec,
        config: DiskConfig | None = None,
        descriptor: dict[str, Any] | None = None,
        secret: bytes | CacheSecret | None = None,
    ) -> None:
        self.spec = spec
        self.config = config = config or DiskConfig()
        self.evict_wait_s = config.evict_wait_s
        self._ns = ns = OpenNamespace(Path(root), namespace, spec, config, descriptor, secret)
        self.layout = ns.layout
        self.file_size = ns.file_size
        self._table = ns.table
        self._admission = WriteAdmission(ns)
        # _life protects _closing and _entering (store() calls in progress).
        self._life = threading.Lock()
        self._no_entering = threading.Condition(self._life)
        self._closing = False
        self._entering = 0
        self._close_lock = threading.Lock()
        self._close_result: bool | None = None

        ns.open()
        no_space = ns.capacity.no_space_reason(self.file_size)
        if no_space:
            _log.warning("disk tier %s will store nothing: %s", self.layout.dir, no_space)
        ns8 = namespace[:8]
        self._reader = ReaderPool(config.io_threads, f"kvcellar-disk-reader-{ns8}", self._read_one, self._batch_done)
        self._writer: BlockWriter | None = None
        if config.async_writes:
            self._writer = BlockWriter(f"kvcellar-disk-writer-{ns8}", config.queue_blocks, self._admission.write,
                                       self._admission.release, self._defer_to_reads, config.write_defer_max_s,
                                       self._admission.counters)
        self._upkeep = Upkeep(ns, self._admission, self.close)
        self._upkeep.start()

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
                self._ns.forget_missing(k)
                break
            if st.st_size != self.file_size:
                # Final names only ever come from renaming a complete file: a wrong size is a
                # damaged block. A miss, deleted and counted like any corrupt block.
                self._ns.corrupt(self.layout.block_path(k), k, "size", st.st_ino, st.st_dev)
                self._ns.suspects.add(keys[n + 1:])
                break
            if not self._table.contains(k):  # written by another process, or not scanned yet
                self._table.add(k, self.file_size, st.st_atime_ns)
            n += 1
        self._table.link_chain(keys[:n])
        self._table.release_leases(keys[n:])
        self._table.touch(keys[:n], persist=False)
        self._ns.counters.lookup_calls.add()
        self._ns.counters.lookup_hit_blocks.add(n)
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        self._table.touch(keys, persist=True)

    def pin(self, keys: Sequence[bytes]) -> None:
        self._table.pin(list(keys))

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._table.unpin(list(keys))

    def drops_with_its_blocks(self, other: DiskTier) -> None:
        """``other`` keeps entries keyed as this tier's blocks that are worthless without them
        (a hybrid model's snapshots, each keyed by the block before its boundary): a block this
        tier evicts or ages out takes ``other``'s entry of its key with it. Eviction takes a
        chain's tail first, so a snapshot never outlives a block before it this way."""
        self._ns.on_dropped = lambda key: other.remove([key])

    def remove(self, keys: Sequence[bytes]) -> int:
        """Unlink the block files of ``keys``; absent keys are ignored. Returns how many
        files were removed (``ssd_removed_blocks``). A read in progress keeps its open file
        (POSIX unlink), so removing a block that is being loaded is safe."""
        n = 0
        for k in keys:
            existed = self.layout.block_path(k).exists()
            self._table.discard(k)
            if self._ns.unlink_block(k) and existed:
                n += 1
        self._ns.counters.removed_blocks.add(n)
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
        ns = self._ns
        path = self.layout.block_path(req.key)
        res = read_block_into(str(path), self.spec, ns.header_size, req, ns.seal)
        if res.outcome is Outcome.OK:
            self._table.add(req.key, self.file_size, persist=True)
            ns.counters.load_bytes.add(self.spec.nbytes)
            ns.rfault.success()
            return True
        if res.outcome is Outcome.MISSING:
            ns.counters.load_missing.add()
            self._table.discard(req.key)
        elif res.outcome is Outcome.IO_ERROR:
            assert res.error is not None
            ns.rfault.failure(res.error, f"reading {path.name}")
        else:
            ns.corrupt(path, req.key, res.reason, res.ino, res.dev)
        return False

    def _batch_done(self, requests: Sequence[LoadRequest], leading: int) -> None:
        if leading < len(requests) and requests[leading].key in self._ns.suspects:
            # The run ended at a corrupt block: the rest of the chain was not read.
            self._ns.suspects.add(r.key for r in requests[leading + 1:])
        self._table.link_chain([r.key for r in requests[:leading]])
        self._table.unpin([r.key for r in requests])
        c = self._ns.counters
        c.load_calls.add()
        c.load_hits.add(leading)
        c.load_misses.add(len(requests) - leading)

    # ------------------------------------------------------------------ store
    def store(self, requests: Sequence[StoreRequest]) -> None:
        for r in requests:
            self.spec.check_tensor(r.data, "StoreRequest.data")
            check_identity(self.spec, r.key, r.digest, tuple(r.token_ids))
            if r.parent is not None and not 1 <= len(r.parent) <= MAX_KEY_LEN:
                raise ValueError(f"StoreRequest.parent must be 1..{MAX_KEY_LEN} bytes, got {len(r.parent)}")
        with self._life:
            if self._closing:
                self._admission.counters.dropped_closed.add(len(requests))
                return
            self._entering += 1
        try:
            deadline = time.monotonic() + self.config.enqueue_timeout_s
            for r in requests:
                self._admission.submit(r, self._writer, deadline)
        finally:
            with self._life:
                self._entering -= 1
                if self._entering == 0:
                    self._no_entering.notify_all()

    def wants(self, key: bytes, wait_s: float = 0.0) -> bool:
        """True if a ``store`` of ``key`` now would write it: not known to be on disk, not
        queued or being written, writes are not backing off, the limits leave room for a
        block (state not ``no_space``) and so does the writer's queue, after waiting up to
        ``wait_s`` for it. A block refused for a full queue is a dropped store, counted
        (``writer_dropped_queue_full``) before anyone copies it. The RAM tier asks this
        before copying a block it evicts, so a write-through block whose store was dropped
        gets its second chance without a copy of every evicted block."""
        if self._closing or not self._admission.wants(key):
            return False
        if self._writer is None or self._writer.wait_for_room(wait_s):
            return True
        if not self._closing:
            self._admission.counters.dropped_queue_full.add()
            self._admission.dropped.add([key])
        return False

    def _defer_to_reads(self, max_s: float) -> bool:
        """Reads before writes: the writer waits (up to ``max_s``) while loads are in flight."""
        if self._reader.active:
            self._admission.counters.deferred_for_reads.add()
        return self._reader.wait_idle(max_s)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int | float]:
        out = self._ns.counters.as_dict()
        out.update(self._admission.counters.as_dict())
        free = self._ns.capacity.free_bytes()
        out.update({
            "ssd_blocks": len(self._table),
            "ssd_bytes": self._table.total_bytes,
            "ssd_capacity_bytes": self.config.capacity_bytes,
            "ssd_free_bytes": -1 if free is None else free,
            "ssd_pinned_blocks": self._table.pinned_count(),
            "ssd_scan_complete": int(self._upkeep.scan_done.is_set()),
            "writer_queue_depth": self._writer.queue_depth if self._writer else 0,
            "writer_in_flight": self._writer.in_flight if self._writer else 0,
            "writer_pending_keys": self._admission.pending_keys,
            "ssd_load_batches_in_flight": self._reader.active,
        })
        return out

    def health(self) -> dict[str, object]:
        ns = self._ns
        degraded = ns.session is None or ns.wfault.in_episode or ns.rfault.in_episode
        errors = [(f.last_error_time or 0.0, f.last_error) for f in (ns.wfault, ns.rfault) if f.last_error]
        last_time, last_error = max(errors) if errors else (None, None)
        no_space = ns.capacity.no_space_reason(self.file_size)
        return tier_health(
            self.name, degraded=degraded, no_space=no_space is not None,
            last_error=last_error, last_error_time=last_time,
            writer_queue_depth=self._writer.queue_depth if self._writer else 0,
            closed=self._close_result is not None, last_shutdown_clean=ns.last_shutdown_clean,
            detail={
                "unclean_previous_sessions": len(ns.stale),
                # Why the previous shutdown was unclean, as the dead session recorded it; None if clean.
                "last_shutdown_reason": ns.last_shutdown_reason,
                "writer_in_flight": (self._writer.in_flight if self._writer else 0),
                "write_backoff_s": round(ns.wfault.backoff_remaining(), 3),
                "no_space": no_space,
                "min_free_bytes": ns.capacity.floor_bytes(),
                "suspect_blocks": len(ns.suspects),
                "scan_complete": self._upkeep.scan_done.is_set(),
                "path": str(self.layout.dir),
                "durability": self.config.durability,
                "async_writes": self.config.async_writes,
                "sealed": ns.seal is not None,
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
        return self._upkeep.scan_done.wait(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        with self._close_lock:
            if self._close_result is not None:
                return self._close_result
            deadline = time.monotonic() + timeout
            with self._life:
                self._closing = True
                admitted_done = self._no_entering.wait_for(lambda: self._entering == 0, timeout)
            reasons = [] if admitted_done else [f"store() calls still admitting blocks after {timeout:.1f}s"]
            if self._writer is not None and not self._writer.close(max(0.0, deadline - time.monotonic())):
                # The writer drops queued blocks only once a close has aborted it: the count is this close's.
                dropped = int(self._admission.counters.dropped_abort.value)
                reasons.append(f"writer did not drain within {timeout:.1f}s: {dropped} queued block(s) dropped")
            drained = not reasons
            self._upkeep.signal_stop()
            self._reader.close(max(0.0, deadline - time.monotonic()))
            self._upkeep.join(max(0.0, deadline - time.monotonic()))
            self._upkeep.flush_access_times()
            if self._ns.session is not None:
                close_session(self._ns.session, clean=drained, reason="; ".join(reasons))
            self._close_result = drained
            return drained

    def __repr__(self) -> str:
        return f"DiskTier({str(self.layout.dir)!r}, {self.spec})"
