"""The disk tier's upkeep thread: keeping one open namespace in step with its files.

``Upkeep`` owns the thread ``kvcellar-disk-upkeep-<ns>`` (one per DiskTier, not daemon).
It runs the start-up reconciliation scan (recovery.py), then wakes on a timer to flush
access times (``flush_interval_s``), rescan, prune by TTL and enforce capacity
(``prune_interval_s``), and, while the write direction is in a fault episode or the
namespace could not be opened, probe it (``probe_interval_s``; admission.py writes the
probe). Offline upkeep of a whole KV root, without a tier, is maintenance.py.

Shutdown: the owner calls ``signal_stop`` then ``join``; a scan in progress stops early
and changes nothing. If the main thread ends while the tier is still open, the thread
calls ``on_exit(config.exit_drain_s)`` (``DiskTier.close``) itself and returns.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kvcellar.storage.disk.admission import WriteAdmission
from kvcellar.storage.disk.namespace import OpenNamespace
from kvcellar.storage.disk.recovery import scan_namespace
from kvcellar.storage.disk.sessions import scan_sessions

_log = logging.getLogger("kvcellar.storage.disk")

_MAIN_THREAD_POLL_S = 0.25


class Upkeep:
    """The upkeep thread of one open namespace. ``stop`` and ``scan_done`` are set by
    their owners only: ``signal_stop`` and this thread."""

    def __init__(self, ns: OpenNamespace, admission: WriteAdmission, on_exit: Callable[[float], object]) -> None:
        self._ns = ns
        self._admission = admission
        self._on_exit = on_exit
        self.stop = threading.Event()
        self.scan_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvcellar-disk-upkeep-{ns.layout.namespace[:8]}",
                                        daemon=False)

    def start(self) -> None:
        self._thread.start()

    def signal_stop(self) -> None:
        self.stop.set()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end; a no-op from the thread itself (its exit drain)."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        ns, cfg = self._ns, self._ns.config
        try:
            self.reconcile(startup=True)
        except Exception:
            _log.exception("disk tier start-up scan failed")
        finally:
            self.scan_done.set()
        now = time.monotonic()
        next_flush = now + cfg.flush_interval_s
        next_prune = now + cfg.prune_interval_s
        last_probe = 0.0
        while not self.stop.is_set():
            if not threading.main_thread().is_alive():
                _log.info("disk tier %s was not closed; draining for up to %.1fs at exit",
                          ns.layout.dir, cfg.exit_drain_s)
                self._on_exit(cfg.exit_drain_s)
                return
            now = time.monotonic()
            faulty = ns.session is None or ns.wfault.in_episode
            try:
                if faulty and now - last_probe >= cfg.probe_interval_s:
                    last_probe = now
                    self._probe()
                if now >= next_flush:
                    next_flush = now + cfg.flush_interval_s
                    self.flush_access_times()
                if now >= next_prune:
                    self.reconcile(startup=False)
                    next_prune = time.monotonic() + cfg.prune_interval_s
            except Exception:
                _log.exception("disk tier upkeep failed")
            wake = min(next_flush, next_prune, now + _MAIN_THREAD_POLL_S)
            if faulty:
                wake = min(wake, last_probe + cfg.probe_interval_s)
            self.stop.wait(max(0.001, wake - time.monotonic()))

    def _probe(self) -> None:
        """Open the namespace if it never opened (then scan it as at start-up), and
        probe the write direction."""
        ns = self._ns
        if ns.session is None:
            if not ns.open(probe=True):
                ns.counters.probe_failures.add()
                return
            self.reconcile(startup=True)
        self._admission.probe()

    def reconcile(self, *, startup: bool) -> None:
        """Scan the namespace, adopt/drop table entries, remove orphans, then
        apply TTL and capacity. See recovery.py."""
        ns = self._ns
        if not ns.layout.blocks_dir.is_dir():
            return
        try:
            live = scan_sessions(ns.layout.sessions_dir, remove_stale=False).live_tokens
            tmp_cutoff = ns.opened_ns if startup else time.time_ns() - 60 * 10**9
        except OSError:
            live, tmp_cutoff = set(), 0  # cannot tell who is alive: remove no temp file
        if ns.session is not None:
            live.add(ns.session.token)
        check_since = None
        if startup and ns.stale:
            starts = [s.start_ns for s in ns.stale if isinstance(s.start_ns, int)]
            check_since = min(starts) if starts else 0
        started = ns.table.now_ns()
        rep = scan_namespace(
            ns.layout, ns.spec,
            live_tokens=live,
            tmp_older_than_ns=tmp_cutoff,
            check_headers_since_ns=check_since,
            stop=self.stop.is_set,
            wants_parent=lambda key: not ns.table.knows_parent(key),
        )
        if self.stop.is_set():
            return  # partial: must not drop entries it did not reach
        adopted, dropped = ns.table.merge_scan(rep.found, started, rep.parents)
        c = ns.counters
        c.scans.add()
        c.scan_seconds.add(rep.seconds)
        c.recovered_orphan_tmp.add(rep.orphan_tmp_removed)
        c.recovered_bad_size.add(rep.bad_size_removed)
        c.recovered_bad_header.add(rep.bad_header_removed)
        c.recovered_misplaced.add(rep.misplaced_removed)
        (c.recovered_adopted if startup else c.rescan_adopted).add(adopted)
        c.rescan_dropped.add(dropped)
        removed = rep.orphan_tmp_removed + rep.bad_size_removed + rep.bad_header_removed + rep.misplaced_removed
        if startup:
            _log.info("disk tier %s: %d blocks (%.1f MiB) found in %.2fs; removed %d orphan temp file(s), "
                      "%d bad file(s); checked %d header(s)", ns.layout.dir, len(rep.found),
                      rep.bytes / 2**20, rep.seconds, rep.orphan_tmp_removed, removed - rep.orphan_tmp_removed,
                      rep.headers_checked)
        ns.capacity.prune_ttl(ns.table.now_ns())
        ns.capacity.enforce()

    def flush_access_times(self) -> None:
        """Write the last-access times queued by loads to the files' atimes, where a
        restart's scan reads the LRU order."""
        ns = self._ns
        for key, t in ns.table.take_dirty():
            path = ns.layout.block_path(key)
            try:
                st = os.stat(path)
                os.utime(path, ns=(t, st.st_mtime_ns))
            except FileNotFoundError:
                pass
            except OSError:
                ns.counters.atime_errors.add()
