"""A block that is damaged, foreign, or belongs to another prefix is a miss:
counted, deleted, never reported as loaded."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcellar.storage import block_format as fmt
from kvcellar.storage.disk import DiskTier, maintenance
from tests.storage.helpers import SPEC, bits_equal, block, chain, load_request

HEADER = fmt.header_size_for(SPEC.block_size)
PADDING = fmt.FIXED_SIZE + 4 * SPEC.block_size + 4  # first byte after the header checksum


def _patch_header(path: Path, offset: int, packed: bytes, *, fix_crc: bool) -> None:
    buf = bytearray(path.read_bytes())
    buf[offset:offset + len(packed)] = packed
    if fix_crc:
        end = fmt.FIXED_SIZE + 4 * SPEC.block_size
        struct.pack_into("<I", buf, end, zlib.crc32(bytes(buf[:end])) & 0xFFFFFFFF)
    path.write_bytes(bytes(buf))


def _flip_header_bit(path: Path, offset: int) -> None:
    """Flip one bit (setting a byte could write the value it already had: offset 40 is the
    low byte of ``created_ns``, 0x01 one time in 256)."""
    buf = bytearray(path.read_bytes())
    buf[offset] ^= 0x01
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
    "header_bit": (lambda p: _flip_header_bit(p, 40), "header_checksum"),
    "dtype_field": (lambda p: _patch_header(p, 28, bytes([fmt.DTYPE_CODES[fmt.torch.float16]]), fix_crc=True),
                    "geometry"),
    "shape_field": (lambda p: _patch_header(p, 48, struct.pack("<Q", 3), fix_crc=True), "geometry"),
    "token_in_header": (lambda p: _patch_header(p, fmt.FIXED_SIZE, struct.pack("<I", 12345), fix_crc=True),
                        "tokens"),
    "zeroed": (lambda p: p.write_bytes(bytes(p.stat().st_size)), "magic"),
    # Issue 14, F4: the padding after the header checksum is not covered by it; it must be zeros.
    "header_padding": (lambda p: _patch_header(p, PADDING + 100, b"\x01", fix_crc=False), "padding"),
    "last_padding_byte": (lambda p: _patch_header(p, HEADER - 1, b"\x80", fix_crc=False), "padding"),
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
    tier._ns.corrupt(path, b.key, "checksum", st.st_ino, st.st_dev)
    assert path.exists()
    req = load_request(b)
    assert tier.load([req]).result(timeout=30) == 1 and bits_equal(req.dest, b.data)


@pytest.mark.parametrize("async_writes", [True, False])
def test_later_corrupt_blocks_of_a_chain_are_repaired_when_it_is_stored_again(tmp_path, open_tier,
                                                                             async_writes: bool) -> None:
    """Issue 14, F5: a load stops at the first bad block of a chain, so the bad blocks after
    it were never read; when the recomputed chain was stored again their files "already
    existed" and stayed bad. Now a store of those keys checks the file and rewrites it."""
    tier: DiskTier = open_tier(tmp_path, async_writes=async_writes)
    assert tier.wait_scanned(30)
    blocks = chain(10, linked=True)
    tier.store(blocks)
    assert tier.wait_idle(30)
    victims = [3, 5, 6, 8]
    for v in victims:
        _flip_payload_byte(tier.layout.block_path(blocks[v].key))
    _patch_header(tier.layout.block_path(blocks[6].key), PADDING + 9, b"\x02", fix_crc=False)

    assert tier.lookup([b.key for b in blocks]) == 10  # every file has the right size
    assert tier.load([load_request(b) for b in blocks]).result(timeout=30) == 3
    # The engine recomputes from the first bad block and offers the rest of the chain again.
    assert all(tier.wants(b.key) for b in blocks[3:])
    tier.store(blocks[3:])
    assert tier.wait_idle(30)

    (rep,) = maintenance.verify_cache(tmp_path, delete=False)
    assert (rep.checked, rep.ok, rep.bad) == (10, 10, {})
    s = tier.stats()
    # Readers run a batch's blocks in parallel: a bad block after the first may also have been
    # read (and deleted) before the batch stopped. Each bad block is found exactly once either way;
    # the good suspects (4, 7, 9) are checked and kept.
    assert s["ssd_corrupt_total"] == 4, s
    assert s["ssd_store_verified_existing"] == 3 + s["ssd_store_repaired"], s
    reqs = [load_request(b) for b in blocks]
    assert tier.load(reqs).result(timeout=30) == 10
    assert all(bits_equal(r.dest, b.data) for r, b in zip(reqs, blocks, strict=True))
    # Checked once: storing the chain again now skips the files as usual.
    tier.store(blocks)
    assert tier.wait_idle(30)
    assert tier.stats()["ssd_store_verified_existing"] == s["ssd_store_verified_existing"]
    assert not any(tier.wants(b.key) for b in blocks)


def test_blocks_after_a_wrong_size_block_are_checked_when_stored_again(tmp_path, open_tier) -> None:
    """The lookup's size check ends the run too: the blocks after it are suspects."""
    tier: DiskTier = open_tier(tmp_path, async_writes=False)
    assert tier.wait_scanned(30)
    blocks = chain(6, linked=True)
    tier.store(blocks)
    os.truncate(tier.layout.block_path(blocks[2].key), 100)
    _flip_payload_byte(tier.layout.block_path(blocks[4].key))
    assert tier.lookup([b.key for b in blocks]) == 2
    tier.store(blocks[2:])
    (rep,) = maintenance.verify_cache(tmp_path, delete=False)
    assert (rep.ok, rep.bad) == (6, {})
