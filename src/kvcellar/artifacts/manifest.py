"""An entry's manifest: what files it holds, their sizes and content hashes.

``manifest.json`` is written last inside the build dir, before the atomic rename, so an
entry without a readable manifest is partial by definition. Per file it keeps:

* ``size``;
* ``sha256`` of the whole file (computed once, at build time; ``models verify`` and the
  ``full`` verify level recompute it);
* ``sample``: sha256 over the size and a fixed set of 64 KiB windows (the head, where the
  safetensors header lives, the tail and 16 evenly spaced ones). Files up to 4 MiB (config,
  tokenizer, chat template) are hashed whole here, so they are fully checked on every use.

Why not a full hash on every start: measured on this machine for the embedded model's
269 MB ``model.safetensors`` (page cache warm), sha256 costs 0.18-0.30 s while loading the
whole entry costs ~0.37 s, so a full hash would roughly double the prepared path of every
start, and it grows with the model (~8 s for a 16 GB entry). The sample costs ~4 ms. What
the sample cannot see (a flipped byte between windows) is caught by the store's stat check:
any write changes a file's mtime/ctime, and a file whose stat differs from the one recorded
after its last full verification is fully re-hashed before use (see ``store.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
SAMPLE_WINDOW = 64 << 10
SAMPLE_COUNT = 16
SAMPLE_WHOLE_LIMIT = 4 << 20
_CHUNK = 8 << 20


class CorruptEntryError(Exception):
    """An entry's files do not match its manifest (missing, wrong size, wrong hash)."""


def full_digest(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        if on_bytes is None:
            return hashlib.file_digest(fh, "sha256").hexdigest()
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            h.update(view[:n])
            on_bytes(n)
    return h.hexdigest()


def sample_digest(path: Path) -> str:
    """sha256 of the size plus fixed windows of the file; the whole file when it is small."""
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb", buffering=0) as fh:
        if size <= SAMPLE_WHOLE_LIMIT:
            h.update(fh.read())
            return h.hexdigest()
        last = size - SAMPLE_WINDOW
        offsets = sorted({0, last, *(i * last // (SAMPLE_COUNT + 1) for i in range(1, SAMPLE_COUNT + 1))})
        for off in offsets:
            fh.seek(off)
            h.update(fh.read(SAMPLE_WINDOW))
    return h.hexdigest()


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str
    sample: str


@dataclass
class Manifest:
    format: int
    key: str
    descriptor: dict[str, Any]
    created: float
    files: dict[str, FileRecord]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": self.format,
                "key": self.key,
                "descriptor": self.descriptor,
                "created": self.created,
                "total_bytes": self.total_bytes,
                "files": {n: vars(r) for n, r in sorted(self.files.items())},
                "info": self.info,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def read(cls, entry_dir: Path) -> Manifest:
        """The manifest of ``entry_dir``; ``CorruptEntryError`` if it is missing or malformed."""
        try:
            raw = json.loads((entry_dir / MANIFEST_NAME).read_text())
            files = {str(n): FileRecord(int(r["size"]), str(r["sha256"]), str(r["sample"]))
                     for n, r in raw["files"].items()}
            return cls(int(raw["format"]), str(raw["key"]), dict(raw["descriptor"]), float(raw["created"]),
                       files, dict(raw.get("info") or {}))
        except FileNotFoundError:
            raise CorruptEntryError(f"{entry_dir.name}: no {MANIFEST_NAME} (partial entry)") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptEntryError(f"{entry_dir.name}: unreadable {MANIFEST_NAME}: {exc}") from None


def describe_files(build_dir: Path, on_bytes: Callable[[int], None] | None = None) -> dict[str, FileRecord]:
    """Records of every regular file in ``build_dir`` (flat; subdirectories are refused)."""
    out: dict[str, FileRecord] = {}
    for p in sorted(build_dir.iterdir()):
        if p.name == MANIFEST_NAME:
            continue
        if not p.is_file() or p.is_symlink():
            raise ValueError(f"an artifact entry holds plain files only; {p.name} is not one")
        out[p.name] = FileRecord(p.stat().st_size, full_digest(p, on_bytes), sample_digest(p))
    return out


def check_structure(entry_dir: Path, manifest: Manifest) -> None:
    """Every file present with its recorded size; nothing else needed. Costs one stat per file."""
    for name, rec in manifest.files.items():
        try:
            size = (entry_dir / name).stat().st_size
        except FileNotFoundError:
            raise CorruptEntryError(f"{entry_dir.name}: {name} is missing") from None
        if size != rec.size:
            raise CorruptEntryError(f"{entry_dir.name}: {name} has {size} bytes, the manifest says {rec.size}")


def check_samples(entry_dir: Path, manifest: Manifest) -> None:
    for name, rec in manifest.files.items():
        if sample_digest(entry_dir / name) != rec.sample:
            raise CorruptEntryError(f"{entry_dir.name}: {name} fails its sampled hash")


def check_full(entry_dir: Path, manifest: Manifest, names: list[str] | None = None) -> None:
    for name in manifest.files if names is None else names:
        if full_digest(entry_dir / name) != manifest.files[name].sha256:
            raise CorruptEntryError(f"{entry_dir.name}: {name} fails its sha256")


def stat_signature(path: Path) -> list[int]:
    """What changes whenever a file is written, replaced or truncated: size, mtime, ctime, inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
