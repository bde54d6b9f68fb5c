"""The remote tier's store queue and its one writer thread.

``offer`` (any thread; the engine's step loop) never waits: a block goes into a bounded
queue or is dropped and counted, so a slow or full Redis costs decode nothing. The
thread ``kvcellar-remote-writer-<ns>`` takes up to ``batch`` blocks at a time and hands
them to ``write_batch``; while idle it calls ``idle`` every ``idle_s`` (the tier probes
a faulty connection there, so it recovers without traffic). An exception out of either
callback is counted (a batch's blocks as ``dropped_error``), logged, and survived.

Accounting: every block ``offer`` accepted (``enqueued``) ends written by ``write_batch``
(which counts what it wrote or dropped) or counted here as ``dropped_error`` or
``dropped_closed``; a refused one is counted at once (``dropped_queue_full``,
``dropped_closed``). Nothing is lost silently.

Shutdown: ``close(timeout)`` stops ``offer`` (under the lock ``offer`` queues under, so
no block slips in behind it), wakes the thread, and waits until the deadline for it to
drain the queue and exit. If it has not (a write stuck or slow, or the thread dead), the
thread is told to drop instead of writing, and ``close`` empties the queue itself,
counting each block as ``dropped_closed``; it never waits on the queue or the thread
past the deadline. A batch still inside ``write_batch`` then is the callback's to count.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

from kvcellar.storage.base import StoreRequest
from kvcellar.storage.counters import Counters

_log = logging.getLogger("kvcellar.storage.remote")

_WAKE = object()  # put by close: an idle thread sees the shutdown at once


class RemoteWriter:
    """``_lock`` protects ``_closing``, ``_abort``, ``_exited``, ``_unfinished`` (blocks
    accepted, not yet written or dropped), ``_in_flight`` (of those, inside ``write_batch``
    now) and ``_failures``; ``_changed`` signals that ``_unfinished`` reached 0 or the
    thread exited.
    ``_closing`` and ``_abort`` only ever go from False to True; the thread reads them
    without the lock (a stale read costs at most one more batch or idle call)."""

    def __init__(self, name: str, capacity: int, batch: int, write_batch: Callable[[list[StoreRequest]], None],
                 idle: Callable[[], None], counters: Counters, idle_s: float = 0.25) -> None:
        self._queue: queue.Queue[object] = queue.Queue(maxsize=capacity)
        self._batch = max(1, batch)
        self._write_batch = write_batch
        self._idle = idle
        self._idle_s = idle_s
        self._c = counters
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closing = False
        self._abort = False
        self._exited = False
        self._unfinished = 0
        self._in_flight = 0
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def full(self) -> bool:
        return self._queue.full()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def offer(self, request: StoreRequest) -> bool:
        """Queue ``request`` without waiting. False: refused and counted."""
        with self._lock:
            if self._closing:
                self._c.inc("dropped_closed")
                return False
            try:
                self._queue.put_nowait(request)
            except queue.Full:
                self._c.inc("dropped_queue_full")
                return False
            self._unfinished += 1
            self._c.inc("enqueued")
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Until everything offered so far was written or dropped (tests, benchmarks). False
        at the deadline, or at once if the thread is gone with blocks still queued."""
        with self._changed:
            self._changed.wait_for(lambda: self._unfinished == 0 or self._exited, timeout)
            return self._unfinished == 0

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not (self._closing and self._queue.empty()):
                try:
                    item = self._queue.get(timeout=self._idle_s)
                except queue.Empty:
                    if not self._closing:
                        self._call_idle()
                    continue
                batch = [item]
                while len(batch) < self._batch:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                requests = [r for r in batch if isinstance(r, StoreRequest)]
                if requests:
                    self._write(requests)
        finally:
            with self._changed:
                self._exited = True
                self._changed.notify_all()

    def _write(self, requests: list[StoreRequest]) -> None:
        with self._lock:
            self._in_flight = len(requests)
        try:
            if self._abort:
                self._c.inc("dropped_closed", len(requests))
            else:
                self._write_batch(requests)
        except Exception:
            self._c.inc("dropped_error", len(requests))
            self._log_failure(f"writing a batch of {len(requests)} block(s)")
        except BaseException:  # the thread ends here; its blocks are still accounted for
            self._c.inc("dropped_error", len(requests))
            raise
        finally:
            self._finished(len(requests), in_flight=True)

    def _call_idle(self) -> None:
        try:
            self._idle()
        except Exception:
            self._log_failure("its idle call")

    def _log_failure(self, what: str) -> None:
        with self._lock:
            self._failures += 1
            n = self._failures
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: bounded logging
            _log.exception("remote tier writer: %s failed (%d failure(s) so far); it goes on", what, n)

    def _finished(self, n: int, *, in_flight: bool = False) -> None:
        with self._changed:
            if in_flight:
                self._in_flight = 0
            self._unfinished -= n
            if self._unfinished == 0:
                self._changed.notify_all()

    # -- shutdown -----------------------------------------------------------------------
    def close(self, timeout: float) -> bool:
        """See the module docstring. True if every accepted block was written (or dropped by
        ``write_batch`` itself) and the thread exited, all within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
        with contextlib.suppress(queue.Full):  # full: the thread is not idle, it needs no waking
            self._queue.put_nowait(_WAKE)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._exited and self._unfinished == 0:
                return True
            self._abort = True
        left = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, StoreRequest):
                left += 1
                self._c.inc("dropped_closed")
                self._finished(1)
        _log.warning("remote tier writer not done within %.1fs (thread %s): dropped %d queued block(s), "
                     "%d still being written", timeout, "alive" if self._thread.is_alive() else "gone", left,
                     self._in_flight)
        return False
