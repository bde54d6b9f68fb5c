"""Access times, the SSD tier's LRU and TTL clock: flushed to the files' atimes on the
``ssd_flush_interval_s`` timer (not only at close), and refreshed by a store of a block
already on disk, so a block that keeps being computed again is kept."""

from __future__ import annotations

import os
import time

from kvcellar.storage.block_format import file_size_for
from kvcellar.storage.disk.config import DAY_S
from tests.helpers import wait_until
from tests.storage.helpers import SPEC, block, chain

FILE = file_size_for(SPEC)
OLD_NS = time.time_ns() - int(30 * DAY_S * 1e9)  # a month ago: older than any TTL used here


def age(path: os.PathLike[str], atime_ns: int) -> None:
    """Set a block file's atime (its last access, for LRU and TTL); mtime is kept."""
    os.utime(path, ns=(atime_ns, os.stat(path).st_mtime_ns))


def test_access_times_reach_the_files_on_the_flush_timer(tmp_path, open_tier) -> None:
    """A loaded (or touched) block's new access time is written to its file's atime every
    ``ssd_flush_interval_s`` while the tier is open: a crash loses at most one interval
    of LRU order, not the whole session's."""
    tier = open_tier(tmp_path, async_writes=False, flush_interval_s=0.05)
    assert tier.wait_scanned(30)
    b = block(0)
    tier.store([b])
    path = tier.layout.block_path(b.key)
    age(path, OLD_NS)
    mtime = os.stat(path).st_mtime_ns
    tier.touch([b.key])  # a RAM hit keeps the SSD copy recent
    wait_until(lambda: os.stat(path).st_atime_ns > OLD_NS, timeout=30,
               what="the upkeep thread to flush the access time, with the tier still open")
    assert os.stat(path).st_mtime_ns == mtime  # mtime stays the write time


def test_storing_a_block_already_on_disk_makes_it_recent_for_lru(tmp_path, open_tier) -> None:
    """A write-through store of a block the tier holds writes nothing but counts as an access:
    the next eviction takes the block that was really least recently used."""
    tier = open_tier(tmp_path, async_writes=False, capacity_bytes=3 * FILE)
    assert tier.wait_scanned(30)
    a, b, c, d = chain(4)
    for x in (a, b, c):
        tier.store([x])
    tier.store([a])  # computed again (RAM had evicted it): deduplicated
    assert tier.stats()["ssd_store_skipped_existing"] == 1
    tier.store([d])  # no room for four: the least recently used goes
    assert [tier.layout.block_path(x.key).exists() for x in (a, b, c, d)] == [True, False, True, True]


def test_storing_a_block_already_on_disk_renews_it_for_the_ttl(tmp_path, open_tier) -> None:
    """The access time a deduplicated store gives a block reaches its file, so the next
    process's TTL prune keeps it; an untouched block of the same age is pruned."""
    first = open_tier(tmp_path, async_writes=False, ttl_s=7 * DAY_S)
    assert first.wait_scanned(30)
    kept, pruned = chain(2)
    first.store([kept, pruned])
    for x in (kept, pruned):
        age(first.layout.block_path(x.key), OLD_NS)
    first.store([kept])  # deduplicated: an access
    assert first.stats()["ssd_store_skipped_existing"] == 1
    assert first.close(10)  # flushes the access times
    second = open_tier(tmp_path, async_writes=False, ttl_s=7 * DAY_S)
    assert second.wait_scanned(30)  # the start-up scan reads the atimes and prunes by TTL
    assert second.layout.block_path(kept.key).exists()
    assert not second.layout.block_path(pruned.key).exists()
    assert second.stats()["ssd_ttl_pruned_blocks"] == 1
