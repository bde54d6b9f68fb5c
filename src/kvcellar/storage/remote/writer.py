"""The remote tier's store queue and its one writer thread.

``offer`` (any thread; the engine's step loop) never waits: a block goes into a bounded
queue or is dropped and counted, so a slow or full Redis costs decode nothing. The
thread ``kvcellar-remote-writer-<ns>`` takes up to ``batch`` blocks at a time and hands
them to ``write_batch``; while idle it calls ``idle`` every ``idle_s`` (the tier probes
a faulty connection there, so it recovers without traffic).

Shutdown: ``close(timeout)`` stops ``offer``, lets the thread drain the queue until the
deadline, then drops (counted) what is left and joins. Nothing is lost silently.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from kvcellar.storage.base import StoreRequest
from kvcellar.storage.counters import Counters

_STOP = object()


class RemoteWriter:
    def __init__(self, name: str, capacity: int, batch: int, write_batch: Callable[[list[StoreRequest]], None],
                 idle: Callable[[], None], counters: Counters, idle_s: float = 0.25) -> None:
        self._queue: queue.Queue[object] = queue.Queue(maxsize=capacity)
        self._batch = batch
        self._write_batch = write_batch
        self._idle = idle
        self._idle_s = idle_s
        self._c = counters
        # _lock protects _closing and _busy (blocks taken off the queue, not yet written).
        self._lock = threading.Lock()
        self._closing = False
        self._busy = 0
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def full(self) -> bool:
        return self._queue.full()

    def offer(self, request: StoreRequest) -> bool:
        with self._lock:
            if self._closing:
                self._c.inc("dropped_closed")
                return False
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self._c.inc("dropped_queue_full")
            return False
        self._c.inc("enqueued")
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Until everything offered so far was written or dropped (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._queue.empty() and self._busy == 0:
                    return True
            time.sleep(0.01)
        return False

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                self._idle()
                continue
            if item is _STOP:
                return
            batch = [item]
            while len(batch) < self._batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    self._queue.put(_STOP)  # seen after this batch
                    break
                batch.append(more)
            requests = [r for r in batch if isinstance(r, StoreRequest)]
            with self._lock:
                self._busy = len(requests)
            try:
                if self._abort.is_set():
                    self._c.inc("dropped_closed", len(requests))
                else:
                    self._write_batch(requests)
            finally:
                with self._lock:
                    self._busy = 0

    def close(self, timeout: float) -> bool:
        """Drain within ``timeout``; True if nothing had to be dropped for lack of time."""
        with self._lock:
            self._closing = True
        deadline = time.monotonic() + timeout
        drained = self.wait_idle(timeout)
        if not drained:
            self._abort.set()
        self._queue.put(_STOP)
        self._thread.join(max(0.1, deadline - time.monotonic()) + 1.0)
        return drained
