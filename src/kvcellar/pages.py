"""CPU memory in 2 MB pages for what a step reads whole: int4 weights kept as panels, the KV pool.

A decode token streams every weight once; on 4 KB pages that is a TLB miss every 4 KB, which
the kernels' prefetches do not hide (docs/performance.md). ``empty`` hands out tensors from
anonymous private mappings advised ``MADV_HUGEPAGE``, which the kernel backs with 2 MB pages
where it can (transparent huge pages in ``madvise`` or ``always`` mode) and with 4 KB pages
where it cannot: the same memory either way. Small tensors share a mapping (``_Arena``): a
mapping each would round each up to a whole 2 MB page once it is touched. A mapping lives
while a tensor in it does; its untouched tail costs address space, not memory. Where the
platform has no such advice, ``empty`` is ``torch.empty``.
"""

from __future__ import annotations

import math
import mmap
import threading

import torch

HUGE_PAGE = 1 << 21
# Mappings tensors share; a larger tensor gets its own, in whole 2 MB pages.
_CHUNK = 256 << 20
# Where each tensor starts in a shared mapping: the kernels' vector loads and cache lines.
_ALIGN = 64


def supported() -> bool:
    """Whether this platform takes the advice (Linux; elsewhere ``empty`` is ``torch.empty``)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MAP_PRIVATE")


def _mapping(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a new anonymous mapping of ``nbytes`` that starts on a 2 MB page
    (over-allocated by one, the part before the boundary never touched); it holds the mapping."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults then take 2 MB pages
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start: start + nbytes]


class _Arena:
    """Bump allocation of tensors in shared mappings of ``_CHUNK`` bytes. ``_lock`` guards
    ``_chunk`` and ``_used``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > _CHUNK // 4:
            return _mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)[:nbytes]
        with self._lock:
            if self._chunk is None or self._used + nbytes > _CHUNK:
                self._chunk, self._used = _mapping(_CHUNK), 0
            start = self._used
            self._used = -(-(start + nbytes) // _ALIGN) * _ALIGN
            return self._chunk[start: start + nbytes]


_arena = _Arena()


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, in 2 MB pages where the OS gives them;
    its memory reads as zeros until written (a fresh mapping's)."""
    if not supported():
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return _arena.take(nbytes).view(dtype).view(shape)
