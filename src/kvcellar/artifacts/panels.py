"""int4 and MXFP4 linears in the panel layout of this machine's kernels, as the quantized entry
stores them.

Where kvcellar's kernels keep int4 linears as panels (``native.pack_int4``; MXFP4 experts too:
``native.pack_mxfp4``), the quantized entry of a GGUF holds them packed so, a linear at a time
as the GGUF is read: every start maps them as it maps every other weight (pages of the page
cache, evictable and shared between processes), the same bytes and so the same bits as packing
them in memory, and the entry holds no second copy of them in the row layout (a Qwen3-30B-A3B:
18 GB of disk less). The rest of the entry (int8 linears, embeddings) stays safetensors.

The layout depends on the CPU class (AVX-512 CPUs keep pairs of panels interleaved:
``native.panel_layout``), so the quantized entry's key holds it: machines of two classes
sharing one cache dir each get their own entry. The file is checked as the rest of the entry
(sampled hashes, stat signatures; a damaged entry is built again).
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from kvcellar.quantization import MXFP4_GROUP, QuantizedWeight

# The tensors' bytes, each at a multiple of ``ALIGN`` (the kernels' aligned loads), and where
# each lies (JSON).
PANELS_FILE = "panels.bin"
INDEX_FILE = "panels.json"
ALIGN = 4096
DTYPES = {"uint8": torch.uint8, "float16": torch.float16}


@dataclass(frozen=True)
class PanelLayout:
    """This CPU's panel layout: its name (``native.panel_layout``, part of the quantized entry's
    key) and ``pack``, a linear's weight in it (None: the kernels keep it in the row layout)."""

    name: str
    pack: Callable[[QuantizedWeight], QuantizedWeight | None]


class PanelWriter:
    """Writes linears' panels into ``folder`` as they come (their bytes as they lie in memory:
    no copy), then their index on ``close``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.index: dict[str, list[list[Any] | None]] = {}
        self.nbytes = 0
        self._file = open(folder / PANELS_FILE, "wb")  # noqa: SIM115  # closed by close or the with block

    def add(self, name: str, weight: QuantizedWeight) -> None:
        f = self._file
        self.index[name] = []
        for t in (weight.qweight, weight.scales, weight.offsets):
            if t is None:
                self.index[name].append(None)
                continue
            f.write(bytes(-f.tell() % ALIGN))
            self.index[name].append([f.tell(), str(t.dtype).removeprefix("torch."), list(t.shape)])
            f.write(t.contiguous().view(torch.uint8).numpy().data)
            self.nbytes += t.nbytes

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            (self.folder / INDEX_FILE).write_text(json.dumps(self.index))

    def __enter__(self) -> PanelWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


def read_panels(folder: Path) -> dict[str, QuantizedWeight]:
    """What ``PanelWriter`` wrote (nothing where it wrote no file), the tensors in one private
    mapping of the file (pages of the page cache, shared by every process that maps them,
    until one writes)."""
    if not (folder / INDEX_FILE).exists():
        return {}
    index = json.loads((folder / INDEX_FILE).read_text())
    if not index:  # no linear kept as panels (an empty file cannot be mapped)
        return {}
    with open(folder / PANELS_FILE, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    stored: dict[str, QuantizedWeight] = {}
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
        stored[name] = _weight(name, tensors)
    return stored


def _weight(name: str, tensors: list[torch.Tensor | None]) -> QuantizedWeight:
    """A linear's panels from its nibbles, scales and offsets: MXFP4's exponents are bytes,
    int4's scales float16 (its offsets None where derived from them)."""
    nibbles, scales, offsets = tensors if len(tensors) == 3 else (None, None, None)
    if nibbles is None or scales is None or nibbles.dim() != 2:
        raise ValueError(f"{name}: not a weight's nibbles, scales and offsets")
    cols = nibbles.shape[1] * 2
    if scales.dim() != 2 or scales.shape[0] != nibbles.shape[0] or cols % scales.shape[1]:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} do not fit {cols} inputs")
    if scales.dtype == torch.uint8 and offsets is None and cols // scales.shape[1] == MXFP4_GROUP:
        return QuantizedWeight("mxfp4", nibbles, scales, None, MXFP4_GROUP, panels=True)
    if scales.dtype != torch.float16 or (offsets is not None and offsets.shape != scales.shape):
        raise ValueError(f"{name}: not int4 or MXFP4 panels")
    return QuantizedWeight("int4", nibbles, scales, offsets, cols // scales.shape[1], panels=True)
