"""int4 and MXFP4 weights in the panel layout of this machine's kernels, stored as an entry of
their own.

Where kvcellar's kernels keep int4 linears as panels (``native.pack_int4``; MXFP4 experts too:
``native.pack_mxfp4``), a start used to pack them from the quantized entry's row layout into
fresh anonymous memory: for a 7B, seconds of the kernel zeroing pages and of packing at every
start, and for a model whose panels would take more than half the machine's memory no panels at
all (the row kernels instead). Now the first start packs them a linear at a time into an entry
derived from the quantized one, and every start maps that entry as it maps every other weight
(llama-server's way to a start in seconds): pages of the page cache, evictable and shared
between processes, the same bytes and so the same bits as packing them in memory.

The layout depends on the CPU class (AVX-512 CPUs keep pairs of panels interleaved:
``native.panel_layout``), so the key holds it beside the quantized entry's key: machines of
two classes sharing one cache dir each get their own entry. The entry is checked as any other
(sampled hashes, stat signatures; a damaged one is built again).
"""

from __future__ import annotations

import json
import logging
import mmap
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvcellar.artifacts.descriptor import ArtifactDescriptor, ArtifactLease
from kvcellar.artifacts.directory import ArtifactStoreError
from kvcellar.artifacts.store import ArtifactCache

log = logging.getLogger(__name__)

# The tensors' bytes, each at a multiple of ``ALIGN``, and where each lies (JSON).
PANELS_FILE = "panels.bin"
INDEX_FILE = "panels.json"
ALIGN = 4096
# Bump when what the entry holds changes: older entries become misses.
# 2: MXFP4 weights (gpt-oss's experts) are kept as panels too.
PANELS_CONVERTER = "kvc-panels-2"
DTYPES = {"uint8": torch.uint8, "float16": torch.float16}

# A linear's panels: nibbles, scales and offsets (None: derived from the scales, Q4_0's).
Panels = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def panels_descriptor(quantized: ArtifactLease, layout: str) -> ArtifactDescriptor:
    """The entry holding ``quantized``'s int4 and MXFP4 linears packed in ``layout``."""
    d = quantized.descriptor
    return ArtifactDescriptor(source=f"artifact:{quantized.key}", dtype="int4", quantization=layout,
                              modality=d.modality, converter=PANELS_CONVERTER, name=d.name,
                              source_path=d.source_path)


class PanelStore:
    """One model's stored panels (``prepare`` builds the entry if there is none): ``take``
    gives a linear's, mapped."""

    def __init__(self, cache: ArtifactCache, quantized: ArtifactLease, layout: str) -> None:
        self.cache = cache
        self.layout = layout
        self.descriptor = panels_descriptor(quantized, layout)
        self.lease: ArtifactLease | None = None
        self.stored: dict[str, Panels] = {}
        self.taken = 0

    def prepare(self, packed: Callable[[], Iterator[tuple[str, Panels]]]) -> bool:
        """Map the entry, built first from ``packed()`` (each linear's panels, packed as they
        are asked for and written before the next: the memory of one) if there is none or it
        is damaged. False where the cache dir fails: the linears are packed in memory then."""
        t0 = time.perf_counter()

        def build(out_dir: Path) -> dict[str, Any]:
            count, nbytes = write_panels(out_dir, packed())
            return {"linears": count, "layout": self.layout, "bytes": nbytes}

        for attempt in (1, 2):
            try:
                self.lease = self.cache.acquire(self.descriptor, build)
            except (ArtifactStoreError, OSError, RuntimeError) as exc:
                log.warning("panels not stored (packed at every start): %s", exc)
                return False
            try:
                self.stored = read_panels(self.lease.path)
                break
            except (OSError, ValueError, KeyError, TypeError) as exc:  # it validated but does not load
                self.lease.invalidate(f"stored panels unreadable: {exc}")
                self.lease = None
                if attempt == 2:
                    return False
        if self.lease is not None and self.lease.built:
            log.info("panels of %d linears stored in %.1f s", len(self.stored), time.perf_counter() - t0)
        return True

    def take(self, name: str, rows: Panels) -> Panels | None:
        """The stored panels of linear ``name`` if they have the shapes and dtypes of its row
        layout ``rows`` (packing keeps both), else None (packed then)."""
        found = self.stored.get(name)
        if found is None:
            return None
        # offsets stored as None are derived from the scales (packing found them so)
        pairs = [(found[0], rows[0]), (found[1], rows[1])] + ([] if found[2] is None else [(found[2], rows[2])])
        if any(want is None or got.shape != want.shape or got.dtype != want.dtype for got, want in pairs):
            return None
        self.taken += 1
        return found


def write_panels(folder: Path, panels: Iterable[tuple[str, Panels]]) -> tuple[int, int]:
    """``panels`` as ``PANELS_FILE`` (their bytes as they lie in memory: no copy) and
    ``INDEX_FILE``; returns how many linears and bytes."""
    index: dict[str, list[list[Any] | None]] = {}
    nbytes = 0
    with open(folder / PANELS_FILE, "wb") as f:
        for name, tensors in panels:
            index[name] = []
            for t in tensors:
                if t is None:
                    index[name].append(None)
                    continue
                f.write(bytes(-f.tell() % ALIGN))
                index[name].append([f.tell(), str(t.dtype).removeprefix("torch."), list(t.shape)])
                f.write(t.contiguous().view(torch.uint8).numpy().data)
                nbytes += t.nbytes
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return len(index), nbytes


def read_panels(folder: Path) -> dict[str, Panels]:
    """What ``write_panels`` wrote, the tensors in one private mapping of the file (pages of the
    page cache, shared by every process that maps them, until one writes)."""
    index = json.loads((folder / INDEX_FILE).read_text())
    if not index:  # no linear kept as panels (an empty file cannot be mapped)
        return {}
    with open(folder / PANELS_FILE, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    stored: dict[str, Panels] = {}
    for name, entries in index.items():
        tensors: list[torch.Tensor | None] = []
        for entry in entries:
            if entry is None:
                tensors.append(None)
                continue
            offset, dtype_name, shape = entry
            dtype = DTYPES[dtype_name]
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            if offset % ALIGN or offset + nbytes > whole.numel():
                raise ValueError(f"{name}: bytes {offset}..{offset + nbytes} are not in {PANELS_FILE}")
            tensors.append(whole[offset: offset + nbytes].view(dtype).view(shape))
        if len(tensors) != 3 or tensors[0] is None or tensors[1] is None:
            raise ValueError(f"{name}: not a weight's nibbles, scales and offsets")
        stored[name] = (tensors[0], tensors[1], tensors[2])
    return stored
