"""The scheduler and the prefix cache on the fake model runner (tests/fake_runner.py):
batching, admission outcomes, preemption, copy-on-write, the tier link and prefetch, in
milliseconds. The real-model end-to-end cases stay in test_engine_correctness.py,
tests/cache and tests/integration."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcellar.cache.prefix_cache import Admission
from kvcellar.cache.tiering import LowerTierLink
from kvcellar.engine.sequence import SeqState, Sequence
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from tests.fake_runner import VOCAB, Driver, reference

BS = 4


def random_workload(rng: random.Random, n: int) -> list[tuple[list[int], int]]:
    """Prompts built from a few shared prefixes (some ending on a block boundary, some
    repeated whole) and random tails."""
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice([0, 3, 4, 8, 13, 16]))] for _ in range(4)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 4, 7]))]
        prompt = rng.choice(prefixes) + tail
        out.append((prompt or [1], rng.randint(1, 9)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_generate_what_the_uncached_model_does(seed: int) -> None:
    rng = random.Random(seed)
    work = random_workload(rng, 40)
    # a pool of 28 blocks forces evictions and preemptions; a small token budget chunks prefills
    driver = Driver(num_blocks=28, max_num_seqs=6, max_step_tokens=12)
    seqs = []
    for prompt, max_tokens in work:
        seqs.append(driver.submit(prompt, max_tokens))
        if rng.random() < 0.3:
            driver.step()  # arrivals between steps, joining running batches
    driver.run()
    assert [driver.done[s.seq_id] for s in seqs] == [reference(p, m) for p, m in work]
    assert driver.runner.wrong_kv == 0
    assert driver.bm.stats.lookup_hits > 0
    driver.assert_no_leaks()


def test_preemption_under_a_full_pool_resumes_exactly() -> None:
    driver = Driver(num_blocks=9, max_num_seqs=4, max_step_tokens=64)  # 8 usable blocks
    work = [([i + 1] * 6, 14) for i in range(4)]  # each grows to 5 blocks: they cannot all fit
    seqs = [driver.submit(p, m) for p, m in work]
    driver.run()
    assert driver.sched.stats.preemptions > 0
    assert [driver.done[s.seq_id] for s in seqs] == [reference(p, m) for p, m in work]
    # a resumption reuses the sequence's own blocks: not reported as a cache hit
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0, 0]
    assert driver.runner.wrong_kv == 0
    driver.assert_no_leaks()


def test_a_block_being_computed_is_waited_for_not_computed_twice() -> None:
    driver = Driver()
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    first, second = driver.submit(prompt, 2), driver.submit(prompt, 2)
    driver.step()
    assert first.state == SeqState.RUNNING and second.state == SeqState.WAITING
    assert driver.sched.cache.stats.deferred_for_shared_prefix == 1
    driver.run()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 12
    assert driver.done[second.seq_id] == driver.done[first.seq_id] == reference(prompt, 2)
    driver.assert_no_leaks()


def test_no_room_keeps_arrival_order_and_reserves_the_whole_prompt() -> None:
    driver = Driver(num_blocks=8, max_num_seqs=4)  # 7 usable blocks
    big = driver.submit(list(range(1, 22)), 3)  # 21 tokens + 3: 6 blocks
    driver.step()
    assert big.state == SeqState.RUNNING and len(big.blocks) == 6  # reserved up front
    small, later = driver.submit([5, 6], 3), driver.submit([7], 1)
    # one block is left, but the running decode keeps it in reserve: nothing is taken
    assert driver.cache.admit(small, reserve=1, crowded=True) is Admission.NO_ROOM
    assert small.blocks == [] and driver.bm.available() == 1
    driver.step()
    assert small.state == later.state == SeqState.WAITING  # the later one does not jump the queue
    driver.run()
    assert driver.done[small.seq_id] == reference([5, 6], 3) and driver.done[later.seq_id] == reference([7], 1)
    driver.assert_no_leaks()


def test_tenants_are_admitted_in_turn() -> None:
    """Two slots: alice's backlog fills them, in arrival order; when one frees, bob's request
    (sent after all of hers) is admitted before her third. With both waiting from the start,
    a slot goes to each."""
    driver = Driver(num_blocks=64, max_num_seqs=2)
    alice = [driver.submit([i + 1] * 3, 2 + 4 * i, tenant="alice") for i in range(4)]
    driver.step()
    assert [s.state for s in alice] == [SeqState.RUNNING] * 2 + [SeqState.WAITING] * 2
    bob = driver.submit([9, 9], 2, tenant="bob")
    while alice[0].seq_id not in driver.done:
        driver.step()
    driver.step()
    assert bob.state != SeqState.WAITING and alice[2].state == SeqState.WAITING
    driver.run()
    assert [driver.done[s.seq_id] for s in alice] == [reference([i + 1] * 3, 2 + 4 * i) for i in range(4)]
    assert driver.done[bob.seq_id] == reference([9, 9], 2)
    driver.assert_no_leaks()

    both = [driver.submit([5] * 3, 3, tenant="alice") for _ in range(3)] + [driver.submit([6], 3, tenant="bob")]
    driver.step()
    assert [s.state for s in both] == [SeqState.RUNNING, SeqState.WAITING, SeqState.WAITING, SeqState.RUNNING]
    driver.run()
    driver.assert_no_leaks()


def test_a_full_pool_preempts_the_tenant_holding_the_most() -> None:
    """Alice's two growing sequences and bob's small one, admitted last, fill the pool: room is
    taken from alice's, not from bob's (the most recently admitted), and all finish exactly."""
    driver = Driver(num_blocks=9, max_num_seqs=4, max_step_tokens=64)  # 8 usable blocks
    preempted: list[str | None] = []
    preempt = driver.sched._preempt

    def recorded(seq: Sequence) -> None:
        preempted.append(seq.tenant)
        preempt(seq)

    driver.sched._preempt = recorded  # type: ignore[method-assign]
    alice = [driver.submit([i + 1] * 6, 14, tenant="alice") for i in range(2)]  # 5 blocks each in the end
    driver.step()
    bob = driver.submit([3, 3], 14, tenant="bob")  # 4 blocks in the end
    driver.run()
    assert preempted and set(preempted) == {"alice"}
    assert [driver.done[s.seq_id] for s in alice] == [reference([i + 1] * 6, 14) for i in range(2)]
    assert driver.done[bob.seq_id] == reference([3, 3], 14)
    driver.assert_no_leaks()


def test_a_short_prompt_behind_a_long_prefill_starts_at_once() -> None:
    """A 6-token prompt sent while a 200-token prompt is in prefill (32 tokens a step) gets its
    first token in the next step, which keeps the long prefill going with the rest; a third
    prompt, shorter than the long one's rest, is then computed first (fewest tokens left
    first). Every output is the reference model's."""
    driver = Driver(max_step_tokens=32, num_blocks=128)  # room for all three prompts
    long = driver.submit([i % 50 + 1 for i in range(200)], 3)
    driver.step()
    assert long.num_computed == 32
    short = driver.submit([7, 8, 9, 7, 8, 9], 3)
    driver.step()
    assert len(short.output_ids) == 1 and long.num_computed == 32 + 26 and long.in_prefill
    medium = driver.submit([5] * 60, 2)
    driver.step()  # the short one decodes; the medium one is admitted with half the rest
    assert medium.num_computed == 15 and long.num_computed == 58 + 16
    driver.step()  # the medium one has fewer tokens left: it goes first, with all the budget left
    assert medium.num_computed == 15 + 31 and long.num_computed == 74
    driver.run()
    for seq, (prompt, n) in ((long, ([i % 50 + 1 for i in range(200)], 3)), (short, ([7, 8, 9, 7, 8, 9], 3)),
                             (medium, ([5] * 60, 2))):
        assert driver.done[seq.seq_id] == reference(prompt, n)
    driver.assert_no_leaks()

    # No room for the waiting prompt (63 usable blocks, the long one holds 51): the long prefill
    # gets back the half kept for it.
    tight = Driver(max_step_tokens=32)
    again = tight.submit([i % 50 + 1 for i in range(200)], 3)
    tight.step()
    waiting = tight.submit([6] * 60, 2)
    tight.step()
    assert waiting.state == SeqState.WAITING and again.num_computed == 64
    tight.run()
    assert tight.done[waiting.seq_id] == reference([6] * 60, 2)
    tight.assert_no_leaks()


