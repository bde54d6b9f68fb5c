"""The tier contract enforced at the link (storage/guard.py, issue 24): whatever a tier verb
does wrong, an exception of any type or a call slower than the tier's timeout, every request
is answered with the output of an uncached run, no block leaks, the tier turns degraded and
comes back once the fault is lifted. The tier is the real SSD tier; the fault is a test
subclass overriding the one verb under test."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvcellar.cache.tiering import LowerTierLink
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from kvcellar.storage.guard import GuardedTier
from tests.fake_runner import VOCAB, Driver, reference
from tests.helpers import wait_until
from tests.storage.helpers import SPEC, chain, load_request

LINK_VERBS = ("lookup", "load", "store", "wants", "touch")
MODES = ("raises", "hangs")
HANG_S = 0.5  # how long a hanging verb takes: past the 0.25 s the test tier allows
BACKOFF = (0.05, 0.2)


class OddError(Exception):
    """Not an OSError, not a RedisError: a type no tier expects."""


class FaultyDisk(DiskTier):
    """The real SSD tier, whose verb ``fault_verb`` raises or hangs while ``armed``."""

    call_timeout_s = 0.25
    load_timeout_s = 0.25
    fault_verb = ""
    fault_mode = "raises"
    armed = False
    calls = 0
    unstall = threading.Event()

    def _fault(self, verb: str) -> None:
        if self.armed and verb == self.fault_verb:
            self.calls += 1
            if self.fault_mode == "raises":
                raise OddError(f"{verb} broke")
            time.sleep(HANG_S)  # the fault itself: a verb stuck past its timeout

    def lookup(self, keys: Sequence[bytes]) -> int:
        self._fault("lookup")
        return super().lookup(keys)

    def load(self, requests: Any) -> Any:
        if self.armed and self.fault_verb == "load" and self.fault_mode == "stalls":
            self.calls += 1
            return self._stalled(requests)
        self._fault("load")
        return super().load(requests)

    def _stalled(self, requests: Any) -> concurrent.futures.Future[int]:
        """A read that resolves only once ``unstall`` is set, then writes into its blocks."""
        out: concurrent.futures.Future[int] = concurrent.futures.Future()

        def later() -> None:
            self.unstall.wait()
            out.set_result(DiskTier.load(self, requests).result())

        threading.Thread(target=later, daemon=True).start()
        return out

    def store(self, requests: Any) -> None:
        self._fault("store")
        super().store(requests)

    def wants(self, key: bytes, wait_s: float = 0.0) -> bool:
        self._fault("wants")
        return super().wants(key, wait_s)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._fault("touch")
        super().touch(keys)

    def pin(self, keys: Sequence[bytes]) -> None:
        self._fault("pin")
        super().pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._fault("unpin")
        super().unpin(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        self._fault("remove")
        return super().remove(keys)


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[Callable[[Driver], FaultyDisk]]:
    tiers: list[FaultyDisk] = []

    def make(driver: Driver) -> FaultyDisk:
        spec = LowerTierLink.block_spec(driver.pool)
        tier = FaultyDisk(tmp_path / "kv", "fake", spec, DiskConfig(min_free_bytes=0))
        tiers.append(tier)
        assert tier.wait_scanned(10)
        driver.attach(tier)
        return tier

    yield make
    for t in tiers:
        t.armed = False
        t.close(10)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(9, 30))] for _ in range(n)]


def fill_disk(faulty: Callable[[Driver], FaultyDisk], work: list[list[int]]) -> None:
    first = Driver(num_blocks=64)
    tier = faulty(first)
    run_all(first, work)
    assert tier.wait_idle(10) and tier.close(10)


def run_all(driver: Driver, work: list[list[int]]) -> None:
    seqs = [driver.submit(p, 3) for p in work]
    driver.run()
    assert [driver.done[s.seq_id] for s in seqs] == [reference(p, 3) for p in work]
    assert driver.runner.wrong_kv == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("verb", LINK_VERBS)
def test_a_faulty_verb_costs_the_tier_not_the_requests(faulty, verb: str, mode: str) -> None:
    on_disk = prompts(1, 6)
    fill_disk(faulty, on_disk)

    driver = Driver(num_blocks=64, guard_backoff_s=BACKOFF)  # a restart: RAM empty, the disk full
    tier = faulty(driver)
    tier.fault_verb, tier.fault_mode, tier.armed = verb, mode, True
    run_all(driver, on_disk + prompts(3, 4))  # lookups, loads, stores, wants of new blocks
    run_all(driver, on_disk[:3])  # RAM hits: touch
    assert tier.calls >= 1, f"{verb} was never called"
    health = driver.lower.health()["ssd"]
    assert health["state"] == "degraded"
    assert ("OddError" if mode == "raises" else "TierTimeout") in str(health["last_error"])
    stats = driver.lower.stats_by_tier()["ssd"]
    assert stats["ssd_guard_call_errors"] >= 1
    if mode == "hangs":
        assert stats["ssd_guard_slow_calls"] >= 1
    driver.assert_no_leaks()

    tier.armed = False
    fresh = iter(range(100, 10_000))

    def recovered() -> bool:  # every verb called again: a verb's fault ends with its next call that succeeds
        driver.bm.evict_all()
        run_all(driver, on_disk + prompts(next(fresh), 1))
        run_all(driver, on_disk[:1])
        return driver.lower.health()["ssd"]["state"] == "ok"

    wait_until(recovered, timeout=30, what="the tier to come back after the fault was lifted")
    driver.bm.evict_all()
    again = [driver.submit(p, 3) for p in on_disk]
    driver.run()
    assert [driver.done[s.seq_id] for s in again] == [reference(p, 3) for p in on_disk]
    assert sum(s.cached_tokens_by_tier.get("ssd", 0) for s in again) > 0  # served by the tier again
    driver.assert_no_leaks()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("verb", ("pin", "unpin", "remove", "lookup", "wants", "touch", "store", "load"))
def test_every_verb_of_a_guarded_tier_answers_safely(tmp_path: Path, verb: str, mode: str) -> None:
    blocks = chain(3)
    spec_tier = FaultyDisk(tmp_path / "kv", "ns", SPEC, DiskConfig(min_free_bytes=0))
    try:
        assert spec_tier.wait_scanned(10)
        guard = GuardedTier(spec_tier, backoff_initial_s=1.0, backoff_max_s=1.0)
        guard.store(blocks)
        assert guard.wait_idle(10) and guard.lookup([b.key for b in blocks]) == 3
        spec_tier.fault_verb, spec_tier.fault_mode, spec_tier.armed = verb, mode, True
        keys = [b.key for b in blocks]
        answers = {
            "lookup": lambda: guard.lookup(keys),
            "load": lambda: guard.load([load_request(b) for b in blocks]).result(10),
            "store": lambda: guard.store(chain(1, seed=5)),
            "wants": lambda: guard.wants(chain(1, seed=6)[0].key),
            "touch": lambda: guard.touch(keys),
            "pin": lambda: guard.pin(keys),
            "unpin": lambda: guard.unpin(keys),
            "remove": lambda: guard.remove(keys[2:]),
        }
        got = answers[verb]()
        if mode == "raises":
            assert got == {"lookup": 0, "load": 0, "wants": False, "remove": 0}.get(verb)
        assert guard.degraded and guard.health()["state"] == "degraded"
        assert guard.stats()["ssd_guard_call_errors"] == 1
        calls = spec_tier.calls
        answers[verb]()  # backing off: the tier is not called
        assert spec_tier.calls == calls and guard.stats()["ssd_guard_skipped_calls"] >= 1
        spec_tier.armed = False
        wait_until(lambda: (answers[verb](), not guard.degraded)[1], timeout=10, what="the guard's probe to succeed")
        assert guard.health()["state"] == "ok"
    finally:
        spec_tier.armed = False
        spec_tier.close(10)


def test_a_slow_load_within_the_time_its_bytes_allow_is_waited_for(faulty) -> None:
    """A load's time limit grows with its bytes (``load_bytes_per_s``): a read slower than
    ``load_timeout_s`` alone allows, but within what its bytes add, is no fault; its blocks
    serve the requests."""
    on_disk = prompts(1, 6)
    fill_disk(faulty, on_disk)
    driver = Driver(num_blocks=64, guard_backoff_s=BACKOFF)
    tier = faulty(driver)
    tier.load_bytes_per_s = tier.spec.nbytes / 10.0  # ten seconds a block on top of the 0.25 s
    assert tier.load_timeout_for(2 * tier.spec.nbytes) == pytest.approx(tier.load_timeout_s + 20.0)
    tier.fault_verb, tier.fault_mode, tier.armed = "load", "hangs", True  # each load takes HANG_S > 0.25 s
    seqs = [driver.submit(p, 3) for p in on_disk]
    driver.run()
    assert [driver.done[s.seq_id] for s in seqs] == [reference(p, 3) for p in on_disk]
    assert tier.calls >= 1
    assert sum(s.cached_tokens_by_tier.get("ssd", 0) for s in seqs) > 0  # served by the slow loads
    stats = driver.lower.stats_by_tier()["ssd"]
    assert stats["ssd_guard_slow_calls"] == 0 and stats["ssd_guard_call_errors"] == 0
    assert driver.lower.health()["ssd"]["state"] == "ok"
    driver.assert_no_leaks()


def test_a_load_that_never_finishes_is_given_up_and_its_blocks_wait_for_it(faulty) -> None:
    """A read past the tier's load timeout: the requests are computed instead, the tier stops
    being asked, and the blocks the read writes into stay held until it ends, so its late
    writes land in no block anyone uses."""
    on_disk = prompts(1, 6)
    fill_disk(faulty, on_disk)
    driver = Driver(num_blocks=64, guard_backoff_s=(30.0, 30.0))
    tier = faulty(driver)
    tier.unstall = threading.Event()
    tier.fault_verb, tier.fault_mode, tier.armed = "load", "stalls", True
    run_all(driver, on_disk)  # answered, from compute
    assert tier.calls >= 1
    health = driver.lower.health()["ssd"]
    assert health["state"] == "degraded" and "load still running" in str(health["last_error"])
    assert driver.lower.stats_by_tier()["ssd"]["ssd_guard_slow_calls"] >= 1
    assert driver.bm.num_used > 0  # held for the reads still running
    run_all(driver, prompts(4, 3))  # the tier is not asked again while it backs off
    calls = tier.calls
    driver.bm.evict_all()
    run_all(driver, on_disk)
    assert tier.calls == calls
    tier.unstall.set()  # the reads end now, writing into their (held) blocks

    def freed() -> bool:
        driver.step()
        return driver.bm.num_used == 0

    wait_until(freed, timeout=30, what="the blocks of the given-up reads to be freed")
    run_all(driver, on_disk + prompts(5, 3))
    driver.assert_no_leaks()
