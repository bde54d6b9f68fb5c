"""Blocks that go away: removed through the tier (``DiskTier.remove``), or behind its back
(``kvcellar cache clear``, another process's eviction), found out by a lookup, a store or a
load. Each is a miss, never an exception, and the stale entry is dropped and counted."""

from __future__ import annotations

import os

from tests.storage.helpers import bits_equal, block, chain, files, load_request


def test_remove_deletes_present_keys_and_ignores_absent_ones(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path)
    blocks = chain(3)
    tier.store(blocks)
    assert tier.wait_idle(30)
    keep = blocks[1]
    gone = [blocks[0], blocks[2]]
    never_stored = block(99)
    assert tier.remove([gone[0].key, never_stored.key, gone[1].key]) == 2
    assert tier.remove([gone[0].key]) == 0  # already removed
    for b in gone:
        assert not tier.layout.block_path(b.key).exists() and tier.lookup([b.key]) == 0
    assert tier.lookup([keep.key]) == 1
    assert [p.name for p in files(tmp_path, ".kvb")] == [tier.layout.block_path(keep.key).name]
    s = tier.stats()
    assert s["ssd_removed_blocks"] == 2
    assert (s["ssd_blocks"], s["ssd_bytes"]) == (1, tier.file_size)
    assert s["ssd_stale_dropped"] == 0  # removed through the tier: nothing stale was found
    req = load_request(keep)
    assert tier.load([req]).result(timeout=30) == 1 and bits_equal(req.dest, keep.data)


def test_lookup_drops_an_entry_whose_file_was_removed_behind_its_back(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path)
    b = block(0)
    tier.store([b])
    assert tier.wait_idle(30)
    assert tier.lookup([b.key]) == 1 and tier.stats()["ssd_blocks"] == 1
    os.unlink(tier.layout.block_path(b.key))
    assert tier.lookup([b.key]) == 0
    s = tier.stats()
    assert s["ssd_stale_dropped"] == 1 and s["ssd_blocks"] == 0
    assert tier.lookup([b.key]) == 0 and tier.stats()["ssd_stale_dropped"] == 1  # dropped once
    assert tier.lookup([block(1).key]) == 0 and tier.stats()["ssd_stale_dropped"] == 1  # never known: not stale


def test_store_rewrites_a_block_whose_file_was_removed_behind_its_back(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path)
    b = block(0)
    tier.store([b])
    assert tier.wait_idle(30)
    os.unlink(tier.layout.block_path(b.key))
    tier.store([b])  # the table still knows it: admission checks the file, drops the entry, writes again
    assert tier.wait_idle(30)
    s = tier.stats()
    assert s["ssd_stale_dropped"] == 1 and s["ssd_stored_blocks"] == 2 and s["ssd_store_skipped_existing"] == 0
    req = load_request(b)
    assert tier.load([req]).result(timeout=30) == 1 and bits_equal(req.dest, b.data)


def test_block_file_missing_at_read_time_is_a_counted_miss(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path)
    blocks = chain(2)
    tier.store(blocks)
    assert tier.wait_idle(30)
    assert tier.lookup([b.key for b in blocks]) == 2  # present when asked...
    os.unlink(tier.layout.block_path(blocks[0].key))  # ... gone when read
    reqs = [load_request(b) for b in blocks]
    assert tier.load(reqs).result(timeout=30) == 0  # the run of hits ends at the missing block
    s = tier.stats()
    assert s["ssd_load_missing"] == 1 and s["ssd_load_misses"] == 2 and s["ssd_load_hits"] == 0
    assert s["ssd_corrupt_total"] == 0 and s["ssd_read_errors"] == 0 and tier.health()["state"] == "ok"
    assert s["ssd_blocks"] == 1 and s["ssd_pinned_blocks"] == 0  # the entry is dropped, pins released
    assert tier.layout.block_path(blocks[1].key).exists()  # a missing file is not a damaged one: nothing deleted
    assert tier.lookup([blocks[0].key]) == 0 and tier.stats()["ssd_stale_dropped"] == 0