def test_a_fully_cached_prompt_on_a_block_boundary_recomputes_one_token_in_a_copy() -> None:
    driver = Driver()
    prompt = list(range(10, 18))  # exactly 2 blocks
    a = driver.submit(prompt, 3)
    driver.run()
    shared = driver.bm.match(a.digests(2, BS), [prompt[:4], prompt[4:]])
    before = [driver.pool.block(b.block_id).clone() for b in shared]
    b = driver.submit(prompt, 3)
    driver.step()
    assert b.num_computed == len(prompt)  # 7 reused + the last one recomputed
    assert b.blocks[1] not in shared  # the last block is a private copy
    assert all(driver.pool.block(x.block_id).equal(y) for x, y in zip(shared, before, strict=True))
    driver.run()
    assert b.num_cached_tokens == 7 and driver.done[b.seq_id] == reference(prompt, 3)
    driver.assert_no_leaks()


def test_cache_salt_and_disabled_caching_reuse_nothing() -> None:
    prompt = list(range(1, 18))
    salted = Driver()
    salted.submit(prompt, 2, salt="a")
    salted.run()
    other = salted.submit(prompt, 2, salt="b")
    salted.run()
    assert other.num_cached_tokens == 0
    off = Driver(prefix_caching=False)
    off.submit(prompt, 2)
    off.run()
    again = off.submit(prompt, 2)
    off.run()
    assert again.num_cached_tokens == 0 and off.bm.stats.registered == 0
    assert off.done[again.seq_id] == reference(prompt, 2)


