"""Capacity: byte limit with LRU by last access, free-space floor on a real small
filesystem, TTL pruning on the timer, eviction racing concurrent reads."""

from __future__ import annotations

import logging
import os
import random
import threading

from kvcellar.server.metrics import TIER_STATES
from kvcellar.storage.block_format import file_size_for
from kvcellar.storage.disk import maintenance
from kvcellar.storage.disk.config import DiskConfig
from tests.helpers import wait_until
from tests.storage.helpers import SPEC, SPEC_BIG, bits_equal, block, chain, files, load_request

FILE = file_size_for(SPEC)


def on_disk(tier, blocks) -> list[int]:
    """Presence without side effects (lookup would lease and touch the blocks)."""
    return [int(tier.layout.block_path(b.key).exists()) for b in blocks]


def test_byte_limit_evicts_least_recently_used(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, async_writes=False, capacity_bytes=5 * FILE)
    assert tier.wait_scanned(30)
    blocks = chain(8)
    tier.store(blocks[:5])
    assert tier.load([load_request(blocks[0])]).result(timeout=30) == 1  # block 0 is now the most recent
    tier.store(blocks[5:6])
    assert on_disk(tier, blocks[:6]) == [1, 0, 1, 1, 1, 1]  # block 1 was least recently used
    tier.store(blocks[6:8])
    assert on_disk(tier, blocks) == [1, 0, 0, 0, 1, 1, 1, 1]
    s = tier.stats()
    assert s["ssd_evicted_blocks"] == 3 and s["ssd_bytes"] == 5 * FILE == s["ssd_blocks"] * FILE
    assert len(files(tmp_path, ".kvb")) == 5


def test_byte_limit_evicts_a_chain_from_its_tail(tmp_path, open_tier) -> None:
    """Chain A is written before chain B, head first, so A's head is the oldest block; LRU
    by block would delete it and leave A's tail unreachable. Eviction takes leaves only."""
    tier = open_tier(tmp_path, async_writes=False, capacity_bytes=6 * FILE)
    assert tier.wait_scanned(30)
    a, b = chain(4, linked=True), chain(4, seed=1, linked=True)
    for part in (a[:2], a[2:], b[:2], b[2:]):  # one store per engine step
        tier.store(part)
    assert on_disk(tier, a) == [1, 1, 0, 0] and on_disk(tier, b) == [1, 1, 1, 1]
    # A chain longer than the limit is cut at its tail: its own prefix is never evicted for it.
    c = chain(8, seed=2, linked=True)
    for x in c:
        tier.store([x])
    assert on_disk(tier, c) == [1] * 6 + [0, 0] and on_disk(tier, a + b) == [0] * 8
    s = tier.stats()
    # c[6] found no room; c[7], unreachable without it, may not evict anything either
    assert s["ssd_dropped_capacity"] == 2 and s["writer_dropped_no_parent"] == 1 and s["ssd_evicted_blocks"] == 8
    assert maintenance.cache_stats(tmp_path)[0].unreachable_blocks == 0


def test_tail_first_after_a_restart(tmp_path, open_tier) -> None:
    """Parents come back from the headers: a new process also evicts tails first."""
    first = open_tier(tmp_path, async_writes=False)
    a, b = chain(4, linked=True), chain(4, seed=1, linked=True)
    first.store(a)
    first.store(b)
    assert first.load([load_request(x) for x in a]).result(timeout=30) == 4  # A is now the recent one
    assert first.close(10)  # flushes access times
    second = open_tier(tmp_path, async_writes=False, capacity_bytes=6 * FILE)
    assert second.wait_scanned(30)  # start-up scan, then the limit is enforced
    assert on_disk(second, b) == [1, 1, 0, 0] and on_disk(second, a) == [1, 1, 1, 1]


def test_stats_count_and_prune_removes_unreachable_blocks(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, async_writes=False)
    a, b = chain(5, linked=True), chain(3, seed=1, linked=True)
    tier.store(a + b)
    assert tier.close(10)
    tier.layout.block_path(a[1].key).unlink()  # e.g. another tool deleted one block: a[2:] are orphans
    (st,) = maintenance.cache_stats(tmp_path)
    assert (st.blocks, st.unreachable_blocks) == (7, 3)
    rep = maintenance.prune_cache(tmp_path, ttl_s=3600)
    assert rep.unreachable_removed == 3 and rep.remaining_blocks == 4
    assert on_disk(tier, a) == [1, 0, 0, 0, 0] and on_disk(tier, b) == [1, 1, 1]
    assert maintenance.cache_stats(tmp_path)[0].unreachable_blocks == 0


