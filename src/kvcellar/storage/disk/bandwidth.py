"""Sequential read bandwidth of the storage under a directory: the physical
floor that disk-hit benchmarks compare against.

``measure_read_bandwidth`` reads with O_DIRECT into page-aligned buffers, so
neither the page cache nor a warm RAM copy inflates the figure. Where the
filesystem refuses O_DIRECT (tmpfs, some overlay and network filesystems) it
drops the file's cached pages with ``posix_fadvise(DONTNEED)`` after an fsync
and reads buffered; on tmpfs that measures memory, which is the honest floor
there. The result says which method was used.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_ALIGN = 4096
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float
    nbytes: int
    seconds: float
    method: str  # "o_direct" or "fadvise_dontneed"
    path: str


def measure_read_bandwidth(path_or_dir: str | os.PathLike[str], nbytes: int = 512 << 20) -> float:
    """Bytes per second of one sequential cold read of ``nbytes``.

    If ``path_or_dir`` is a directory, a scratch file of ``nbytes`` random
    bytes is written there (fsynced), read back and deleted. If it is a file,
    its first ``nbytes`` (or all of it) are read.
    """
    return measure_read_bandwidth_detailed(path_or_dir, nbytes).bytes_per_s


def measure_read_bandwidth_detailed(
    path_or_dir: str | os.PathLike[str], nbytes: int = 512 << 20, chunk_bytes: int = _CHUNK
) -> Bandwidth:
    p = Path(path_or_dir)
    if p.is_dir():
        fd, name = tempfile.mkstemp(prefix=".kvcellar-bw-", dir=p)
        try:
            _fill(fd, nbytes)
            os.close(fd)
            return _measure_file(Path(name), nbytes, chunk_bytes)
        finally:
            try:
                os.unlink(name)
            except OSError:
                pass
    return _measure_file(p, min(nbytes, p.stat().st_size), chunk_bytes)


def _fill(fd: int, nbytes: int) -> None:
    block = os.urandom(min(_CHUNK, max(nbytes, 1)))
    left = nbytes
    while left > 0:
        left -= os.write(fd, block[: min(left, len(block))])
    os.fsync(fd)


def _measure_file(path: Path, nbytes: int, chunk_bytes: int) -> Bandwidth:
    chunk = max(_ALIGN, chunk_bytes // _ALIGN * _ALIGN)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        method = "o_direct"
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        method = "fadvise_dontneed"
    buf = mmap.mmap(-1, chunk)  # anonymous mappings are page-aligned
    try:
        if method == "fadvise_dontneed":
            _drop_cache(fd)
        done = 0
        t0 = time.perf_counter()
        try:
            done = _read_all(fd, buf, nbytes, chunk, direct=method == "o_direct")
        except OSError as e:
            if e.errno != errno.EINVAL or method != "o_direct":
                raise
            # O_DIRECT accepted at open but refused at read (alignment rules of
            # the filesystem): measure the buffered way instead.
            os.close(fd)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            method = "fadvise_dontneed"
            _drop_cache(fd)
            t0 = time.perf_counter()
            done = _read_all(fd, buf, nbytes, chunk, direct=False)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return Bandwidth(done / dt if dt > 0 else float("inf"), done, dt, method, str(path))


def _drop_cache(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _read_all(fd: int, buf: mmap.mmap, nbytes: int, chunk: int, *, direct: bool) -> int:
    mv = memoryview(buf)
    done = 0
    while done < nbytes:
        # O_DIRECT needs aligned lengths; the tail is rounded up and clipped.
        want = min(chunk, nbytes - done)
        if direct:
            want = -(-want // _ALIGN) * _ALIGN
        n = os.preadv(fd, [mv[:want]], done)
        if n <= 0:
            break
        done += min(n, nbytes - done)
    mv.release()
    return done
