"""Shared helpers for the storage tests and their child processes: deterministic
blocks (a child process and the test agree on every byte), file listings."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import torch

from kvcellar.storage import BlockSpec, LoadRequest, StoreRequest

REPO = Path(__file__).resolve().parents[2]

# 2 layers x (K,V) x 16 tokens x 2 heads x 8 dims, bf16: 2 KiB payload, 6 KiB files.
SPEC = BlockSpec(torch.bfloat16, (2, 2, 16, 2, 8), 16)
SPEC_F32 = BlockSpec(torch.float32, (2, 2, 16, 2, 8), 16)
# 36 KiB files, for the 4 MiB tmpfs tests.
SPEC_BIG = BlockSpec(torch.bfloat16, (4, 2, 16, 4, 32), 16)
# Quantized KV (cache/kv_pool.py) of 2 layers x 16 tokens x 2 heads x 64 dims, groups of 32:
# per layer and K/V, 2048 bytes of 8-bit values and 128 of float16 scales; 1024 bytes of
# 4-bit values and 256 of scales and offsets.
SPEC_Q8 = BlockSpec(torch.uint8, (2, 2, 2176), 16, kv_bits=8, kv_group_size=32)
SPEC_Q4 = BlockSpec(torch.uint8, (2, 2, 1280), 16, kv_bits=4, kv_group_size=32)


def key_of(i: int, seed: int = 0, key_len: int = 32) -> bytes:
    return hashlib.blake2b(f"key:{seed}:{i}".encode(), digest_size=32).digest()[:key_len]


def block(i: int, spec: BlockSpec = SPEC, *, seed: int = 0, key: bytes | None = None,
          linked: bool = False) -> StoreRequest:
    """Block ``i`` of chain ``seed``: the same bytes in every process. ``linked``: its
    parent is block ``i - 1`` of the same chain (as the engine stores them); otherwise
    it stands alone."""
    digest = hashlib.blake2b(f"digest:{seed}:{i}".encode(), digest_size=32).digest()
    tokens = tuple((i * spec.block_size + j + seed * 7919) % 50_000 for j in range(spec.block_size))
    # Cheap to generate (the SIGKILL child spends its time writing, not here), distinct per (seed, i).
    n = spec.numel
    pattern = torch.arange(n, dtype=torch.int64).mul_(2654435761).add_(i * 40503 + seed * 65599 + 1)
    data = pattern.remainder_(65521).to(torch.float32).sub_(32760.0).mul_(1 / 4096).to(spec.dtype).reshape(spec.shape)
    parent = key_of(i - 1, seed) if linked and i > 0 else None
    return StoreRequest(key if key is not None else key_of(i, seed), digest, tokens, data, parent)


def chain(n: int, spec: BlockSpec = SPEC, *, seed: int = 0, start: int = 0, linked: bool = False
          ) -> list[StoreRequest]:
    return [block(i, spec, seed=seed, linked=linked) for i in range(start, start + n)]


def load_request(r: StoreRequest, dest: torch.Tensor | None = None) -> LoadRequest:
    if dest is None:
        dest = torch.full(r.data.shape, float("nan"), dtype=r.data.dtype)
    return LoadRequest(r.key, r.digest, r.token_ids, dest)


def forged(honest: bytes, payload: bytes, block_size: int = 16) -> bytes:
    """What anyone who can write to a store can make without the secret: ``honest``'s header
    (key, digest, token ids, parent, seal) over another ``payload``, with the payload and header
    checksums recomputed, so every check but the seal passes."""
    from kvcellar.storage import block_format as fmt

    size = fmt.header_size_for(block_size)
    assert len(payload) == len(honest) - size
    header = bytearray(honest[:size])
    struct.pack_into("<I", header, 24, fmt.payload_checksum(payload))
    end = fmt.FIXED_SIZE + 4 * block_size
    struct.pack_into("<I", header, end, zlib.crc32(header[:end]))
    return bytes(header) + payload


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def files(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in Path(root).rglob(f"*{suffix}") if p.is_file())


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spawn_child(*args: str) -> subprocess.Popen[str]:
    """Run tests/storage/disk_child.py in a fresh interpreter."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.storage.disk_child", *args],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
