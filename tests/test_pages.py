"""Memory in 2 MB pages (``kvcellar.pages``) for the int4 panels and the KV pool: tensors that
behave as ``torch.empty``'s, in mappings the kernel is advised to back with huge pages."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from kvcellar import pages
from kvcellar.cache.kv_pool import KVLayout, KVPool
from kvcellar.engine import native

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping that holds ``t`` carries ``MADV_HUGEPAGE`` (``hg`` in its VmFlags)."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_tensors_from_pages_are_separate_zeroed_and_outlive_what_made_them():
    shapes = [((3, 5), torch.float16), ((1,), torch.uint8), ((1000, 333), torch.float32),
              ((70_000_000,), torch.uint8), ((4, 1 << 20), torch.bfloat16)] * 3
    tensors = [pages.empty(shape, dtype) for shape, dtype in shapes]
    for i, ((shape, dtype), t) in enumerate(zip(shapes, tensors, strict=True)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        assert not t.any()
        t.fill_(i + 1)
    gc.collect()
    for i, t in enumerate(tensors):
        assert bool((t == i + 1).all())  # no tensor wrote into another
    big = tensors[3]
    assert big.data_ptr() % pages.HUGE_PAGE == 0  # one of its own, on a 2 MB boundary
    del tensors
    gc.collect()
    assert bool((big == 4).all())


@pytest.mark.skipif(not pages.supported() or not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages on this OS")
@pytest.mark.skipif(not native.available(), reason="kvcellar's kernels cannot be built on this machine")
def test_int4_panels_and_the_kv_pool_are_advised_huge_pages():
    gen = torch.Generator().manual_seed(0)
    nibbles = torch.randint(0, 256, (64, 256), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(64, 16, generator=gen) * 0.01 + 0.001).half()
    offsets = (torch.rand(64, 16, generator=gen) * -0.05).half()
    packed = native.pack_int4(nibbles, scales, offsets, 2)
    assert all(advised(t) for t in packed if t is not None)
    x = torch.randn(3, 512, generator=gen)
    expected = native.matmul_int4(x, nibbles, scales, offsets, 2)
    assert torch.equal(native.matmul_int4(x, *packed, 2, panels=True), expected)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    pool = KVPool(layout, 64, torch.device("cpu"))
    assert advised(pool.data) and not pool.data.any()
    plain = mmap.mmap(-1, 1 << 22, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert not advised(torch.frombuffer(plain, dtype=torch.uint8))  # a mapping not advised: the test can tell
