"""The block format, version 2: one KV block as bytes, on disk and in a remote store.

One ``.kvb`` file (or one remote value) holds one KV block: a fixed-layout
header padded to a multiple of 4096 bytes, then the raw tensor bytes.
docs/block-format.md has the byte table; this module is the only code that
encodes or checks it (``storage/disk`` and ``storage/remote`` share it).

Why this shape:
- The header carries everything needed to prove a file is the block asked
  for: magic, version, dtype, shape, block size, key, chained digest, token
  ids, payload checksum, and a checksum over the header itself.
- Version 2 adds the key of the block's parent in its chain (none for a chain's
  first block), so eviction can go tail first and offline tools can find
  blocks whose prefix is gone (unreachable: never served again).
- The padding between the header checksum and the payload must be zeros: the
  header checksum does not cover it, and a flipped bit there was neither a
  load failure nor a ``cache verify`` finding. Requiring zeros
  rather than extending the checksum keeps every version-2 file valid (writers
  always wrote zeros), so the format version stays 2.
- The payload starts at a 4096-byte boundary, so it can be read with
  O_DIRECT or straight into an aligned tensor, with no extra copy.
- The payload checksum is CRC-32 (``zlib.crc32``'s value), fast and releasing
  the GIL (BLAKE2b and SHA-256 measured several times slower; see
  benchmarks/bench_disk_io.py); an engine installs kvcellar's carry-less
  multiplication kernel for it where the CPU has one (``use_crc32``), since a
  restart checks every byte it reads. CRC-32 detects corruption; identity is
  proven by the digest and the token ids, not by the checksum.
- A seal (``BlockSeal``) follows the header checksum: with a deployment secret, a random
  nonce and a tag over the header and payload under a one-time key derived from the
  secret, the namespace and the nonce. CRC-32 and the identity fields follow from public
  data (a fingerprint, a tokenizer), so anyone who can write to a shared Redis or cache
  directory can make a block that passes them; only the secret makes one that passes the
  seal. Without a secret the field is zeros and not read; with one, zeros or a wrong tag
  make the block a miss (deleted), and the seal stands in for the payload CRC on reads.
  The tag is ChaCha20-Poly1305's over the header (its plaintext) and the payload (its
  associated data, not copied): OpenSSL's, via ``cryptography``, runs at ~6 GB/s a core
  without the GIL, where HMAC-SHA256 and keyed BLAKE2b run at 0.7-1.5 GB/s and a bare
  Poly1305 holds the GIL (docs/performance.md). A one-time key per value means no
  (key, nonce) pair ever repeats, however many blocks a deployment writes. Rotation: a
  ``CacheSecret`` seals with its current secret and accepts its previous ones on reads.
- Integers are little-endian; the payload is the tensor's native byte order,
  which is little-endian on every platform kvcellar supports.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from kvcellar.stats import Count, SharedStats, counter
from kvcellar.storage.base import BlockSpec

FORMAT_VERSION = 2
MAGIC = b"KVCBLOCK"
FILE_SUFFIX = ".kvb"
HEADER_ALIGN = 4096
MAX_KEY_LEN = 64
DIGEST_LEN = 32
MAX_NDIM = 8

if sys.byteorder != "little":  # pragma: no cover - no big-endian target exists
    raise ImportError("kvcellar's block format assumes a little-endian host")

# Stable numeric codes; never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
    torch.int8: 7,
    torch.uint8: 8,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}

# magic, version, flags, header_size, payload_nbytes, payload_crc32,
# dtype, ndim, key_len, parent_len, block_size, num_tokens, created_ns,
# shape[8], key[64], digest[32], parent[64]
_FIXED = struct.Struct("<8sHHIQIBBBBIIQ8Q64s32s64s")
FIXED_SIZE = _FIXED.size  # 272
_CRC = struct.Struct("<I")
NONCE_SIZE = 16
_ZERO_NONCE = bytes(12)  # ChaCha20-Poly1305's own nonce: each one-time key is used once
SEAL_SIZE = NONCE_SIZE + 16  # nonce + Poly1305 tag, right after the header checksum; zeros if unsealed
_UNSEALED = bytes(SEAL_SIZE)
MIN_SECRET_BYTES = 16
_PREFIX = struct.Struct("<8sHHI")  # magic, version, flags, header_size: how _FIXED starts
# Bigger than any header a sane block size needs: a damaged size field must not make a
# reader allocate gigabytes before decode_header rejects it.
MAX_HEADER_SIZE = 1 << 20


@dataclass
class CheckStats(SharedStats):
    """Blocks that failed a check of this format, by the check (a ``HeaderError`` reason or
    what ``identity_mismatch``/the payload check report). Each tier's stats extend it and
    count what they deleted themselves (``corrupt_deleted``)."""

    corrupt_total: Count = counter()
    corrupt_deleted: Count = counter()
    corrupt_size: Count = counter()
    corrupt_truncated: Count = counter()
    corrupt_magic: Count = counter()
    corrupt_version: Count = counter()
    corrupt_header_checksum: Count = counter()
    corrupt_padding: Count = counter()
    corrupt_geometry: Count = counter()
    corrupt_key: Count = counter()
    corrupt_digest: Count = counter()
    corrupt_tokens: Count = counter()
    corrupt_checksum: Count = counter()
    corrupt_unsealed: Count = counter()  # no seal where the reader has a secret
    corrupt_seal: Count = counter()  # a seal that this secret did not make for these bytes

    def failed(self, reason: str) -> int:
        """Count a block that failed its ``reason`` check; the total so far."""
        self.add_named(f"corrupt_{reason}")
        return int(self.corrupt_total.add())


class HeaderError(ValueError):
    """A header that cannot be this block. ``reason`` names the failed check:
    one of ``magic``, ``version``, ``header_checksum``, ``padding``, ``geometry``,
    ``key``, ``truncated``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockHeader:
    version: int
    header_size: int
    payload_nbytes: int
    payload_crc32: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    block_size: int
    key: bytes
    digest: bytes
    token_ids: tuple[int, ...]
    created_ns: int
    parent: bytes | None = None  # key of the previous block of the chain; None for its first
    flags: int = 0  # ``BlockSpec.flags``: how the KV is quantized, 0 if it is not
    seal: bytes = _UNSEALED  # nonce + tag (``BlockSeal``); zeros when written without a secret


