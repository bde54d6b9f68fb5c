"""Reading blocks: one verified read straight into the caller's tensor, and a
small pool of named reader threads that runs batches of them.

``read_block_into`` reads the header, checks size, header (magic, version,
header checksum), geometry (dtype, shape, block size), key, digest and token
ids, and only then reads the payload straight into the destination tensor's
bytes (no intermediate copy) and checks its CRC-32 and, with a secret, its seal. A
block of another prefix therefore never reaches ``dest``; a damaged or forged payload
may, but is reported as a miss. It never raises for I/O: the outcome says what happened.
``verify_block_file`` runs the same checks on a file alone (``kvcellar cache
verify``), with the header's own identity and the key of the file's name.

Reader threads: ``io_threads`` threads named ``kvcellar-disk-reader-<ns>-<i>``
take (batch, index) tasks from one FIFO queue, so the blocks of a batch are
read in order and several at a time (per-block files need several requests
in flight to approach the device's bandwidth). A batch resolves its future
when its last task finishes; after the first failure, later tasks of the
batch skip their I/O. Shutdown: ``close`` enqueues one sentinel per thread
after the queued tasks and joins them.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

from kvcellar.storage.base import BlockSpec, LoadRequest
from kvcellar.storage.block_format import (
    HEADER_ALIGN,
    BlockHeader,
    BlockSeal,
    HeaderError,
    check_geometry,
    declared_header_size,
    decode_header,
    payload_checksum,
    payload_fault,
)
from kvcellar.storage.disk.layout import key_from_block_name

O_NOATIME = getattr(os, "O_NOATIME", 0)


class Outcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no file (never written, evicted, deleted by another process)
    CORRUPT = "corrupt"  # file exists but is not this block, or is damaged: delete it
    IO_ERROR = "io_error"  # the OS failed the read: keep the file, count the fault


@dataclass(frozen=True)
class ReadResult:
    outcome: Outcome
    reason: str = ""  # for CORRUPT: size, magic, version, header_checksum, geometry, key, digest, tokens, checksum
    error: OSError | None = None
    ino: int = 0
    dev: int = 0
    mtime_ns: int = 0


class _Identity(TypedDict):
    """The file a result is about (``ReadResult``'s ``ino``, ``dev``, ``mtime_ns``)."""

    ino: int
    dev: int
    mtime_ns: int


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data)


def open_noatime(path: str | os.PathLike[str]) -> int:
    """Open for reading without touching atime (our LRU clock) where allowed."""
    if O_NOATIME:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | O_NOATIME)
        except PermissionError:
            pass
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def read_header(fd: int, first: int = HEADER_ALIGN) -> BlockHeader:
    """The decoded header of an open block file: ``first`` bytes (the namespace's header
    size, when known), and more if the file declares a longer header. Not compared with a
    spec or a key. Raises HeaderError, or OSError if the file cannot be read."""
    head = os.pread(fd, first, 0)
    size = declared_header_size(head)
    if size is not None and size > len(head):
        head = os.pread(fd, size, 0)
    return decode_header(head)


def verify_block_file(path: str, spec: BlockSpec | None, buf: bytearray | None = None,
                      seal: BlockSeal | None = None) -> str | None:
    """Read and check one block file completely, without a request to compare it with:
    header, geometry (when ``spec`` is known), size, key against the file name, payload
    checksum, and with ``seal`` its seal. None if good, ``previous_secret`` if good and sealed
    by one of ``seal``'s previous secrets (a rotation's), else the reason (as in the tier's
    ``ssd_corrupt_*`` counters). ``buf``: reused for the payload when it has the right size.
    Leaves atime alone. Raises OSError if the file cannot be read."""
    fd = open_noatime(path)
    try:
        size = os.fstat(fd).st_size
        try:
            h = read_header(fd)
            if spec is not None:
                check_geometry(h, spec)
        except HeaderError as e:
            return e.reason
        if size != h.header_size + h.payload_nbytes:
            return "size"
        if key_from_block_name(os.path.basename(path)) != h.key:
            return "key"
        if buf is None or len(buf) != h.payload_nbytes:
            buf = bytearray(h.payload_nbytes)
        payload = memoryview(buf)
        if seal is None:
            return _payload_fault(fd, h, payload)
        if preadv_full(fd, [payload], h.header_size) != len(payload):
            return "size"
        found = seal.sealer(h, os.pread(fd, h.header_size, 0), payload)
        if isinstance(found, str):
            return "checksum" if payload_checksum(payload) != h.payload_crc32 else found
        return "previous_secret" if found else None
    finally:
        os.close(fd)


def _payload_fault(fd: int, h: BlockHeader, payload: memoryview, raw_header: bytes | bytearray = b"",
                   seal: BlockSeal | None = None) -> str | None:
    """Read the payload into ``payload``: None if whole and it is the one ``h`` was written
    with (``block_format.payload_fault``), else ``size`` or the failed check."""
    if preadv_full(fd, [payload], h.header_size) != len(payload):
        return "size"
    return payload_fault(h, raw_header, payload, seal)


