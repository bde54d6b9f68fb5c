"""Writing blocks: the atomic file write, and the disk tier's writer thread with its
bounded queue.

Atomic write: a temporary file in the block's own shard directory (created
O_EXCL, mode 0600), header and payload written with one ``writev``, fsync if
the durability policy asks for it, then ``rename`` over the final name, then
fsync of the directory (persistent). A reader therefore sees either no file
or a complete one; a crash leaves at worst a ``.tmp`` orphan, which start-up
removes. A failed write removes its temporary file before reporting.

Back-pressure (``BlockWriter.offer``): try to put without waiting; if the
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
shuts down (cache/tiering.py). A full queue is refused in ``wants``, before the
block is copied off the pool. Eviction is the block's last chance: there
``wants`` waits for room up to ``evict_wait_s`` (``ssd_evict_wait_s``), so
under sustained overload the engine runs at the disk's pace instead of losing
blocks; a writer that freed nothing during a whole wait is not waited on again
until it takes a block (a stalled disk costs one wait). What is still lost
for good: a block RAM evicts while the queue stays full past that wait, or
while writes back off after faults.

The queue and its thread are the shared bounded writer (storage/writer.py):
one non-daemon thread, ``kvcellar-disk-writer-<ns>``, one block at a time,
each write deferred while loads are in flight (reads first). Shutdown:
DiskTier.close (1) refuses new ``store`` calls; (2) waits for ``store`` calls
already admitted (each is bounded by its deadline); then ``BlockWriter.close``
(3) lets the thread drain the queue until the deadline, and (4) past it drops
what is left, counted as ``writer_dropped_abort``; a write under way then
finishes on its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from kvcellar.paths import full_fsync
from kvcellar.storage.base import StoreRequest
from kvcellar.storage.disk.stats import DiskWriterStats
from kvcellar.storage.writer import BoundedWriter

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
                full_fsync(fd)
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
        full_fsync(fd)
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


class BlockWriter(BoundedWriter[StoreRequest]):
    """The disk tier's writer thread and its queue.

    ``write_one(req)`` writes one block (the tier's policy: dedup, capacity,
    faults); ``done(req)`` runs after it, whatever happened (release the
    in-flight claim). ``defer_to_reads(max_s)`` waits while loads are in
    flight. The caller (DiskTier) stops admitting ``store`` calls before
    ``close``.
    """

    def __init__(
        self,
        name: str,
        queue_blocks: int,
        write_one: Callable[[StoreRequest], None],
        done: Callable[[StoreRequest], None],
        defer_to_reads: Callable[[float], bool],
        defer_max_s: float,
        counters: DiskWriterStats,
    ) -> None:
        def write(batch: list[StoreRequest]) -> None:
            for r in batch:
                write_one(r)

        def release(batch: list[StoreRequest]) -> None:
            for r in batch:
                done(r)

        def defer() -> None:
            if defer_to_reads(defer_max_s) is False:
                counters.deferred_timeouts.add()

        super().__init__(name, queue_blocks, write, counters, log=_log, label="disk tier writer",
                         before_batch=defer, done=release, error_count=counters.failed,
                         abort_count=counters.dropped_abort)
