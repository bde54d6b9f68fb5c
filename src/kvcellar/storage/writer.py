"""One bounded background writer: a queue of at most ``capacity`` items drained by one
named, non-daemon thread that hands them to ``write_batch`` up to ``batch`` at a time.

Each tier keeps only what is its own: how a batch is written (files, a Redis pipeline)
and the names of its drop counters. Both tiers drop rather than block the engine: a
full queue means the store is slower than KV production, and a dropped block is still
in RAM.

Admission (``offer``, any thread): an item is queued, or refused and counted
(``dropped_queue_full``; ``dropped_closed`` once ``close`` began). With a ``deadline``
(time.monotonic()) a full queue is waited on until then, the wait counted in
``enqueue_wait_s_total``; without one ``offer`` never waits. ``wait_for_room`` asks before
an item exists (a tier asks it before its caller copies a block off the pool): it waits up
to its timeout for room, and a writer that freed nothing during a whole wait is not waited
on again for as long or less until it takes an item off the queue, so a stalled device
costs one wait, not one per item (a longer wait, the shutdown's, is still tried).

Accounting: every accepted item (``enqueued``) is passed to ``write_batch``, which counts
what it wrote, or is counted here: ``error_count`` for a batch whose ``write_batch`` (or
``before_batch``) raised, ``abort_count`` for one dropped by a ``close`` that ran out of
time. ``done(items)``, if given, runs for every accepted item exactly once, whatever
became of it (tiers release their in-flight claims there). Nothing is lost silently.

Shutdown: ``close(timeout)`` refuses new items and waits until the deadline for the thread
to drain the queue and exit. If it has not (a write stuck or slow, or the thread dead),
the thread is told to drop instead of writing and ``close`` empties the queue itself,
counting each item; it never waits past the deadline. A batch still inside
``write_batch`` then is that call's to finish and count.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvcellar.stats import Count

T = TypeVar("T")


class WriterCounts(Protocol):
    """The counts a writer keeps in its tier's stats."""

    enqueued: Count
    dropped_queue_full: Count
    dropped_closed: Count
    enqueue_wait_s_total: Count


