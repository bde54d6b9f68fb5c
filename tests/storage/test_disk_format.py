"""The block format and the layout's name rules, byte for byte; the bandwidth probe."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kvcellar.storage import BlockSpec
from kvcellar.storage import block_format as fmt
from kvcellar.storage.disk import layout, measure_read_bandwidth
from kvcellar.storage.disk.bandwidth import measure_read_bandwidth_detailed
from tests.storage import helpers
from tests.storage.helpers import SPEC

KEY, DIGEST = bytes(range(32)), bytes(range(100, 132))
TOKENS = tuple(range(1000, 1016))


def test_header_round_trip_and_layout() -> None:
    buf = fmt.encode_header(SPEC, KEY, DIGEST, TOKENS, 0xDEADBEEF, 123456789)
    assert len(buf) == fmt.header_size_for(16) == 4096
    assert buf[:8] == b"KVCBLOCK"
    assert struct.unpack_from("<HHIQI", buf, 8) == (fmt.FORMAT_VERSION, 0, 4096, SPEC.nbytes, 0xDEADBEEF)
    assert buf[28] == fmt.DTYPE_CODES[torch.bfloat16] and buf[29] == 5 and buf[30] == 32
    assert struct.unpack_from("<IIQ", buf, 32) == (16, 16, 123456789)
    assert struct.unpack_from("<8Q", buf, 48) == (2, 2, 16, 2, 8, 0, 0, 0)
    assert buf[112:144] == KEY and buf[176:208] == DIGEST
    assert buf[31] == 0 and not any(buf[208:272])  # a chain's first block has no parent
    assert struct.unpack_from("<16I", buf, 272) == TOKENS
    assert not any(buf[272 + 64 + 4:])  # zero padding up to the payload
    h = fmt.decode_header(buf)
    assert (h.key, h.digest, h.token_ids, h.shape, h.dtype) == (KEY, DIGEST, TOKENS, SPEC.shape, torch.bfloat16)
    assert h.parent is None
    fmt.check_geometry(h, SPEC)
    child = fmt.encode_header(SPEC, DIGEST, KEY, TOKENS, 1, 2, parent=KEY)
    assert child[31] == 32 and child[208:240] == KEY
    assert fmt.decode_header(child).parent == KEY


def test_header_sizes_stay_page_aligned() -> None:
    assert fmt.header_size_for(64) == 4096
    assert fmt.header_size_for(1024) == 8192
    big = BlockSpec(torch.float16, (1, 2, 1024, 1, 8), 1024)
    h = fmt.decode_header(fmt.encode_header(big, b"k", DIGEST, tuple(range(1024)), 1, 2))
    assert h.header_size == 8192 and h.key == b"k"


@pytest.mark.parametrize(("offset", "value", "reason"), [
    (0, b"X", "magic"), (8, b"\x07", "version"), (60, b"\x01", "header_checksum"),
    (12, b"\x00\x00\x00\x00", "geometry"),
    (fmt.FIXED_SIZE + 4 * 16 + 4 + fmt.SEAL_SIZE, b"\x01", "padding"), (4095, b"\xff", "padding"),
])
def test_header_checks(offset: int, value: bytes, reason: str) -> None:
    buf = fmt.encode_header(SPEC, KEY, DIGEST, TOKENS, 1, 2)
    buf[offset:offset + len(value)] = value
    with pytest.raises(fmt.HeaderError) as e:
        fmt.decode_header(buf)
    assert e.value.reason == reason


def test_a_sealed_block_is_read_only_with_its_secret_namespace_and_bytes() -> None:
    kv, other = torch.randn(SPEC.shape).to(SPEC.dtype), torch.randn(SPEC.shape).to(SPEC.dtype)
    seal = fmt.BlockSeal(b"a deployment secret", "fp")
    sealed = fmt.encode_block(SPEC, KEY, DIGEST, TOKENS, kv, 1, seal=seal)
    unsealed = fmt.encode_block(SPEC, KEY, DIGEST, TOKENS, kv, 1)
    assert sealed[:fmt.FIXED_SIZE] == unsealed[:fmt.FIXED_SIZE] and sealed != unsealed
    again = fmt.encode_block(SPEC, KEY, DIGEST, TOKENS, kv, 1, seal=seal)
    assert again != sealed  # a fresh nonce every time: no one-time key seals two values

    def read(value: bytes, with_seal: fmt.BlockSeal | None) -> tuple[str | None, torch.Tensor]:
        dest = torch.empty(SPEC.shape, dtype=SPEC.dtype)
        return fmt.decode_block_into(value, SPEC, KEY, DIGEST, TOKENS, dest, with_seal), dest

    reason, dest = read(sealed, seal)
    assert reason is None and torch.equal(dest, kv)
    assert read(sealed, None)[0] is None  # a replica without the secret ignores seals
    assert read(unsealed, seal)[0] == "unsealed"
    assert read(sealed, fmt.BlockSeal(b"another deployment secret", "fp"))[0] == "seal"
    assert read(sealed, fmt.BlockSeal(b"a deployment secret", "fp.snapshots"))[0] == "seal"
    forged = helpers.forged(sealed, other.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert read(forged, None)[0] is None  # what the secret is for: CRCs and identity pass
    assert read(forged, seal)[0] == "seal"
    for at in (40, fmt.FIXED_SIZE + 4 * 16 + 4 + 3, fmt.FIXED_SIZE + 4 * 16 + 4 + 20):  # created_ns, nonce, tag
        flipped = bytearray(sealed)
        flipped[at] ^= 1
        if at == 40:
            end = fmt.FIXED_SIZE + 4 * 16
            struct.pack_into("<I", flipped, end, zlib.crc32(flipped[:end]))
        assert read(bytes(flipped), seal)[0] == "seal"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        fmt.BlockSeal(b"short", "fp")


def test_a_rotation_reads_what_the_previous_secret_sealed_and_seals_with_the_new_one() -> None:
    kv = torch.randn(SPEC.shape).to(SPEC.dtype)
    old, new = b"the secret before the rotation", b"the secret after the rotation"
    before = fmt.encode_block(SPEC, KEY, DIGEST, TOKENS, kv, 1, seal=fmt.BlockSeal(old, "fp"))
    rotating = fmt.BlockSeal(fmt.CacheSecret(new, (old,)), "fp")
    after = fmt.encode_block(SPEC, KEY, DIGEST, TOKENS, kv, 1, seal=rotating)

    def sealer(value: bytes, seal: fmt.BlockSeal) -> int | str:
        header_size = fmt.declared_header_size(value)
        return seal.sealer(fmt.decode_header(value[:header_size]), value[:header_size], value[header_size:])

    assert sealer(before, rotating) == 1 and sealer(after, rotating) == 0
    assert sealer(after, fmt.BlockSeal(old, "fp")) == "seal"  # sealed with the new secret only
    assert sealer(before, fmt.BlockSeal(new, "fp")) == "seal"  # once the old one is dropped
    assert sealer(after, fmt.BlockSeal(new, "fp")) == 0
    forged = helpers.forged(before, torch.randn(SPEC.shape).to(SPEC.dtype).reshape(-1).view(torch.uint8)
                            .numpy().tobytes())
    assert sealer(forged, rotating) == "seal"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        fmt.BlockSeal(fmt.CacheSecret(new, (b"short",)), "fp")
    assert "rotation" not in repr(fmt.CacheSecret(new, (old,)))


def test_identity_limits() -> None:
    with pytest.raises(ValueError):
        fmt.encode_header(SPEC, b"", DIGEST, TOKENS, 1, 2)
    with pytest.raises(ValueError):
        fmt.encode_header(SPEC, bytes(65), DIGEST, TOKENS, 1, 2)
    with pytest.raises(ValueError):
        fmt.encode_header(SPEC, KEY, DIGEST, (*TOKENS[:-1], 2**32), 1, 2)


def test_names() -> None:
    assert layout.shard_of("2a") == "2a" and layout.shard_of("abcdef") == "ab"
    assert layout.key_from_block_name("0a1b.kvb") == b"\x0a\x1b"
    assert layout.key_from_block_name("0a1.kvb") is None and layout.key_from_block_name("zz.kvb") is None
    assert layout.tmp_owner("0a1b.kvb.123-abcd.7.tmp") == "123-abcd"
    assert layout.tmp_owner(".probe.9-ff.1.tmp") == "9-ff" and layout.tmp_owner("0a1b.kvb") is None
    assert layout.parse_namespace_dir("f00d-v1") == ("f00d", 1) and layout.parse_namespace_dir("x") is None
    with pytest.raises(ValueError):
        layout.namespace_dir_name("a/b")


def test_read_bandwidth_probe(tmp_path, tmpfs) -> None:
    assert measure_read_bandwidth(tmp_path, 8 << 20) > 0
    assert not list(tmp_path.iterdir())  # scratch file removed
    fs = tmpfs("16m")  # tmpfs accepts O_DIRECT since Linux 6.6; older kernels take the fadvise path
    bw = measure_read_bandwidth_detailed(fs.path, 4 << 20)
    assert bw.method in ("o_direct", "fadvise_dontneed") and bw.nbytes == 4 << 20 and bw.bytes_per_s > 0


def test_padding_is_checked_without_a_new_format_version() -> None:
    """Issue 14, F4: requiring zero padding keeps every file a version-2 writer made
    valid (it always wrote zeros), so FORMAT_VERSION stays 2; another version is still
    refused by the header check (a miss, never served)."""
    assert fmt.FORMAT_VERSION == 2
    buf = fmt.encode_header(SPEC, KEY, DIGEST, TOKENS, 1, 2)
    fmt.decode_header(buf)
    fmt.decode_header(buf[:fmt.FIXED_SIZE + 4 * 16 + 4 + fmt.SEAL_SIZE])  # a caller that read less checks what it has
    older = bytearray(buf)
    struct.pack_into("<H", older, 8, 1)
    with pytest.raises(fmt.HeaderError) as e:
        fmt.decode_header(older)
    assert e.value.reason == "version"


def test_quantized_kv_is_recorded_in_the_flags_and_checked() -> None:
    """A block of quantized KV says how (bits 0-3: KV bits, 4-15: group size); a block of
    another setting is never this one, even where its byte count is the same."""
    from tests.storage.helpers import SPEC_Q4, SPEC_Q8

    for spec, flags in ((SPEC, 0), (SPEC_Q8, 8 | 32 << 4), (SPEC_Q4, 4 | 32 << 4)):
        buf = fmt.encode_header(spec, KEY, DIGEST, TOKENS, 1, 2)
        assert struct.unpack_from("<H", buf, 10) == (flags,)
        h = fmt.decode_header(buf)
        assert h.flags == flags and h.dtype == spec.dtype and h.shape == spec.shape
        fmt.check_geometry(h, spec)
    same_bytes = BlockSpec(torch.uint8, SPEC_Q8.shape, 16, kv_bits=4, kv_group_size=16)
    assert same_bytes.nbytes == SPEC_Q8.nbytes
    with pytest.raises(fmt.HeaderError) as e:
        fmt.check_geometry(fmt.decode_header(fmt.encode_header(SPEC_Q8, KEY, DIGEST, TOKENS, 1, 2)), same_bytes)
    assert e.value.reason == "geometry"
    with pytest.raises(ValueError, match="kv_bits"):
        BlockSpec(torch.uint8, (2, 2, 64), 16, kv_bits=6, kv_group_size=32)


@pytest.mark.parametrize("which", ["q8", "q4"])
def test_quantized_blocks_round_trip_bit_exact_on_disk(tmp_path, which: str) -> None:
    from kvcellar.storage.disk.config import DiskConfig
    from kvcellar.storage.disk.tier import DiskTier
    from tests.storage.helpers import SPEC_Q4, SPEC_Q8, bits_equal, chain, load_request

    spec = SPEC_Q8 if which == "q8" else SPEC_Q4
    blocks = chain(4, spec, linked=True)
    for b in blocks:  # any byte may occur in packed values and float16 parameters
        b.data.copy_(torch.randint(0, 256, spec.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(
            int.from_bytes(b.key[:4], "little"))))
    tier = DiskTier(tmp_path, "fp", spec, DiskConfig(min_free_bytes=0, async_writes=False))
    tier.store(blocks)
    assert tier.lookup([b.key for b in blocks]) == 4
    loads = [load_request(b, torch.zeros(spec.shape, dtype=torch.uint8)) for b in blocks]
    assert tier.load(loads).result(30) == 4
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 4 and all(f.stat().st_size == 4096 + spec.nbytes for f in files)
    assert all(struct.unpack_from("<H", f.read_bytes(), 10) == (spec.flags,) for f in files)
    tier.close(10)
    # The same directory opened with another group size (a misconfigured namespace): every block a miss.
    other = BlockSpec(torch.uint8, spec.shape, 16, kv_bits=spec.kv_bits, kv_group_size=16)
    foreign = DiskTier(tmp_path, "fp", other, DiskConfig(min_free_bytes=0, async_writes=False))
    dest = torch.zeros(spec.shape, dtype=torch.uint8)
    assert foreign.load([load_request(blocks[0], dest)]).result(30) == 0
    assert torch.count_nonzero(dest) == 0
    foreign.close(10)
