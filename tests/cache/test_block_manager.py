"""The RAM tier's bookkeeping: references, LRU reuse, tail-first eviction, verified hits."""

from __future__ import annotations

import pytest

from kvcellar.cache.block_manager import BlockManager, OutOfBlocksError
from kvcellar.cache.hashing import block_digests, chain_digest, root_digest
from kvcellar.engine.config import EngineConfig
from kvcellar.settings import load_settings

BS = 4


def digests_of(tokens, root=b"r" * 32):
    return block_digests(root, tokens, BS)


def blocks_of(tokens):
    return [tuple(tokens[i : i + BS]) for i in range(0, len(tokens) - len(tokens) % BS, BS)]


def fill(bm, tokens):
    """Allocate and register blocks for ``tokens`` as a finished sequence would."""
    ds = digests_of(tokens)
    blocks = bm.allocate(len(ds))
    for b, d, t in zip(blocks, ds, blocks_of(tokens), strict=True):
        assert bm.register(b, d, t)
    return blocks


def test_digests_are_stable_chained_and_salted():
    root = root_digest("model-a")
    assert root == root_digest("model-a")
    assert root != root_digest("model-b")
    assert root_digest("m", None) != root_digest("m", "") != root_digest("m", "x")
    a = block_digests(root, list(range(12)), BS)
    b = block_digests(root, [99, *range(1, 12)], BS)
    assert len(a) == 3
    assert a[0] != b[0] and a[1] != b[1], "a change in block 0 changes every later digest"
    assert a[1] == chain_digest(a[0], [4, 5, 6, 7])


def test_digest_is_process_independent():
    import os
    import subprocess
    import sys

    code = "from kvcellar.cache.hashing import block_digests, root_digest;" \
           "print(block_digests(root_digest('m','s'), list(range(8)), 4)[-1].hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert outs == {block_digests(root_digest("m", "s"), list(range(8)), 4)[-1].hex() + "\n"}


def test_refcounts_and_lru_reuse():
    bm = BlockManager(9, BS)
    assert bm.available() == 8
    seq_a = fill(bm, list(range(12)))
    assert bm.num_used == 3
    bm.release(seq_a)
    assert bm.num_used == 0 and bm.num_evictable == 3
    hits = bm.match(digests_of(list(range(12))), blocks_of(list(range(12))))
    assert [b.block_id for b in hits] == [b.block_id for b in seq_a]
    bm.acquire(hits)
    assert bm.num_used == 3 and bm.num_evictable == 0
    bm.acquire(hits[:1])  # a second sequence shares the first block
    bm.release(hits)
    assert hits[0].ref_count == 1 and bm.num_evictable == 2
    bm.release(hits[:1])
    assert bm.num_evictable == 3 and all(b.ref_count == 0 for b in hits)


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(7, BS)  # 6 usable blocks
    old = fill(bm, list(range(12)))  # 3 blocks
    bm.release(old)
    new = fill(bm, list(range(100, 112)))  # 3 more blocks: pool now full of cached blocks
    bm.release(new)
    assert bm.num_free == 0 and bm.num_evictable == 6
    taken = bm.allocate(1)
    # least recently used sequence goes first, and within it the tail block first
    assert taken[0] is old[2]
    assert bm.match(digests_of(list(range(12))), blocks_of(list(range(12)))) == old[:2]
    # touching the old head makes it recent again: the newer sequence's tail goes next
    bm.acquire(old[:2])
    bm.release(old[:2])
    assert bm.allocate(1)[0] is new[2]
    assert bm.stats.evictions == 2


def test_a_block_given_back_empty_is_the_next_handed_out():
    """A draft's rejected block, or a sequence's unfinished tail, is reused before a block never
    touched (whose first write faults its pages in), and before any cached block is evicted."""
    bm = BlockManager(9, BS)
    cached = fill(bm, list(range(8)))
    bm.release(cached)
    first = bm.allocate(3)
    bm.release(first[1:2])
    bm.release(first[2:])
    assert bm.allocate(1)[0] is first[2]
    assert bm.allocate(1)[0] is first[1]
    assert bm.num_evictable == 2 and bm.stats.evictions == 0


def test_allocate_beyond_capacity_raises():
    bm = BlockManager(3, BS)
    bm.allocate(2)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(1)


def test_tiny_key_space_collisions_never_serve_wrong_blocks():
    """With 1-byte keys, different prefixes collide in the table; a hit still requires the
    full digest and the token ids, so collisions are misses."""
    bm = BlockManager(600, BS, key_bytes=1)
    registered: dict[bytes, tuple[int, ...]] = {}
    import random

    rng = random.Random(7)
    for _ in range(300):
        tokens = [rng.randrange(50) for _ in range(8)]
        blocks = fill_lenient(bm, tokens)
        for b in blocks:
            if b.registered:
                registered[b.digest] = b.token_ids
        bm.release(blocks)
    assert bm.stats.collisions > 0
    for _ in range(2000):
        tokens = [rng.randrange(50) for _ in range(8)]
        ds = digests_of(tokens)
        for block, digest, toks in zip(bm.match(ds, blocks_of(tokens)), ds, blocks_of(tokens), strict=False):
            assert block.digest == digest and block.token_ids == toks


@pytest.mark.parametrize("key_bytes", [0, 33])
def test_a_key_outside_the_digest_is_refused(key_bytes):
    """0 bytes would key every block b"" (which no tier can store); past 32 is no more digest."""
    with pytest.raises(ValueError, match="key_bytes must be between 1 and 32"):
        BlockManager(4, BS, key_bytes=key_bytes)
    with pytest.raises(ValueError, match="key_bytes must be between 1 and 32"):
        EngineConfig(key_bytes=key_bytes).validate()


def test_key_bytes_is_no_setting(tmp_path, monkeypatch):
    """Nothing but tests needs a shorter key: users cannot set one (a file that tries is told
    so; the environment is not read for it)."""
    monkeypatch.delenv("KVCELLAR_CONFIG", raising=False)
    monkeypatch.setenv("KVCELLAR_KEY_BYTES", "8")
    assert load_settings().engine.key_bytes == 32
    conf = tmp_path / "kvcellar.toml"
    conf.write_text("[engine]\nkey_bytes = 8\n")
    with pytest.raises(ValueError, match="unknown setting 'key_bytes'"):
        load_settings(conf)


def fill_lenient(bm, tokens):
    ds = digests_of(tokens)
    blocks = bm.allocate(len(ds))
    for b, d, t in zip(blocks, ds, blocks_of(tokens), strict=True):
        bm.register(b, d, t)  # may refuse: key taken by another block
    return blocks


def test_duplicate_content_stays_private_and_is_freed():
    bm = BlockManager(9, BS)
    a = fill(bm, list(range(4)))
    b = bm.allocate(1)
    assert not bm.register(b[0], digests_of(list(range(4)))[0], tuple(range(4)))
    bm.release(b)
    assert bm.num_free == 7  # the duplicate went back to the free list, not the cache
    bm.release(a)
    assert bm.num_evictable == 1
