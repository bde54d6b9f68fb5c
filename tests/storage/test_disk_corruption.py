"""A block that is damaged, foreign, or belongs to another prefix is a miss:
counted, deleted, never reported as loaded."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcellar.storage import DiskTier
from kvcellar.storage import block_format as fmt
from tests.storage.helpers import SPEC, bits_equal, block, chain, load_request

HEADER = fmt.header_size_for(SPEC.block_size)


def _patch_header(path: Path, offset: int, packed: bytes, *, fix_crc: bool) -> None:
    buf = bytearray(path.read_bytes())
    buf[offset:offset + len(packed)] = packed
    if fix_crc:
        end = fmt.FIXED_SIZE + 4 * SPEC.block_size
        struct.pack_into("<I", buf, end, zlib.crc32(bytes(buf[:end])) & 0xFFFFFFFF)
    path.write_bytes(bytes(buf))


def _flip_payload_byte(p: Path) -> None:
    with open(p, "r+b") as f:
        f.seek(HEADER + 100)
        b = f.read(1)
        f.seek(HEADER + 100)
        f.write(bytes([b[0] ^ 0xFF]))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "payload_byte": (_flip_payload_byte, "checksum"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size - 100), "size"),
    "extended": (lambda p: os.truncate(p, p.stat().st_size + 10), "size"),
    "magic": (lambda p: _patch_header(p, 0, b"NOTABLCK", fix_crc=True), "magic"),
    "version": (lambda p: _patch_header(p, 8, struct.pack("<H", fmt.FORMAT_VERSION + 1), fix_crc=True), "version"),
    "header_bit": (lambda p: _patch_header(p, 40, b"\x01", fix_crc=False), "header_checksum"),
    "dtype_field": (lambda p: _patch_header(p, 28, bytes([fmt.DTYPE_CODES[fmt.torch.float16]]), fix_crc=True),
                    "geometry"),
    "shape_field": (lambda p: _patch_header(p, 48, struct.pack("<Q", 3), fix_crc=True), "geometry"),
    "token_in_header": (lambda p: _patch_header(p, fmt.FIXED_SIZE, struct.pack("<I", 12345), fix_crc=True),
                        "tokens"),
    "zeroed": (lambda p: p.write_bytes(bytes(p.stat().st_size)), "magic"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_block_is_a_counted_deleted_miss(tmp_path, open_tier, damage: str) -> None:
    tier: DiskTier = open_tier(tmp_path, async_writes=False)
    assert tier.wait_scanned(30)  # the start-up scan would remove a wrong-size file itself
    blocks = chain(4)
    tier.store(blocks)
    victim = tier.layout.block_path(blocks[2].key)
    corrupt, reason = DAMAGE[damage]
    corrupt(victim)

    reqs = [load_request(b) for b in blocks]
    assert tier.load(reqs).result(timeout=30) == 2  # the run ends at the damaged block
    assert all(bits_equal(r.dest, b.data) for r, b in zip(reqs[:2], blocks, strict=False))
    s = tier.stats()
    assert s[f"ssd_corrupt_{reason}"] == 1 and s["ssd_corrupt_total"] == 1 and s["ssd_corrupt_deleted"] == 1
    assert not victim.exists()
    assert tier.lookup([b.key for b in blocks]) == 2
    # The block is written again the next time it is stored, and then served.
    tier.store(blocks)
    assert tier.load([load_request(b) for b in blocks]).result(timeout=30) == 4


@pytest.mark.parametrize("what", ["digest", "tokens"])
def test_identity_mismatch_is_a_miss_and_deleted(tmp_path, open_tier, what: str) -> None:
    tier = open_tier(tmp_path, async_writes=False)
    b = block(0)
    tier.store([b])
    req = load_request(b)
    if what == "digest":
        req = req.__class__(req.key, bytes(32), req.token_ids, req.dest)
    else:
        req = req.__class__(req.key, req.digest, (*req.token_ids[:-1], req.token_ids[-1] + 1), req.dest)
    assert tier.load([req]).result(timeout=30) == 0
    assert tier.stats()[f"ssd_corrupt_{what}"] == 1
    assert tier.lookup([b.key]) == 0


def test_colliding_tiny_keys_never_serve_the_wrong_block(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, async_writes=False)
    key = b"\x2a"  # 1-byte keys: every block with this key shares one file path
    a = block(1, key=key)
    b = block(2, key=key)
    assert tier.layout.block_path(key).name == "2a.kvb"
    tier.store([a])
    tier.store([b])  # the key is present: not rewritten
    assert tier.stats()["ssd_store_skipped_existing"] == 1
    req_b = load_request(b)
    assert tier.load([req_b]).result(timeout=30) == 0  # a's bytes are never served as b
    assert not bits_equal(req_b.dest, a.data)
    assert tier.stats()["ssd_corrupt_digest"] == 1
    assert tier.lookup([key]) == 0  # the mismatching file was deleted
    tier.store([b])
    req_b = load_request(b)
    assert tier.load([req_b]).result(timeout=30) == 1 and bits_equal(req_b.dest, b.data)
    req_a = load_request(a)
    assert tier.load([req_a]).result(timeout=30) == 0


def test_two_byte_keys_in_a_batch(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, async_writes=False)
    blocks = [block(i, key=bytes([i, 0x10])) for i in range(6)]
    tier.store(blocks)
    impostor = block(100, key=blocks[3].key)
    reqs = [load_request(b) for b in blocks[:3]] + [load_request(impostor)] + [load_request(b) for b in blocks[4:]]
    assert tier.load(reqs).result(timeout=30) == 3
    assert tier.stats()["ssd_corrupt_digest"] == 1


def test_replaced_file_is_not_deleted_by_a_stale_verdict(tmp_path, open_tier) -> None:
    """Deleting a corrupt file checks it is still the file that was read."""
    tier = open_tier(tmp_path, async_writes=False)
    assert tier.wait_scanned(30)
    b = block(0)
    tier.store([b])
    path = tier.layout.block_path(b.key)
    good = path.read_bytes()
    _flip_payload_byte(path)
    st = path.stat()
    tmp = path.with_name("replacement")
    tmp.write_bytes(good)
    os.replace(tmp, path)  # a writer renamed a good copy over it
    tier._corrupt(path, b.key, "checksum", st.st_ino, st.st_dev)
    assert path.exists()
    req = load_request(b)
    assert tier.load([req]).result(timeout=30) == 1 and bits_equal(req.dest, b.data)
