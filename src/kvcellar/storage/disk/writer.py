"""Writing blocks: the atomic file write, and the writer thread with its
bounded queue.

Atomic write: a temporary file in the block's own shard directory (created
O_EXCL, mode 0600), header and payload written with one ``writev``, fsync if
the durability policy asks for it, then ``rename`` over the final name, then
fsync of the directory (persistent). A reader therefore sees either no file
or a complete one; a crash leaves at worst a ``.tmp`` orphan, which start-up
removes. A failed write removes its temporary file before reporting.

Back-pressure (``BlockWriter.enqueue``): try to put without waiting; if the
queue is full, wait until the caller's deadline (one budget for the whole
``store()`` call, ``enqueue_timeout_s``, default 1 ms), then drop the block
and count it (``writer_dropped_queue_full``). Measured with
benchmarks/bench_disk_io.py ("tier", 368 KiB blocks, 64-block queue): under
sustained overload a 0/2/10 ms budget wrote 7/11/25 % of the blocks at a
median store() cost of 0.2/2.5/10.5 ms; for 128-block bursts every 300 ms it
wrote 50/51/52 %. Waiting buys only what the writer frees meanwhile, so the
budget stays small and the queue size is the real knob. A synchronous
fallback was rejected: a full queue means the disk is slower than KV
production, and writing in the caller's thread makes the engine's step as
slow as the disk (11 ms per block measured here with fsync; a stalled device
takes seconds), while a dropped write-through block costs nothing now (it is
still in RAM). It is not lost: the tier records the key (keys.py) and
``DiskTier.wants`` asks for it again when the RAM tier evicts the block or
shuts down, when no step waits on the queue (cache/tiering.py).

Thread and shutdown protocol: one non-daemon thread,
``kvcellar-disk-writer-<ns>``. DiskTier.close: (1) refuses new ``store``
calls; (2) waits for ``store`` calls already admitted (each is bounded by its
deadline); then ``BlockWriter.close`` (3) enqueues the sentinel, which is
therefore the last item, and (4) joins until the deadline. On timeout the thread is told to drop what is
left (counted) and exits after its current write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvcellar.storage.base import StoreRequest
from kvcellar.storage.counters import Counters

_log = logging.getLogger("kvcellar.storage.disk")


def write_block_file(
    final: Path,
    tmp: Path,
    parts: list[memoryview | bytes | bytearray],
    *,
    fsync: bool,
    on_leftover: Callable[[Path], None],
) -> None:
    """Atomically create ``final`` with the concatenation of ``parts``.
    Raises OSError on failure, after removing ``tmp`` (or reporting it to
    ``on_leftover`` when even that fails, e.g. on a read-only remount)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            _writev_all(fd, parts)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:
            on_leftover(tmp)
        raise
    if fsync:
        fsync_dir(final.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writev_all(fd: int, parts: list[memoryview | bytes | bytearray]) -> None:
    bufs = [memoryview(p) for p in parts]
    while bufs:
        n = os.writev(fd, bufs)
        if n <= 0:
            raise OSError(f"writev wrote {n} bytes")
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]


_SENTINEL = object()


class BlockWriter:
    """The writer thread and its queue.

    ``write_one(req)`` writes one block (the tier's policy: dedup, capacity,
    faults); ``done(req)`` runs after it, whatever happened (release the
    in-flight claim). ``defer_to_reads(max_s)`` waits while loads are in
    flight. The caller (DiskTier) stops admitting ``store`` calls before
    ``close``. ``_life`` protects ``_unfinished``; ``_idle`` signals it is 0.
    """

    def __init__(
        self,
        name: str,
        queue_blocks: int,
        write_one: Callable[[StoreRequest], None],
        done: Callable[[StoreRequest], None],
        defer_to_reads: Callable[[float], bool],
        defer_max_s: float,
        counters: Counters,
    ) -> None:
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_blocks)
        self._write_one = write_one
        self._done = done
        self._defer_to_reads = defer_to_reads
        self._defer_max_s = defer_max_s
        self._c = counters
        self._life = threading.Lock()
        self._idle = threading.Condition(self._life)
        self._unfinished = 0
        self._in_flight = 0
        self._abort = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    # -- producer side (store) -------------------------------------------------
    def enqueue(self, req: StoreRequest, deadline: float) -> bool:
        """Queue ``req``, waiting for space at most until ``deadline``
        (time.monotonic()). False: not queued (the caller counts the drop)."""
        with self._life:
            self._unfinished += 1
        try:
            self._queue.put_nowait(req)
            return True
        except queue.Full:
            pass
        t0 = time.monotonic()
        remaining = deadline - t0
        ok = False
        if remaining > 0:
            try:
                self._queue.put(req, timeout=remaining)
                ok = True
            except queue.Full:
                pass
            self._c.inc("enqueue_wait_s_total", time.monotonic() - t0)
        if not ok:
            with self._life:
                self._unfinished -= 1
                if self._unfinished == 0:
                    self._idle.notify_all()
        return ok

    # -- consumer side -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _SENTINEL:
                return
            assert isinstance(item, StoreRequest)
            try:
                if self._abort:
                    self._c.inc("dropped_abort")
                else:
                    if self._defer_to_reads(self._defer_max_s) is False:
                        self._c.inc("deferred_timeouts")
                    self._in_flight = 1
                    self._write_one(item)
            except Exception:
                self._c.inc("failed")
                _log.exception("disk tier writer failed on one block")
            finally:
                self._in_flight = 0
                self._done(item)
                with self._life:
                    self._unfinished -= 1
                    if self._unfinished == 0:
                        self._idle.notify_all()

    # -- gauges and control ------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued block has been written or dropped."""
        with self._life:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self, timeout: float) -> bool:
        """See the module docstring. True if the queue was fully drained."""
        deadline = time.monotonic() + timeout
        if not self._thread.is_alive():
            return not self._abort
        try:
            self._queue.put(_SENTINEL, timeout=max(0.001, deadline - time.monotonic()))
            self._thread.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        if self._thread.is_alive():
            left = self._queue.qsize()
            self._abort = True
            _log.warning("disk tier writer not drained within %.1fs; dropping %d queued block(s)", timeout, left)
            with contextlib.suppress(queue.Full):
                self._queue.put(_SENTINEL, timeout=1.0)
            self._thread.join(1.0)
            return False
        return not self._abort