class BoundedWriter(Generic[T]):
    """The queue and its thread. ``_lock`` protects ``_queue``, ``_closing``, ``_abort``,
    ``_exited``, ``_unfinished`` (items accepted and not yet written or dropped),
    ``_in_flight`` (of those, inside ``write_batch`` now), ``_stalled_s`` (the longest
    ``wait_for_room`` that timed out since the thread last took an item; 0: none) and
    ``_failures``. Three
    conditions share it: ``_work`` (an item arrived or closing began: the thread),
    ``_space`` (room in the queue or closing began: waiting producers) and ``_settled``
    (``_unfinished`` reached 0 or the thread exited: ``wait_idle``). ``_abort`` only ever
    goes from False to True; the thread reads it without the lock (a stale read costs at
    most one more write)."""

    def __init__(
        self,
        name: str,
        capacity: int,
        write_batch: Callable[[list[T]], None],
        counters: WriterCounts,
        *,
        log: logging.Logger,
        label: str,
        batch: int = 1,
        before_batch: Callable[[], None] | None = None,
        done: Callable[[list[T]], None] | None = None,
        idle: Callable[[], None] | None = None,
        idle_s: float = 0.25,
        error_count: Count,
        abort_count: Count,
    ) -> None:
        """``name``: the thread's; ``label``: the writer in log lines. ``before_batch``: runs in
        the thread before each write (the disk tier defers to reads there). ``idle``: runs
        in the thread every ``idle_s`` while the queue is empty (the remote tier probes a
        faulty connection there). An exception from either is logged (boundedly) and
        survived like one from ``write_batch``."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._label = label
        self._capacity = capacity
        self._batch = max(1, batch)
        self._write_batch = write_batch
        self._before_batch = before_batch
        self._done = done
        self._idle = idle
        self._idle_s = idle_s if idle is not None else None
        self._c = counters
        self._log = log
        self._error_count = error_count
        self._abort_count = abort_count
        self._queue: collections.deque[T] = collections.deque()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._space = threading.Condition(self._lock)
        self._settled = threading.Condition(self._lock)
        self._closing = False
        self._abort = False
        self._exited = False
        self._unfinished = 0
        self._in_flight = 0
        self._stalled_s = 0.0
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    # -- gauges ---------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self._capacity

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- producers ------------------------------------------------------------------------
    def offer(self, item: T, deadline: float | None = None) -> bool:
        """Queue ``item``; with a ``deadline``, wait for room until then. False: refused
        and counted (see the module docstring)."""
        with self._lock:
            if not self._closing and len(self._queue) >= self._capacity and deadline is not None:
                t0 = time.monotonic()
                if deadline > t0:
                    self._space.wait_for(lambda: self._closing or len(self._queue) < self._capacity,
                                         deadline - t0)
                    self._c.enqueue_wait_s_total.add(time.monotonic() - t0)
            if self._closing:
                self._c.dropped_closed.add()
                return False
            if len(self._queue) >= self._capacity:
                self._c.dropped_queue_full.add()
                return False
            self._queue.append(item)
            self._unfinished += 1
            self._c.enqueued.add()
            self._work.notify()
        return True

    def wait_for_room(self, timeout: float) -> bool:
        """Whether an ``offer`` now would find room, waiting up to ``timeout`` for it (not
        at all while the writer is stalled for that long, see the module docstring). False
        once closing. The wait is counted in ``enqueue_wait_s_total``; a refusal is the
        caller's to count."""
        with self._lock:
            if not self._closing and len(self._queue) >= self._capacity and timeout > self._stalled_s:
                t0 = time.monotonic()
                if not self._space.wait_for(lambda: self._closing or len(self._queue) < self._capacity, timeout):
                    self._stalled_s = timeout
                self._c.enqueue_wait_s_total.add(time.monotonic() - t0)
            return not self._closing and len(self._queue) < self._capacity

    def wait_idle(self, timeout: float) -> bool:
        """Until everything accepted so far was written or dropped. False at the deadline,
        or at once if the thread is gone with items still queued."""
        with self._lock:
            self._settled.wait_for(lambda: self._unfinished == 0 or self._exited, timeout)
            return self._unfinished == 0

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    self._work.wait_for(lambda: bool(self._queue) or self._closing, self._idle_s)
                    if not self._queue and self._closing:
                        return
                    items = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                    if items:
                        self._stalled_s = 0.0
                        self._space.notify_all()
                if items:
                    self._write(items)
                elif self._idle is not None:
                    self._call(self._idle, "in its idle call")
        finally:
            with self._lock:
                self._exited = True
                self._settled.notify_all()

    def _write(self, items: list[T]) -> None:
        n = len(items)
        try:
            if self._abort:
                self._abort_count.add(n)
            else:
                if self._before_batch is not None:
                    self._before_batch()
                with self._lock:
                    self._in_flight = n
                self._write_batch(items)
        except Exception:
            self._error_count.add(n)
            self._log_failure(f"writing {n} block(s)")
        except BaseException:  # the thread ends here; its items are still accounted for
            self._error_count.add(n)
            raise
        finally:
            self._finished(items)

    def _call(self, fn: Callable[[], None], what: str) -> None:
        try:
            fn()
        except Exception:
            self._log_failure(what)

    def _log_failure(self, what: str) -> None:
        with self._lock:
            self._failures += 1
            n = self._failures
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: bounded logging
            self._log.exception("%s failed %s (%d failure(s) so far); it goes on", self._label, what, n)

    def _finished(self, items: list[T], *, from_thread: bool = True) -> None:
        """``from_thread``: ``items`` were the thread's batch, not ones ``close`` dropped."""
        if self._done is not None:
            self._done(items)
        with self._lock:
            if from_thread:
                self._in_flight = 0
            self._unfinished -= len(items)
            if self._unfinished == 0:
                self._settled.notify_all()

    # -- shutdown -------------------------------------------------------------------------
    def close(self, timeout: float) -> bool:
        """See the module docstring. True if every accepted item was written (or dropped by
        ``write_batch`` itself) and the thread exited, all within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            self._work.notify_all()
            self._space.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not self._abort and self._exited and self._unfinished == 0:
                return True
            first = not self._abort
            self._abort = True
            left = list(self._queue)
            self._queue.clear()
            in_flight = self._in_flight
        if left:
            self._abort_count.add(len(left))
            self._finished(left, from_thread=False)
        if first:
            self._log.warning("%s not drained within %.1fs (thread %s): dropped %d queued block(s), "
                              "%d still being written", self._label, timeout,
                              "alive" if self._thread.is_alive() else "gone", len(left), in_flight)
        return False