def test_cancel_frees_blocks_and_leaves_published_ones_cached() -> None:
    driver = Driver(max_step_tokens=8)
    prompt = list(range(1, 30))
    seq = driver.submit(prompt, 50)
    for _ in range(3):
        driver.step()  # 24 prompt tokens computed: 6 blocks published
    assert seq.num_registered == 6
    driver.cancel(seq)
    assert seq.state == SeqState.FINISHED and seq.blocks == []
    driver.assert_no_leaks()
    assert driver.bm.num_evictable == 6
    again = driver.submit(prompt, 2)
    driver.run()
    assert again.num_cached_tokens == 24 and driver.done[again.seq_id] == reference(prompt, 2)


# ---- with a real SSD tier below RAM ----------------------------------------------------------


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Callable[..., DiskTier]]:
    """``disk(driver, **config)``: a real SSD tier under ``driver``'s RAM tier."""
    tiers: list[DiskTier] = []

    def make(driver: Driver, **cfg: object) -> DiskTier:
        spec = LowerTierLink.block_spec(driver.pool)
        tier = DiskTier(tmp_path / "kv", "fake", spec, DiskConfig(min_free_bytes=0, **cfg))  # type: ignore[arg-type]
        tiers.append(tier)
        assert tier.wait_scanned(10)
        driver.attach(tier)
        return tier

    yield make
    for t in tiers:
        t.close(10)


def test_blocks_evicted_from_ram_come_back_from_the_disk(disk: Callable[..., DiskTier]) -> None:
    driver = Driver(num_blocks=40)
    tier = disk(driver, async_writes=False)
    work = random_workload(random.Random(11), 12)
    driver_seqs = [driver.submit(p, m) for p, m in work]
    driver.run()
    assert tier.wait_idle(10)
    driver.bm.evict_all()
    again = [driver.submit(p, m) for p, m in work]
    driver.run()
    expected = [reference(p, m) for p, m in work]
    assert [driver.done[s.seq_id] for s in driver_seqs] == expected
    assert [driver.done[s.seq_id] for s in again] == expected
    from_disk = sum(s.cached_tokens_by_tier.get("ssd", 0) for s in again)
    assert from_disk > 0
    assert driver.lower.tiers[0].stats.loaded_blocks > 0
    assert driver.runner.wrong_kv == 0
    driver.assert_no_leaks()


def test_a_waiting_request_prefetches_its_disk_blocks(disk: Callable[..., DiskTier]) -> None:
    driver = Driver(num_blocks=64, max_num_seqs=1)
    disk(driver, async_writes=False)
    prompt = list(range(3, 40))  # 9 full blocks
    driver.submit(prompt, 1)
    driver.run()
    driver.bm.evict_all()
    driver.submit([1, 2, 3], 30)  # holds the only sequence slot for 30 steps
    driver.step()
    waiting = driver.submit(prompt, 2)
    driver.step()
    assert waiting.state == SeqState.WAITING and len(driver.cache.prefetch.reads) == 1
    driver.run()
    assert driver.sched.cache.prefetch.stats.prefetch_reads == 1
    assert driver.sched.cache.prefetch.stats.prefetched_blocks == 9
    assert driver.sched.stats.admitted == 3 and driver.cache.loading == []
    # found in RAM at admission, credited to the tier that served it
    assert waiting.cached_tokens_by_tier == {"ram": 0, "ssd": 36}
    assert driver.done[waiting.seq_id] == reference(prompt, 2)
    driver.assert_no_leaks()


def test_a_tier_that_would_drop_a_block_is_asked_before_it_is_copied(disk: Callable[..., DiskTier]) -> None:
    """Item 6 of issue 14: a tier with no room (byte limit below one block) declines in
    ``wants``; the link then makes no copy off the pool, and the tier drops nothing."""
    driver = Driver()
    tier = disk(driver, async_writes=False, capacity_bytes=1)
    assert tier.health()["state"] == "no_space"
    prompt = list(range(1, 30))
    driver.submit(prompt, 3)
    driver.run()
    (attached,) = driver.lower.tiers
    assert attached.stats.declined_blocks == len(prompt) // BS and attached.stats.stored_blocks == 0
    assert tier.stats()["ssd_dropped_no_space"] == 0 and tier.stats()["ssd_stored_blocks"] == 0
    driver.assert_no_leaks()