_ZEROS = bytes(HEADER_ALIGN)


def _zeros(n: int) -> bytes:
    return _ZEROS[:n] if n <= len(_ZEROS) else bytes(n)


def header_size_for(block_size: int) -> int:
    """Bytes before the payload for blocks of ``block_size`` tokens."""
    used = _seal_offset(block_size) + SEAL_SIZE
    return -(-used // HEADER_ALIGN) * HEADER_ALIGN


def _seal_offset(block_size: int) -> int:
    """Where the seal starts: after the token ids and the header checksum it covers."""
    return FIXED_SIZE + 4 * block_size + _CRC.size


def declared_header_size(head: bytes | bytearray | memoryview) -> int | None:
    """The header size that a block's first bytes declare, so a reader that does not know
    the block size knows how much to read; None unless ``head`` starts with the magic and
    declares at most ``MAX_HEADER_SIZE``. Unchecked otherwise: ``decode_header`` checks."""
    if len(head) < _PREFIX.size:
        return None
    magic, _, _, size = _PREFIX.unpack_from(head, 0)
    return size if magic == MAGIC and size <= MAX_HEADER_SIZE else None


def file_size_for(spec: BlockSpec) -> int:
    return header_size_for(spec.block_size) + spec.nbytes


def _zlib_crc32(buf: memoryview | bytes | bytearray) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


# The payload checksum's routine: zlib's, until an engine installs its CPU kernel's, which
# gives the same values faster (``use_crc32``; storage does not import the engine).
_crc32: Callable[[memoryview | bytes | bytearray], int] = _zlib_crc32


def use_crc32(routine: Callable[[memoryview | bytes | bytearray], int]) -> None:
    """Compute payload checksums with ``routine`` from now on: ``zlib.crc32``'s values."""
    global _crc32
    _crc32 = routine


def payload_checksum(buf: memoryview | bytes | bytearray) -> int:
    return _crc32(buf)


def encode_header(
    spec: BlockSpec,
    key: bytes,
    digest: bytes,
    token_ids: tuple[int, ...],
    payload_crc32: int,
    created_ns: int,
    parent: bytes | None = None,
) -> bytearray:
    """The full, padded header for one block (``header_size_for`` bytes)."""
    check_identity(spec, key, digest, token_ids)
    if parent is not None and not 1 <= len(parent) <= MAX_KEY_LEN:
        raise ValueError(f"parent key must be 1..{MAX_KEY_LEN} bytes, got {len(parent)}")
    if spec.dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {spec.dtype} has no block-format code")
    if len(spec.shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got {len(spec.shape)}")
    n = spec.block_size
    size = header_size_for(n)
    buf = bytearray(size)
    shape8 = tuple(int(d) for d in spec.shape) + (0,) * (MAX_NDIM - len(spec.shape))
    _FIXED.pack_into(
        buf, 0,
        MAGIC, FORMAT_VERSION, spec.flags, size, spec.nbytes, payload_crc32,
        DTYPE_CODES[spec.dtype], len(spec.shape), len(key), len(parent or b""),
        n, n, created_ns,
        *shape8,
        key.ljust(MAX_KEY_LEN, b"\0"), digest, (parent or b"").ljust(MAX_KEY_LEN, b"\0"),
    )
    struct.pack_into(f"<{n}I", buf, FIXED_SIZE, *token_ids)
    end = FIXED_SIZE + 4 * n
    _CRC.pack_into(buf, end, zlib.crc32(memoryview(buf)[:end]) & 0xFFFFFFFF)
    return buf


def decode_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and self-check a header (magic, version, header checksum, zero padding
    up to ``header_size`` or the end of ``buf``, whichever comes first).

    Comparing it with what the caller expects (spec, key, digest, token ids)
    is ``check_header``'s job.
    """
    mv = memoryview(buf)
    if len(mv) < FIXED_SIZE:
        raise HeaderError("truncated", f"{len(mv)} bytes")
    (magic, version, flags, hsize, nbytes, pcrc, dcode, ndim, klen, plen,
     block_size, ntok, created_ns, *rest) = _FIXED.unpack_from(mv, 0)
    shape8, key_field, digest, parent_field = rest[:MAX_NDIM], rest[MAX_NDIM], rest[MAX_NDIM + 1], rest[MAX_NDIM + 2]
    if magic != MAGIC:
        raise HeaderError("magic", repr(bytes(magic)))
    if version != FORMAT_VERSION:
        raise HeaderError("version", str(version))
    end = FIXED_SIZE + 4 * ntok
    sealed = _seal_offset(ntok)
    if hsize % HEADER_ALIGN or hsize < sealed + SEAL_SIZE or ntok != block_size:
        raise HeaderError("geometry", f"header_size={hsize} num_tokens={ntok} block_size={block_size}")
    if len(mv) < sealed + SEAL_SIZE:
        raise HeaderError("truncated", f"{len(mv)} < {sealed + SEAL_SIZE}")
    (stored_crc,) = _CRC.unpack_from(mv, end)
    if stored_crc != zlib.crc32(mv[:end]) & 0xFFFFFFFF:
        raise HeaderError("header_checksum")
    pad = mv[sealed + SEAL_SIZE:min(hsize, len(mv))]
    if pad.tobytes() != _zeros(len(pad)):  # tobytes: a memcmp, 20x faster than comparing views
        raise HeaderError("padding", "non-zero byte between the header checksum and the payload")
    if dcode not in DTYPES_BY_CODE or not 1 <= ndim <= MAX_NDIM or not 1 <= klen <= MAX_KEY_LEN \
            or plen > MAX_KEY_LEN:
        raise HeaderError("geometry", f"dtype={dcode} ndim={ndim} key_len={klen} parent_len={plen}")
    token_ids = struct.unpack_from(f"<{ntok}I", mv, FIXED_SIZE)
    return BlockHeader(
        version=version,
        header_size=hsize,
        payload_nbytes=nbytes,
        payload_crc32=pcrc,
        dtype=DTYPES_BY_CODE[dcode],
        shape=tuple(shape8[:ndim]),
        block_size=block_size,
        key=bytes(key_field[:klen]),
        digest=bytes(digest),
        token_ids=token_ids,
        created_ns=created_ns,
        parent=bytes(parent_field[:plen]) if plen else None,
        flags=flags,
        seal=mv[sealed:sealed + SEAL_SIZE].tobytes(),
    )


def check_geometry(header: BlockHeader, spec: BlockSpec) -> None:
    """Raise HeaderError unless the header describes a block of ``spec``."""
    if (
        header.dtype != spec.dtype
        or header.shape != tuple(spec.shape)
        or header.block_size != spec.block_size
        or header.payload_nbytes != spec.nbytes
        or header.header_size != header_size_for(spec.block_size)
        or header.flags != spec.flags
    ):
        raise HeaderError(
            "geometry",
            f"file has {header.dtype} {header.shape} bs={header.block_size} flags={header.flags:#x}, "
            f"namespace has {spec.dtype} {tuple(spec.shape)} bs={spec.block_size} flags={spec.flags:#x}",
        )


def check_identity(spec: BlockSpec, key: bytes, digest: bytes, token_ids: tuple[int, ...]) -> None:
    """Raise ValueError for identities that the format cannot hold."""
    if not 1 <= len(key) <= MAX_KEY_LEN:
        raise ValueError(f"key must be 1..{MAX_KEY_LEN} bytes, got {len(key)}")
    if len(digest) != DIGEST_LEN:
        raise ValueError(f"digest must be {DIGEST_LEN} bytes, got {len(digest)}")
    if len(token_ids) != spec.block_size:
        raise ValueError(f"expected {spec.block_size} token ids, got {len(token_ids)}")
    if any(not 0 <= t <= 0xFFFFFFFF for t in token_ids):
        raise ValueError("token ids must fit in an unsigned 32-bit integer")


def identity_mismatch(header: BlockHeader, key: bytes, digest: bytes, token_ids: tuple[int, ...]) -> str | None:
    """The failed identity check (``key``, ``digest``, ``tokens``), or None when the
    header names exactly this block."""
    if header.key != key:
        return "key"
    if header.digest != digest:
        return "digest"
    if header.token_ids != tuple(token_ids):
        return "tokens"
    return None


@dataclass(frozen=True)
class CacheSecret:
    """A deployment's secret: ``current`` seals what is written; while a rotation is under way,
    the secrets before it (``previous``) still unseal what they sealed."""

    current: bytes
    previous: tuple[bytes, ...] = ()

    def __repr__(self) -> str:  # never printed
        return f"CacheSecret(<{len(self.current)} bytes>, previous=<{len(self.previous)}>)"


class BlockSeal:
    """Seals and checks blocks of one namespace with a deployment secret (see the module's
    docstring). Thread-safe: it holds only immutable keys."""

    def __init__(self, secret: bytes | CacheSecret, namespace: str) -> None:
        secrets = (secret.current, *secret.previous) if isinstance(secret, CacheSecret) else (secret,)
        for one in secrets:
            if len(one) < MIN_SECRET_BYTES:
                raise ValueError(f"a cache secret must be at least {MIN_SECRET_BYTES} bytes, got {len(one)}")
        # The first seals; every one is accepted on reads.
        self._keys = tuple(hashlib.blake2b(one, digest_size=32, person=b"kvcellar-seal").digest()
                           for one in secrets)
        # The namespace is in every one-time key: a sealed block of one model, format or
        # snapshot namespace is no block of another.
        self._context = namespace.encode()

    def _tag(self, key: bytes, nonce: bytes, header: memoryview, payload: memoryview | bytes) -> bytes:
        one_time = hashlib.blake2b(nonce + self._context, key=key, digest_size=32, person=b"kvcellar-otk").digest()
        return ChaCha20Poly1305(one_time).encrypt(_ZERO_NONCE, bytes(header), payload)[-16:]

    def seal(self, header: bytearray, payload: memoryview | bytes, block_size: int) -> None:
        """Write the seal of ``header`` (from ``encode_header``) and ``payload`` into the
        header, under the current secret: a fresh nonce, so no one-time key seals two values."""
        at = _seal_offset(block_size)
        nonce = os.urandom(NONCE_SIZE)
        header[at:at + SEAL_SIZE] = nonce + self._tag(self._keys[0], nonce, memoryview(header)[:at], payload)

    def sealer(self, header: BlockHeader, raw_header: bytes | bytearray | memoryview,
               payload: memoryview | bytes) -> int | str:
        """Which secret sealed these bytes (0: the current one, 1...: the previous ones in
        order), else the failed check: ``unsealed`` or ``seal``."""
        if header.seal == _UNSEALED:
            return "unsealed"
        at = _seal_offset(header.block_size)
        nonce, tag = header.seal[:NONCE_SIZE], header.seal[NONCE_SIZE:]
        for i, key in enumerate(self._keys):
            if hmac.compare_digest(self._tag(key, nonce, memoryview(raw_header)[:at], payload), tag):
                return i
        return "seal"

    def check(self, header: BlockHeader, raw_header: bytes | bytearray | memoryview,
              payload: memoryview | bytes) -> str | None:
        """None if ``header`` (decoded from ``raw_header``) carries the seal of these bytes by
        one of the accepted secrets, else the failed check: ``unsealed`` or ``seal``."""
        found = self.sealer(header, raw_header, payload)
        return found if isinstance(found, str) else None


def payload_fault(header: BlockHeader, raw_header: bytes | bytearray | memoryview, payload: memoryview,
                  seal: BlockSeal | None) -> str | None:
    """None if ``payload`` is the one ``header`` (decoded from ``raw_header``) was written with,
    else the failed check: ``checksum``, or with ``seal`` ``unsealed`` or ``seal``. With a
    seal the CRC is computed only to name a failure (corruption or forgery): the seal alone
    proves the bytes."""
    if seal is None:
        return None if payload_checksum(payload) == header.payload_crc32 else "checksum"
    reason = seal.check(header, raw_header, payload)
    if reason is None:
        return None
    return "checksum" if payload_checksum(payload) != header.payload_crc32 else reason


def header_of(spec: BlockSpec, key: bytes, digest: bytes, token_ids: tuple[int, ...],
              payload: memoryview, created_ns: int, parent: bytes | None = None,
              seal: BlockSeal | None = None) -> bytearray:
    """The header of a block with these bytes (``encode_header`` with the payload's
    checksum), sealed when ``seal`` is given."""
    header = encode_header(spec, key, digest, token_ids, payload_checksum(payload), created_ns, parent)
    if seal is not None:
        seal.seal(header, payload, spec.block_size)
    return header


def encode_block(spec: BlockSpec, key: bytes, digest: bytes, token_ids: tuple[int, ...],
                 data: torch.Tensor, created_ns: int, parent: bytes | None = None,
                 seal: BlockSeal | None = None) -> bytes:
    """One whole block (header + payload) as one bytes value, for stores that keep
    values rather than files; sealed when ``seal`` is given."""
    payload = memoryview(data.reshape(-1).view(torch.uint8).numpy().data)
    return b"".join((header_of(spec, key, digest, token_ids, payload, created_ns, parent, seal), payload))


def decode_block_into(value: bytes | memoryview, spec: BlockSpec, key: bytes, digest: bytes,
                      token_ids: tuple[int, ...], dest: torch.Tensor, seal: BlockSeal | None = None) -> str | None:
    """Check a whole-block value against the block asked for and copy its payload into
    ``dest``. Returns None on success, else the failed check (``size``, a HeaderError
    reason, ``key``, ``digest``, ``tokens``, ``checksum``, and with ``seal`` ``unsealed``
    or ``seal``). Identity is settled before a byte reaches ``dest``; a damaged or forged
    payload may land there but is reported."""
    mv = memoryview(value)
    header_size = header_size_for(spec.block_size)
    if len(mv) != header_size + spec.nbytes:
        return "size"
    try:
        header = decode_header(mv[:header_size])
        check_geometry(header, spec)
    except HeaderError as e:
        return e.reason
    reason = identity_mismatch(header, key, digest, token_ids)
    if reason is not None:
        return reason
    out = memoryview(dest.reshape(-1).view(torch.uint8).numpy().data)
    out[:] = mv[header_size:]
    return payload_fault(header, mv[:header_size], out, seal)
