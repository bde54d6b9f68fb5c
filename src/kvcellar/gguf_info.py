"""What a GGUF file holds, read from its header alone: metadata and the type of each tensor.

Deciding whether and how to serve a GGUF (its architecture, ``--weights auto``) must not
cost a load: ``read_gguf_info`` parses the header (key-value metadata and tensor infos) and
never touches the tensor data that follows, so it takes milliseconds for a file of any
size and works on a file whose data is damaged or missing. Array values (the vocabulary,
merges) are skipped, not kept. Where each tensor's data lies is kept too, so the streamed
conversion (artifacts/gguf_convert.py) reads tensors without gguf's own reader, which builds
an object per metadata value (seconds for a 50k-token vocabulary).
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from kvcellar.errors import ModelLoadError

_MAGIC = b"GGUF"
# GGUF value types -> struct format of a scalar; 8 (string) and 9 (array) are handled apart.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Longer arrays of scalars (token types, scores) are skipped, not kept.
_MAX_ARRAY = 4096
# ggml tensor type ids (stable: they are in every file), as gguf's ``GGMLQuantizationType``
# names them; written out so that reading a header does not import gguf (and numpy).
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: str  # ggml type name (``GGML_TYPES``), e.g. "Q4_K", "F32"; "type<N>" for another id
    params: int  # number of elements
    dims: tuple[int, ...] = ()  # in ggml order: the row length first
    offset: int = 0  # of its data, from the start of the data section (``GGUFInfo.data_start``)

    @property
    def mxfp4_experts(self) -> bool:
        """Stacked experts (``blk.N.ffn_*_exps.weight``) in MXFP4, which every gpt-oss file has
        and kvcellar serves as stored."""
        parts = self.name.split(".")
        return self.type == "MXFP4" and len(parts) == 4 and parts[2].endswith("_exps") and parts[3] == "weight"


@dataclass(frozen=True)
class GGUFInfo:
    # scalar and string values, and short arrays of scalars (per-layer values) as tuples;
    # string arrays (the vocabulary) left out
    metadata: dict[str, str | int | float | bool | tuple[int | float | bool, ...]]
    tensors: tuple[GGUFTensor, ...]
    data_start: int = 0  # where the tensor data begins in the file
    big_endian: bool = False

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_gguf_info(path: Path) -> GGUFInfo:
    """The header of the GGUF file at ``path``; ``ModelLoadError`` if it is not one."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"Could not read {path}: {exc}") from exc
    return _read_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)  # the architecture check and ``--weights auto`` read the same header
def _read_cached(path: str, _mtime_ns: int, _size: int) -> GGUFInfo:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _parse(buf: mmap.mmap) -> GGUFInfo:
    if buf[:4] != _MAGIC:
        raise ValueError("bad magic")
    order = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # written big-endian
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
    pos = 24

    def scalar(fmt: str) -> int | float | bool:
        nonlocal pos
        value: int | float | bool
        (value,) = struct.unpack_from(order + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        length = int(scalar("Q"))
        text = bytes(buf[pos:pos + length])
        if len(text) != length:
            raise ValueError("truncated header")
        pos += length
        return text.decode("utf-8")

    metadata: dict[str, str | int | float | bool | tuple[int | float | bool, ...]] = {}
    for _ in range(n_kv):
        key = string()
        vtype = int(scalar("I"))
        if vtype == _STRING:
            metadata[key] = string()
        elif vtype in _SCALARS:
            metadata[key] = scalar(_SCALARS[vtype])
        elif vtype == _ARRAY:
            item, count = int(scalar("I")), int(scalar("Q"))
            if item == _STRING:
                length_at = struct.Struct(order + "Q").unpack_from
                at = pos
                for _ in range(count):  # a vocabulary: 10^5 strings, kept out of the closures
                    at += 8 + length_at(buf, at)[0]
                pos = at
            elif item in _SCALARS and count <= _MAX_ARRAY:
                metadata[key] = tuple(scalar(_SCALARS[item]) for _ in range(count))
            elif item in _SCALARS:
                pos += count * struct.calcsize(_SCALARS[item])
            else:
                raise ValueError(f"array of value type {item} in {key}")
        else:
            raise ValueError(f"value type {vtype} of {key}")

    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(int(scalar("Q")) for _ in range(int(scalar("I"))))
        type_id = int(scalar("I"))
        offset = int(scalar("Q"))
        tensors.append(GGUFTensor(name, GGML_TYPES.get(type_id, f"type{type_id}"), math.prod(dims), dims, offset))
    align = metadata.get("general.alignment", 32)  # llama.cpp's default
    alignment = align if isinstance(align, int) else -1
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a power of two")
    return GGUFInfo(metadata, tuple(tensors), -(-pos // alignment) * alignment, order == ">")