def test_access_times_survive_a_restart(tmp_path, open_tier) -> None:
    """LRU order comes from file atimes, so a new process evicts the right block."""
    first = open_tier(tmp_path, async_writes=False)
    blocks = chain(4)
    first.store(blocks)
    assert first.load([load_request(blocks[0])]).result(timeout=30) == 1
    assert first.close(10)  # flushes access times
    second = open_tier(tmp_path, async_writes=False, capacity_bytes=4 * FILE)
    assert second.wait_scanned(30)
    second.store([block(10)])
    assert on_disk(second, blocks) == [1, 0, 1, 1]


def test_block_larger_than_capacity_is_dropped(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, async_writes=False, capacity_bytes=FILE - 1)
    tier.store([block(0)])
    assert tier.stats()["ssd_dropped_capacity"] == 1 and not files(tmp_path, ".kvb")
    h = tier.health()
    assert h["state"] == "no_space" and "byte limit" in h["ssd"]["no_space"]  # not a fault, but said


def test_free_space_floor_on_a_small_tmpfs(tmpfs, open_tier) -> None:
    fs = tmpfs("4m")
    floor = 1 << 20
    tier = open_tier(fs.path, spec=SPEC_BIG, async_writes=False, min_free_bytes=floor)
    assert tier.wait_scanned(30)
    blocks = chain(150, SPEC_BIG)  # 150 x 36 KiB = 5.3 MiB: more than the filesystem holds
    for i in range(0, 150, 10):
        tier.store(blocks[i:i + 10])  # never raises
        assert fs.statvfs_free() >= floor
    s = tier.stats()
    assert s["ssd_evicted_blocks"] > 0 and s["ssd_write_errors"] == 0
    assert not files(fs.path, ".tmp")
    newest = blocks[-5:]
    assert tier.lookup([b.key for b in newest]) == 5
    assert tier.load([load_request(b) for b in newest]).result(timeout=30) == 5

    # Someone else takes space: our least recently used blocks make room for the floor.
    before = tier.stats()["ssd_evicted_blocks"]
    with open(fs.path / "filler", "wb") as f:
        f.write(b"\0" * (fs.statvfs_free() - 256 * 1024))
    tier.store([block(500, SPEC_BIG)])
    assert tier.stats()["ssd_evicted_blocks"] > before
    assert fs.statvfs_free() >= floor and tier.lookup([block(500, SPEC_BIG).key]) == 1

    # A floor that eviction cannot reach: the write is dropped and counted, nothing raises.
    greedy = open_tier(fs.path, ns="greedy", spec=SPEC_BIG, async_writes=False, min_free_bytes=64 << 20)
    greedy.store([block(501, SPEC_BIG)])
    s = greedy.stats()
    assert s["ssd_dropped_no_space"] == 1 and s["ssd_stored_blocks"] == 0
    # A full disk is a capacity decision, not a fault; a floor that leaves no room is said.
    assert greedy.health()["state"] == "no_space" and greedy.health()["last_error"] is None
    assert not files(fs.path, ".tmp")


def test_ttl_prunes_on_the_timer(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, async_writes=False, ttl_s=0.5, prune_interval_s=0.05)
    blocks = chain(3)
    tier.store(blocks)
    paths = [tier.layout.block_path(b.key) for b in blocks]
    assert all(p.exists() for p in paths)
    # No further calls into the tier: only its timer can remove them.
    assert wait_until(lambda: not any(p.exists() for p in paths), timeout=60)
    s = tier.stats()
    assert s["ssd_ttl_pruned_blocks"] == 3 and s["ssd_blocks"] == 0


def test_ttl_applies_to_blocks_found_at_start_up(tmp_path, open_tier) -> None:
    old = open_tier(tmp_path, async_writes=False)
    blocks = chain(2)
    old.store(blocks)
    old.close(10)
    long_ago = 1_000_000_000 * 10**9
    for b in blocks[:1]:
        p = old.layout.block_path(b.key)
        os.utime(p, ns=(long_ago, long_ago))
    tier = open_tier(tmp_path, ttl_s=3600)
    assert tier.wait_scanned(30)
    assert on_disk(tier, blocks) == [0, 1]
    assert tier.stats()["ssd_ttl_pruned_blocks"] == 1


def test_eviction_racing_concurrent_reads(tmp_path, open_tier) -> None:
    """Readers look up and load random runs while a writer keeps the tier over
    its limit: a read that lookup reported present is never failed by eviction."""
    cap_blocks = 24
    tier = open_tier(tmp_path, async_writes=False, capacity_bytes=cap_blocks * FILE, io_threads=4)
    written: list[int] = list(range(cap_blocks))
    tier.store(chain(cap_blocks))
    lock = threading.Lock()
    failures: list[str] = []
    stop = threading.Event()

    def producer() -> None:
        i = cap_blocks
        while not stop.is_set() and i < 5000:
            tier.store([block(i)])
            with lock:
                written.append(i)
            i += 1

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            with lock:
                pool = written[-3 * cap_blocks:]
            first = rng.choice(pool)
            idx = [first + k for k in range(rng.randint(1, 6))]
            blocks = [block(i) for i in idx]
            n = tier.lookup([b.key for b in blocks])
            if n == 0:
                continue
            reqs = [load_request(b) for b in blocks[:n]]
            got = tier.load(reqs).result(timeout=60)
            if got != n:
                failures.append(f"lookup said {n}, load served {got} for {idx}")
            elif not all(bits_equal(r.dest, b.data) for r, b in zip(reqs, blocks, strict=False)):
                failures.append(f"wrong bytes for {idx}")

    prod = threading.Thread(target=producer)
    readers = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    prod.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    prod.join()
    assert not failures, failures[:5]
    s = tier.stats()
    assert s["ssd_evicted_blocks"] > 0, "the race was not exercised"
    assert s["ssd_corrupt_total"] == 0 and s["ssd_pinned_blocks"] == 0


