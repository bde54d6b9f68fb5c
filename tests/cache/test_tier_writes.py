"""Writes from RAM to a real SSD tier through the link, when the writer is behind: what a
queued write holds, what a full queue costs, and what eviction waits for.

The real scheduler, block manager, pool and link (tests/fake_runner.py) over the real
``DiskTier``; the slow disk is a test subclass that holds its writer thread before each
block until the test (or someone waiting for room in its queue) lets it go, so overload
happens on demand and nothing depends on the clock."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest

from kvcellar.cache.hashing import block_digests, root_digest
from kvcellar.cache.tiering import LowerTierLink
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from kvcellar.storage.guard import GuardedTier
from tests.fake_runner import VOCAB, Driver, reference
from tests.storage.helpers import SPEC, chain

HOLD_S = 60.0  # a held writer waits at most this long: only a broken test gets there


class HeldDisk(DiskTier):
    """The real SSD tier whose writer holds each block, before writing it, until
    ``let_go`` (or the tier closes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.free = threading.Event()
        self.holding = threading.Event()
        super().__init__(*args, **kwargs)

    def let_go(self) -> None:
        self.free.set()

    def _defer_to_reads(self, max_s: float) -> bool:
        self.holding.set()
        self.free.wait(HOLD_S)
        return super()._defer_to_reads(max_s)

    def close(self, timeout: float = 10.0) -> bool:
        self.free.set()
        return super().close(timeout)


class BehindDisk(DiskTier):
    """The real SSD tier whose writer writes only while someone waits for room in its queue
    (``wants`` with a wait) or the tier closes: a disk slower than any KV production, but
    never the reason a waiter times out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cond = threading.Condition()
        self.waiters = 0
        self.released = False
        super().__init__(*args, **kwargs)

    def wants(self, key: bytes, wait_s: float = 0.0) -> bool:
        if wait_s <= 0:
            return super().wants(key, wait_s)
        with self.cond:
            self.waiters += 1
            self.cond.notify_all()
        try:
            return super().wants(key, wait_s)
        finally:
            with self.cond:
                self.waiters -= 1

    def _defer_to_reads(self, max_s: float) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.waiters > 0 or self.released, HOLD_S)
        return super()._defer_to_reads(max_s)

    def close(self, timeout: float = 10.0) -> bool:
        with self.cond:
            self.released = True
            self.cond.notify_all()
        return super().close(timeout)


def attach(driver: Driver, cls: type[DiskTier], root: Path, policy: str = "write_through", **config: Any) -> Any:
    tier = cls(root / "kv", "fake", LowerTierLink.block_spec(driver.pool), DiskConfig(min_free_bytes=0, **config))
    assert tier.wait_scanned(30)
    driver.attach(tier, policy)
    return tier


def run(driver: Driver, work: list[list[int]], max_tokens: int = 2) -> None:
    seqs = [driver.submit(p, max_tokens) for p in work]
    driver.run()
    assert [driver.done[s.seq_id] for s in seqs] == [reference(p, max_tokens) for p in work]
    assert driver.runner.wrong_kv == 0


def prompts(seed: int, n: int, tokens: tuple[int, int] = (16, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(*tokens))] for _ in range(n)]


def test_a_pool_block_reused_while_its_write_is_queued_is_written_with_its_old_content(tmp_path) -> None:
    """The link hands the tier a copy: a block RAM evicts and reuses for another prompt
    while its write waits in the queue is still written with the KV it had when stored.
    Read back later, the first prompt's blocks give its own output."""
    driver = Driver(num_blocks=8, block_size=4)  # 7 blocks: the second prompt must reuse the first's
    tier = attach(driver, HeldDisk, tmp_path, evict_wait_s=0.0)
    first, second = prompts(1, 1, (24, 25))[0], prompts(2, 1, (24, 25))[0]
    run(driver, [first])
    assert tier.holding.wait(30)  # the writer holds one block, the others are queued
    queued = tier.stats()["writer_enqueued"]
    assert queued == 6  # 26 tokens: six full blocks
    run(driver, [second])  # evicts the first prompt's blocks and writes over them
    assert driver.bm.stats.evictions >= 6
    # the second prompt's own blocks; the first's, evicted while queued, were not copied again
    assert tier.stats()["writer_enqueued"] == 2 * queued
    tier.let_go()
    assert tier.wait_idle(30)
    driver.bm.evict_all()  # RAM empty: the first prompt comes from the SSD
    again = driver.submit(first, 2)
    driver.run()
    assert driver.done[again.seq_id] == reference(first, 2)
    assert driver.runner.wrong_kv == 0
    assert again.cached_tokens_by_tier.get("ssd", 0) == 23  # all but the last prompt token


def test_no_block_is_lost_to_a_full_queue_or_copied_for_nothing(tmp_path) -> None:
    """Sustained overload: the writer is always behind, so the queue is full whenever a new
    block is published. Such a block is declined before it is copied (it is still in RAM);
    when RAM evicts it, the link waits for room in the queue, so every block computed ends
    up on the SSD, and every copy made off the pool is written."""
    driver = Driver(num_blocks=24, block_size=4)
    tier = attach(driver, BehindDisk, tmp_path, queue_blocks=4, evict_wait_s=HOLD_S)
    run(driver, prompts(3, 30))
    s = driver.lower.stats_by_tier()["ssd"]
    assert s["writer_dropped_queue_full"] > 0 and driver.bm.stats.evictions > 0  # overload, and RAM evicted
    assert s["ssd_link_stored_blocks"] == s["writer_enqueued"]  # no copy was made to be dropped
    assert driver.lower.close(60, driver.bm.cached_blocks())
    computed = driver.bm.stats.registered
    assert tier.stats()["ssd_stored_blocks"] == computed
    assert len(list((tmp_path / "kv").rglob("*.kvb"))) == computed


def test_without_an_eviction_wait_the_same_overload_loses_blocks(tmp_path) -> None:
    """``ssd_evict_wait_s = 0``: a block RAM evicts while the queue is full misses the SSD
    for good (counted as dropped). The contrast that shows the wait is what keeps them."""
    driver = Driver(num_blocks=24, block_size=4)
    tier = attach(driver, BehindDisk, tmp_path, queue_blocks=4, evict_wait_s=0.0)
    run(driver, prompts(3, 30))
    assert driver.lower.close(60, driver.bm.cached_blocks())
    assert tier.stats()["ssd_stored_blocks"] < driver.bm.stats.registered


def test_a_wants_that_waits_for_room_is_no_slow_call(tmp_path) -> None:
    """The guard allows ``wants`` the wait it asked for on top of the tier's call timeout:
    waiting for room in a full queue is no fault of the tier."""
    tier = HeldDisk(tmp_path / "kv", "ns", SPEC, DiskConfig(min_free_bytes=0, queue_blocks=1))
    tier.call_timeout_s = 1.0
    try:
        assert tier.wait_scanned(30)
        guard = GuardedTier(tier)
        guard.store(chain(1))
        assert tier.holding.wait(30)
        guard.store(chain(1, start=1))  # the queue is full now
        assert not guard.wants(chain(1, start=2)[0].key, 1.5)  # nothing frees room: refused after the wait
        assert guard.stats()["ssd_guard_slow_calls"] == 0 and not guard.degraded
        assert tier.stats()["writer_dropped_queue_full"] == 1
    finally:
        tier.close(10)


@pytest.mark.parametrize("policy", ["evict_only", "write_through"])
def test_blocks_ram_evicts_wait_for_room_and_are_written(tmp_path, policy: str) -> None:
    """Evictions against a queue that is full until the writer moves: the link's ``wants``
    waits, the writer frees a slot, the evicted block is queued and written, without the
    shutdown offering anything again (``close`` gets no RAM blocks)."""
    driver = Driver(num_blocks=8, block_size=4)
    tier = attach(driver, BehindDisk, tmp_path, policy, queue_blocks=2, evict_wait_s=HOLD_S)
    first = prompts(5, 1, (24, 25))[0]
    run(driver, [first])
    run(driver, prompts(6, 1, (24, 25)))  # evicts the first prompt's six blocks
    assert driver.bm.stats.evictions >= 6
    assert driver.lower.close(60)
    keys = [driver.lower.key_of(d) for d in block_digests(root_digest("fake"), first, 4)]
    assert [tier.layout.block_path(k).exists() for k in keys] == [True] * 6