def read_block_into(path: str, spec: BlockSpec, header_size: int, req: LoadRequest,
                    seal: BlockSeal | None = None) -> ReadResult:
    expected = header_size + spec.nbytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return ReadResult(Outcome.MISSING)
    except OSError as e:
        return ReadResult(Outcome.IO_ERROR, error=e)
    try:
        st = os.fstat(fd)
        ident: _Identity = {"ino": st.st_ino, "dev": st.st_dev, "mtime_ns": st.st_mtime_ns}
        if st.st_size != expected:
            return ReadResult(Outcome.CORRUPT, "size", **ident)
        hdr = bytearray(header_size)
        if preadv_full(fd, [memoryview(hdr)], 0) != header_size:
            return ReadResult(Outcome.CORRUPT, "size", **ident)
        try:
            h = decode_header(hdr)
            check_geometry(h, spec)
        except HeaderError as e:
            return ReadResult(Outcome.CORRUPT, e.reason, **ident)
        # Identity is settled before a byte reaches dest: a foreign block never lands there.
        if h.key != req.key:
            return ReadResult(Outcome.CORRUPT, "key", **ident)
        if h.digest != req.digest:
            return ReadResult(Outcome.CORRUPT, "digest", **ident)
        if h.token_ids != tuple(req.token_ids):
            return ReadResult(Outcome.CORRUPT, "tokens", **ident)
        fault = _payload_fault(fd, h, tensor_bytes(req.dest), hdr, seal)
        if fault is not None:
            return ReadResult(Outcome.CORRUPT, fault, **ident)
        return ReadResult(Outcome.OK, **ident)
    except OSError as e:
        return ReadResult(Outcome.IO_ERROR, error=e)
    finally:
        os.close(fd)


def preadv_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """preadv from ``offset`` until every buffer is full or EOF; returns bytes read."""
    total = 0
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n <= 0:
            break
        total += n
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]
    return total


class _Batch:
    """One load() call. ``lock`` protects ``results``, ``remaining`` and ``first_fail``."""

    def __init__(self, requests: Sequence[LoadRequest], future: concurrent.futures.Future[int]) -> None:
        self.requests = requests
        self.future = future
        self.lock = threading.Lock()
        self.results: list[bool] = [False] * len(requests)
        self.remaining = len(requests)
        self.first_fail = len(requests)

    def leading_ok(self) -> int:
        n = 0
        while n < len(self.results) and self.results[n]:
            n += 1
        return n


_SENTINEL = None
_log = logging.getLogger("kvcellar.storage.disk")


class ReaderPool:
    """Runs load batches on ``threads`` named threads.

    ``read_one(req) -> bool`` does the I/O and the accounting of one block;
    ``on_done(requests, leading)`` runs once per batch (unpin, counters)
    before its future resolves. ``_lock`` protects ``_active`` and ``_closed``.
    """

    def __init__(
        self,
        threads: int,
        name: str,
        read_one: Callable[[LoadRequest], bool],
        on_done: Callable[[Sequence[LoadRequest], int], None],
    ) -> None:
        self._read_one = read_one
        self._on_done = on_done
        self._queue: queue.SimpleQueue[tuple[_Batch, int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0  # batches submitted and not yet resolved
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=False) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, requests: Sequence[LoadRequest]) -> concurrent.futures.Future[int] | None:
        """Queue a batch; None if the pool is closed (the caller resolves)."""
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()  # not cancellable: it holds pins
        batch = _Batch(requests, fut)
        with self._lock:
            if self._closed:
                return None
            self._active += 1
        for i in range(len(requests)):
            self._queue.put((batch, i))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _SENTINEL:
                return
            batch, i = item
            with batch.lock:
                skip = i > batch.first_fail
            ok = False
            if not skip:
                try:
                    ok = self._read_one(batch.requests[i])
                except Exception:  # a bug, not an I/O fault: the block is a miss
                    _log.exception("disk tier reader failed")
                    ok = False
            with batch.lock:
                batch.results[i] = ok
                if not ok:
                    batch.first_fail = min(batch.first_fail, i)
                batch.remaining -= 1
                last = batch.remaining == 0
            if last:
                self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        leading = batch.leading_ok()
        try:
            self._on_done(batch.requests, leading)
        finally:
            batch.future.set_result(leading)
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._idle.notify_all()

    @property
    def active(self) -> int:
        return self._active

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no batch is in flight (the writer defers to reads)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._active == 0, timeout)

    def close(self, timeout: float) -> bool:
        """Finish queued batches, stop the threads. True if all joined."""
        with self._lock:
            if self._closed:
                return all(not t.is_alive() for t in self._threads)
            self._closed = True
        for _ in self._threads:
            self._queue.put(_SENTINEL)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return all(not t.is_alive() for t in self._threads)
