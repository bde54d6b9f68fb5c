"""The block files' payload checksum on kvcellar's kernel (``crc32.c``): zlib's CRC-32 by
carry-less multiplication where the CPU has it, several times zlib 1.2's speed
(docs/performance.md), which a restart computes over every byte it reads."""

from __future__ import annotations

import functools
import zlib

import numpy

from kvcellar.engine.native import lib

# The CPU flags ``kvc_crc32`` needs beyond ``lib.CPU_FLAGS`` (carry-less multiplication).
CRC_FLAGS = frozenset({"pclmulqdq", "sse4_1"})
# Below this many bytes zlib's CRC-32 is as quick as a call into the library.
CRC_MIN_BYTES = 4096


@functools.cache
def folds_crc32() -> bool:
    """Whether ``crc32`` runs kvcellar's kernel here (else zlib's)."""
    return lib.cpu_flags() >= CRC_FLAGS and lib.available()


def crc32(buf: memoryview | bytes | bytearray, value: int = 0) -> int:
    """``zlib.crc32(buf, value)``."""
    n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if n < CRC_MIN_BYTES or not folds_crc32():
        return zlib.crc32(buf, value) & 0xFFFFFFFF
    address = numpy.frombuffer(buf, dtype=numpy.uint8).ctypes.data
    return int(lib.call("kvc_crc32", buf=address, len=n, crc=value) or 0)