def test_default_floor_is_relative_to_a_small_filesystem(tmpfs, open_tier) -> None:
    """Issue 14, F2: the default floor is min(1 GiB, 5 % of the filesystem). A fixed 1 GiB
    floor switched the tier off on any smaller filesystem while it said "ok"."""
    fs = tmpfs("4m")
    tier = open_tier(fs.path, spec=SPEC_BIG, async_writes=False, min_free_bytes=None)  # the default floor
    assert tier.wait_scanned(30)
    fs_bytes = os.statvfs(fs.path).f_blocks * os.statvfs(fs.path).f_frsize
    blocks = chain(150, SPEC_BIG)  # more than the filesystem holds
    for i in range(0, 150, 10):
        tier.store(blocks[i:i + 10])
        assert fs.statvfs_free() >= int(fs_bytes * 0.05)
    s = tier.stats()
    assert s["ssd_stored_blocks"] > 0 and s["ssd_evicted_blocks"] > 0 and s["ssd_write_errors"] == 0
    assert tier.lookup([b.key for b in blocks[-3:]]) == 3
    h = tier.health()
    assert h["state"] == "ok" and h["ssd"]["min_free_bytes"] == int(fs_bytes * 0.05)


def test_floor_larger_than_the_filesystem_is_reported(tmpfs, open_tier, caplog) -> None:
    """Issue 14, F2: a floor that leaves no room for a block is said at start-up and in
    health (state "no_space"), not silently obeyed under "ok"."""
    caplog.set_level(logging.WARNING, logger="kvcellar.storage.disk")
    fs = tmpfs("4m")
    tier = open_tier(fs.path, spec=SPEC_BIG, async_writes=False, min_free_bytes=1 << 30)
    warnings = [r.getMessage() for r in caplog.records if "will store nothing" in r.getMessage()]
    assert len(warnings) == 1 and "free-space floor (1.0 GiB" in warnings[0], warnings
    tier.store(chain(3, SPEC_BIG))
    assert tier.stats()["ssd_dropped_no_space"] == 3 and not files(fs.path, ".kvb")
    h = tier.health()
    assert h["state"] == "no_space" and h["last_error"] is None
    assert "floor" in h["ssd"]["no_space"] and h["ssd"]["min_free_bytes"] == 1 << 30
    assert "no_space" in TIER_STATES  # /metrics exports it as kvcellar_tier_state


def test_settings_default_to_the_relative_floor(monkeypatch) -> None:
    from kvcellar.settings import load_settings

    monkeypatch.delenv("KVCELLAR_CONFIG", raising=False)
    monkeypatch.delenv("KVCELLAR_DISK_MIN_FREE_GB", raising=False)
    assert DiskConfig().min_free_bytes is None
    assert load_settings(flags={"disk": {"disk_min_free_gb": 0.5}}).disk.min_free_bytes == 1 << 29


def test_a_block_evicted_takes_the_entry_of_its_key_beside_it(tmp_path, open_tier) -> None:
    """A hybrid model's snapshots are kept beside its blocks under the same keys: a block the
    byte limit evicts (a chain's tail first) takes the snapshot at its end with it; one
    whose block stays is kept."""
    blocks = open_tier(tmp_path, async_writes=False, capacity_bytes=4 * FILE)
    snapshots = open_tier(tmp_path, "ns.snapshots", SPEC_BIG, async_writes=False)
    blocks.drops_with_its_blocks(snapshots)
    assert blocks.wait_scanned(30) and snapshots.wait_scanned(30)
    a, b = chain(4, linked=True), chain(2, seed=1, linked=True)
    for x in a:
        blocks.store([x])
    kept = [block(i, SPEC_BIG, key=x.key) for i, x in enumerate(a)]
    snapshots.store([kept[1], kept[3]])  # after a's second block and after its last
    blocks.store(b)  # evicts a's last two blocks: the snapshot after a[3] goes, the one after a[1] stays
    assert on_disk(blocks, a) == [1, 1, 0, 0]
    assert on_disk(snapshots, kept) == [0, 1, 0, 0]
    assert snapshots.stats()["ssd_removed_blocks"] == 1
