"""int4 weights in the panel layout of this machine's kernels, stored as an entry of their own.

Where kvcellar's kernels keep int4 linears as panels (``native.pack_int4``), a start used to
pack them from the quantized entry's row layout into fresh anonymous memory: for a 7B, seconds
of the kernel zeroing pages and of packing, at every start. The first start now stores what it
packed as an entry derived from the quantized one, and later starts map it as they map every
other weight (llama-server's way to a start in seconds): the same bytes, so the same bits.

The layout depends on the CPU class (AVX-512 CPUs keep pairs of panels interleaved:
``native.panel_layout``), so the key holds it beside the quantized entry's key: machines of
two classes sharing one cache dir each get their own entry. The entry is checked as any other
(sampled hashes, stat signatures; a damaged one is replaced at the next start that packs).
"""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from kvcellar.artifacts.descriptor import ArtifactDescriptor, ArtifactLease
from kvcellar.artifacts.directory import ArtifactStoreError
from kvcellar.artifacts.store import ArtifactCache

log = logging.getLogger(__name__)

PANELS_FILE = "panels.pt"
# Bump when what the entry holds changes: older entries become misses.
PANELS_CONVERTER = "kvc-panels-1"

# A linear's panels: nibbles, scales and offsets (None: derived from the scales, Q4_0's).
Panels = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# What torch.load may raise on a file that is not what was stored.
_UNREADABLE = (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError)


def panels_descriptor(quantized: ArtifactLease, layout: str) -> ArtifactDescriptor:
    """The entry holding ``quantized``'s int4 linears packed in ``layout``."""
    d = quantized.descriptor
    return ArtifactDescriptor(source=f"artifact:{quantized.key}", dtype="int4", quantization=layout,
                              modality=d.modality, converter=PANELS_CONVERTER, name=d.name,
                              source_path=d.source_path)


def _alone(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with a storage of its own: torch.save writes whole storages, and small tensors
    share 2 MB-page mappings (``kvcellar.pages``) with others of other dtypes."""
    if t is None or (t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes):
        return t
    return t.clone()


class PanelStore:
    """One model's stored panels: ``take`` gives those its entry holds (mapped), ``keep``
    collects those packed by this process, ``commit`` stores them when there was no entry."""

    def __init__(self, cache: ArtifactCache, quantized: ArtifactLease, layout: str) -> None:
        self.cache = cache
        self.layout = layout
        self.descriptor = panels_descriptor(quantized, layout)
        self.lease: ArtifactLease | None = None
        self.stored: dict[str, Any] = {}
        self.packed: dict[str, Panels] = {}
        self.taken = 0
        try:
            self.lease = cache.find(self.descriptor)
        except ArtifactStoreError as exc:
            log.warning("stored int4 panels not looked up: %s", exc)
            return
        if self.lease is None:
            return
        try:
            found = torch.load(self.lease.path / PANELS_FILE, mmap=True, weights_only=True)
            if not isinstance(found, dict):
                raise ValueError(f"{PANELS_FILE} holds a {type(found).__name__}")
            self.stored = found
        except _UNREADABLE as exc:  # it validated but does not load: packed again, and stored anew
            self.lease.invalidate(f"stored int4 panels unreadable: {exc}")
            self.lease = None

    def take(self, name: str, rows: Panels) -> Panels | None:
        """The stored panels of linear ``name`` if they have the shapes and dtypes of its row
        layout ``rows`` (packing keeps both), else None (packed then)."""
        found = self.stored.get(name)
        if not isinstance(found, list) or len(found) != 3:
            return None
        for got, want in zip(found, rows, strict=True):
            if want is None or got is None:
                if got is not None:
                    return None
                continue
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                return None
        if found[0] is None or found[1] is None:
            return None
        self.taken += 1
        return found[0], found[1], found[2]

    def keep(self, name: str, panels: Panels) -> None:
        """Panels this process packed, for ``commit``."""
        self.packed[name] = panels

    def commit(self) -> None:
        """Store the panels this process packed as the entry, if there was none (the first
        start): a failing cache dir costs the next start the packing, nothing else."""
        packed, self.packed = self.packed, {}
        if not packed or self.lease is not None:
            return
        t0 = time.perf_counter()

        def build(out_dir: Path) -> dict[str, Any]:
            torch.save({name: [_alone(t) for t in p] for name, p in packed.items()}, out_dir / PANELS_FILE)
            return {"linears": len(packed), "layout": self.layout,
                    "bytes": sum(t.nbytes for p in packed.values() for t in p if t is not None)}

        try:
            self.lease = self.cache.acquire(self.descriptor, build)
        except (ArtifactStoreError, OSError, RuntimeError) as exc:
            log.warning("int4 panels not stored for the next start: %s", exc)
            return
        log.info("int4 panels of %d linears stored for the next start in %.1f s", len(packed),
                 time.perf_counter() - t0)
