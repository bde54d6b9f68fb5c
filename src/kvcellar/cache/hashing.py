"""Chained, process-independent block digests.

A full block's digest is ``sha256(parent_digest || token_ids as little-endian uint32)``;
the chain starts from a root digest over the model fingerprint and the request's
``cache_salt``. Nothing depends on Python's ``hash()`` or a per-process seed, so digests are
equal across restarts and machines, which is what lets the SSD tier (and a future shared
remote tier) serve blocks computed by another process.

The hash-table key of a block is a prefix of its digest (``key_bytes``, all 32 bytes
unless a test shrinks it to force collisions in RAM; ``EngineConfig.key_bytes``).
Correctness never rests on the key: a hit compares the block's full digest and its token
ids. The lower tiers name blocks by the key, so they take only whole digests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 32
_ROOT_TAG = b"kvcellar/prefix/v1\0"


def root_digest(model_fingerprint: str, cache_salt: str | None = None) -> bytes:
    h = hashlib.sha256(_ROOT_TAG)
    h.update(model_fingerprint.encode())
    if cache_salt is not None:
        # A salted chain never meets an unsalted one, and "" is a salt distinct from None.
        h.update(b"\0salt\0" + cache_salt.encode())
    return h.digest()


def chain_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def block_digests(root: bytes, token_ids: Sequence[int], block_size: int, start: int = 0,
                  parent: bytes | None = None) -> list[bytes]:
    """Digests of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent`` is the digest of block ``start - 1`` (or the root when ``start == 0``).
    """
    out: list[bytes] = []
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("parent digest required when start > 0")
    for i in range(start, len(token_ids) // block_size):
        prev = chain_digest(prev, token_ids[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out
