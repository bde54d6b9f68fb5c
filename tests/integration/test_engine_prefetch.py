"""Prefetch over the real SSD tier, in process: a queued request's disk hit is read while
it waits for a sequence slot, published into RAM, and admitted as a RAM hit that still
counts for the SSD; a read in flight when its sequence is admitted or cancelled; a block
that fails to load; a prefix longer than the prefetch cap.

The engine is driven by hand (``step``) with ``max_num_seqs=1`` and a long request in the
only slot, so "while it waits" is a fact of the schedule, not of timing. Every output is
compared with a cache-disabled run of the same prompt, on the stand-in model (a small
random-weight Llama with the real tokenizer: what is read, when, is the same for any model)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvcellar.cache.hashing import block_digests, root_digest
from kvcellar.engine import SamplingParams, observability
from kvcellar.engine.sequence import SeqState
from kvcellar.storage.base import KVTier, LoadRequest
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier
from tests._models import (
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    expected_cached,
    make_engine,
    stand_in,
    uncached_runner,
)
from tests.helpers import wait_until

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)
BUSY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # holds the only slot
SYSTEM = ("You review pull requests for a payments company. Flag anything that touches money movement, "
          "idempotency keys, retries or currency rounding, and say why in one line each. " * 3)


@pytest.fixture(scope="module")
def model():
    return stand_in()


@pytest.fixture(scope="module")
def uncached_busy(model):
    return uncached_runner(model, BUSY)


class GatedTier(KVTier):
    """A real tier whose loads do not report completion until ``open()``: the reads
    themselves happen, only their futures are held back, so a test decides when a read
    is "still in flight"."""

    def __init__(self, inner: KVTier) -> None:
        self.inner = inner
        self.name = inner.name
        self.gauges = inner.gauges
        self._held: list[tuple[concurrent.futures.Future[int], concurrent.futures.Future[int]]] = []
        self._open = False

    def open(self) -> None:
        self._open = True
        held, self._held = self._held, []
        for inner, outer in held:
            outer.set_result(inner.result(timeout=60))

    def load(self, requests: Sequence[LoadRequest]) -> concurrent.futures.Future[int]:
        inner = self.inner.load(requests)
        if self._open:
            return inner
        outer: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._held.append((inner, outer))
        return outer

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.inner.lookup(keys)

    def store(self, requests: Sequence[Any]) -> None:
        self.inner.store(requests)

    def wants(self, key: bytes, wait_s: float = 0.0) -> bool:
        return self.inner.wants(key, wait_s)

    def remove(self, keys: Sequence[bytes]) -> int:
        return self.inner.remove(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.inner.touch(keys)

    def wait_idle(self, timeout: float) -> bool:
        return self.inner.wait_idle(timeout)

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def health(self) -> dict[str, object]:
        return self.inner.health()

    def close(self, timeout: float) -> bool:
        self.open()
        return self.inner.close(timeout)


def disk(engine, root: Path) -> DiskTier:
    return DiskTier(root, engine.fingerprint, engine.block_spec, DiskConfig(min_free_bytes=0),
                    descriptor=engine.descriptor)


def tiered(model, root: Path, *, gated: bool = False, **kw):
    engine = make_engine(model, **kw)
    tier = disk(engine, root)
    engine.attach_tier(GatedTier(tier) if gated else tier)
    return engine


def ask(model, question: str) -> list[int]:
    return chat_ids(model, question, SYSTEM)


def on_disk(model, root: Path, prompt: list[int]) -> None:
    """Compute ``prompt`` once with the SSD tier at ``root`` and shut down: its blocks are
    then on disk only."""
    writer = tiered(model, root)
    writer.generate([prompt], GREEDY)
    assert writer.shutdown(30)


def busy_prompt(model) -> list[int]:
    """A long request sharing no block with the prompts under test (no system prompt)."""
    return chat_ids(model, "Write a long list of review rules.")


def queue_behind_busy(model, engine):
    """A long request takes the only slot and starts decoding; returns its handle."""
    busy = engine.submit(busy_prompt(model), BUSY)
    engine.step()
    assert len(engine.scheduler.running) == 1
    return busy


def submit_behind_busy(model, engine, prompt: list[int]):
    """A long request takes the only slot, then ``prompt`` is submitted and waits a step
    (its prefetch read, if any, starts). Returns (busy, handle)."""
    busy = queue_behind_busy(model, engine)
    handle = engine.submit(prompt, GREEDY)
    engine.step()
    return busy, handle


def only_seq(engine, handle):
    return engine._seqs[handle.seq_id]


def test_queued_disk_hit_is_loaded_while_waiting(model, uncached, uncached_busy, tmp_path):
    prompt = ask(model, "Review: retry the charge call up to 3 times on timeout.")
    on_disk(model, tmp_path, prompt)
    engine = tiered(model, tmp_path, max_num_seqs=1)
    busy, handle = submit_behind_busy(model, engine, prompt)  # the request waits, and its read starts
    seq = only_seq(engine, handle)
    assert seq.state == SeqState.WAITING
    stats = engine.scheduler.cache.prefetch.stats
    assert stats.prefetch_reads == 1
    (read,) = engine.scheduler.cache.prefetch.reads
    wanted = expected_cached(len(prompt), len(prompt)) // BS  # whole blocks on disk
    assert len(read.blocks) == len(prompt) // BS >= wanted
    assert observability.snapshot(engine)["engine_prefetching"] == 1
    wait_until(lambda: all(f.done() for f in read.pending.futures), what="the disk read")
    engine.step()  # publishes the blocks; the busy request still holds the slot
    assert seq.state == SeqState.WAITING and len(engine.scheduler.running) == 1
    assert stats.prefetched_blocks == len(prompt) // BS
    assert not engine.scheduler.cache.prefetch.reads
    assert engine.blocks.match(seq.digests(len(prompt) // BS, BS),
                               [seq.block_tokens(i, BS) for i in range(len(prompt) // BS)])

    engine.run_until_idle()
    result, busy_result = engine.collect(handle), engine.collect(busy)
    assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    # a RAM hit on prefetched blocks counts for the tier that served them
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": result.num_cached_tokens}
    snap = observability.snapshot(engine)
    assert snap["sched_lower_tier_hit_tokens"] == result.num_cached_tokens
    assert snap["kv_lookup_hits"] == 0
    assert snap["ssd_load_calls"] == 1 and snap["ssd_load_hits"] == len(prompt) // BS  # read once
    assert snap["sched_deferred_for_prefetch"] == 0
    assert_same_output(result, uncached(prompt))
    assert busy_result.token_ids == uncached_busy(busy_prompt(model)).token_ids
    assert_no_leaks(engine)
    engine.shutdown(30)


def test_sequence_admitted_while_its_read_is_in_flight_waits_for_it(model, uncached, tmp_path):
    prompt = ask(model, "Review: store idempotency keys for 24 hours.")
    on_disk(model, tmp_path, prompt)
    engine = tiered(model, tmp_path, gated=True, max_num_seqs=1)
    gate = engine.lower.tiers[0].tier
    busy, handle = submit_behind_busy(model, engine, prompt)
    (read,) = engine.scheduler.cache.prefetch.reads
    while engine.scheduler.running:  # the busy request ends; the read is still in flight
        engine.step()
    assert engine.collect(busy).finish_reason == "length"
    engine.step()  # a free slot, but the read of its prefix is not over: it waits for it
    seq = only_seq(engine, handle)
    assert seq.state == SeqState.WAITING and not engine.scheduler.loading
    assert engine.scheduler.cache.stats.deferred_for_prefetch >= 1
    assert engine.scheduler.cache.prefetch.reads == [read]
    assert observability.snapshot(engine)["ssd_load_calls"] <= 1

    gate.open()
    engine.run_until_idle()
    result = engine.collect(handle)
    assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": result.num_cached_tokens}
    snap = observability.snapshot(engine)
    assert snap["ssd_load_calls"] == 1  # no second read of the same keys
    assert snap["sched_prefetch_reads"] == 1 and snap["sched_prefetched_blocks"] == len(prompt) // BS
    assert_same_output(result, uncached(prompt))
    assert_no_leaks(engine)
    engine.shutdown(30)


def test_cancel_while_prefetching_keeps_blocks_until_the_read_ends(model, uncached, tmp_path):
    prompt = ask(model, "Review: webhook handler acknowledges before persisting.")
    on_disk(model, tmp_path, prompt)
    engine = tiered(model, tmp_path, gated=True, max_num_seqs=1)
    gate = engine.lower.tiers[0].tier
    busy, handle = submit_behind_busy(model, engine, prompt)
    (read,) = engine.scheduler.cache.prefetch.reads
    handle.cancel()
    engine.step()
    assert engine.collect(handle).finish_reason == "abort"
    # the tier may still write into these blocks: they stay referenced by the read
    assert engine.scheduler.cache.prefetch.reads == [read]
    assert all(b.ref_count == 1 and not b.registered for b in read.blocks)
    busy.cancel()
    engine.step()
    assert engine.num_active() == 0 and engine.scheduler.has_work()

    gate.open()
    engine.run_until_idle()
    assert_no_leaks(engine)
    # the verified blocks were published all the same: the next request hits them in RAM
    assert engine.scheduler.cache.prefetch.stats.prefetched_blocks == len(prompt) // BS
    result = engine.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert result.cached_tokens_by_tier["ram"] == result.num_cached_tokens
    assert observability.snapshot(engine)["ssd_load_calls"] == 1
    assert_same_output(result, uncached(prompt))
    assert_no_leaks(engine)
    engine.shutdown(30)


def test_block_that_fails_to_load_is_not_published(model, uncached, tmp_path):
    prompt = ask(model, "Review: currency conversion happens before the fee is applied.")
    on_disk(model, tmp_path, prompt)
    engine = tiered(model, tmp_path, max_num_seqs=1)
    chain = block_digests(root_digest(engine.fingerprint), prompt, BS)
    victim = 3
    path = engine.lower.tiers[0].tier.layout.block_path(engine.blocks.key(chain[victim]))
    # after the start-up scan (which would drop a file caught half-written), in place
    wait_until(lambda: observability.snapshot(engine).get("ssd_scan_complete"), what="the start-up scan")
    with open(path, "r+b") as fh:
        fh.seek(-100, 2)
        byte = fh.read(1)
        fh.seek(-100, 2)
        fh.write(bytes([byte[0] ^ 0xFF]))  # a payload byte: only the read's checksum catches it

    busy, handle = submit_behind_busy(model, engine, prompt)
    (read,) = engine.scheduler.cache.prefetch.reads
    wait_until(lambda: all(f.done() for f in read.pending.futures), what="the disk read")
    engine.step()
    assert engine.scheduler.cache.prefetch.stats.prefetched_blocks == victim
    cached = {b.digest for b in engine.blocks.cached_blocks()}
    assert set(chain[:victim]) <= cached and not set(chain[victim:]) & cached
    engine.run_until_idle()
    result = engine.collect(handle)
    assert result.num_cached_tokens == victim * BS
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": victim * BS}
    assert observability.snapshot(engine)["ssd_corrupt_total"] == 1
    assert_same_output(result, uncached(prompt))
    assert engine.collect(busy).finish_reason == "length"
    assert_no_leaks(engine)
    engine.shutdown(30)


def test_prefix_longer_than_the_cap_is_read_in_part_and_the_rest_at_admission(model, uncached, tmp_path):
    prompt = ask(model, "Review: the nightly job retries failed payouts forever.")
    on_disk(model, tmp_path, prompt)
    engine = tiered(model, tmp_path, max_num_seqs=1)
    cap = 4
    engine.scheduler.cache.prefetch.max_blocks = cap
    busy, handle = submit_behind_busy(model, engine, prompt)
    (read,) = engine.scheduler.cache.prefetch.reads
    assert len(read.blocks) == cap < len(prompt) // BS
    engine.run_until_idle()
    result = engine.collect(handle)
    assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": result.num_cached_tokens}
    snap = observability.snapshot(engine)
    assert snap["sched_prefetched_blocks"] == cap
    assert snap["ssd_load_calls"] == 2 and snap["ssd_load_hits"] == len(prompt) // BS  # the rest, once
    assert snap["kv_lookup_hits"] == 0
    assert_same_output(result, uncached(prompt))
    assert engine.collect(busy).finish_reason == "length"
    assert_no_leaks(engine)
    engine.shutdown(30)


def test_prefetch_off_loads_at_admission(model, uncached, tmp_path):
    prompt = ask(model, "Review: the ledger table has no unique constraint.")
    on_disk(model, tmp_path, prompt)
    engine = tiered(model, tmp_path, max_num_seqs=1, prefetch_pool_fraction=0.0)
    _, handle = submit_behind_busy(model, engine, prompt)
    assert not engine.scheduler.cache.prefetch.reads
    engine.run_until_idle()
    result = engine.collect(handle)
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": expected_cached(len(prompt), len(prompt))}
    assert engine.scheduler.cache.prefetch.stats.prefetch_reads == 0
    assert_same_output(result, uncached(prompt))
    assert_no_leaks(engine)
    engine.shutdown(30)


def fill_pool(engine, model, leave_free: int) -> None:
    """Cache unrelated prompts until exactly ``leave_free`` blocks are free: the steady
    state of a long-running server, a pool of cached blocks nobody references."""
    one = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = len(model.tokenizer)
    i = 0
    while (free := engine.blocks.num_free) > leave_free:
        k = min(8, free - leave_free)  # a prompt of k full blocks leaves k cached blocks
        engine.generate([[(5000 + 7919 * i + j) % vocab for j in range(k * BS)]], one)
        i += 1
    assert engine.blocks.num_free == leave_free and engine.blocks.num_evictable > 0


def test_a_pool_full_of_cached_blocks_prefetches_without_evicting_the_prompts_own_prefix(model, uncached, tmp_path):
    """A prefetch takes free blocks first, then the least recently used cached ones, but
    never the queued prompt's own RAM prefix, here the oldest blocks of the pool."""
    prompt = ask(model, "Review: refunds skip the ledger entry when the amount is zero.")
    on_disk(model, tmp_path, prompt)
    engine = tiered(model, tmp_path, max_num_seqs=1, kv_cache_blocks=96)
    engine.generate([ask(model, "Hello.")], SamplingParams(max_tokens=1, temperature=0.0))  # the system prompt
    busy_blocks = -(-len(busy_prompt(model)) // BS)
    fill_pool(engine, model, leave_free=busy_blocks + 1)  # the busy request's admission takes those
    queue_behind_busy(model, engine)
    assert engine.blocks.num_free == 1  # the busy request's next decode block: reserved
    before = observability.snapshot(engine)
    handle = engine.submit(prompt, GREEDY)
    engine.step()
    seq = only_seq(engine, handle)
    n_full = len(prompt) // BS
    own = engine.blocks.match(seq.digests(n_full, BS), [seq.block_tokens(i, BS) for i in range(n_full)])
    assert 0 < len(own) < n_full  # the shared system prompt is in RAM, the rest on disk only
    (read,) = engine.scheduler.cache.prefetch.reads
    assert read.first == len(own) and len(read.blocks) == n_full - len(own)
    engine.run_until_idle()
    result = engine.collect(handle)
    assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert result.cached_tokens_by_tier == {"ram": len(own) * BS, "ssd": result.num_cached_tokens - len(own) * BS}
    after = observability.snapshot(engine)
    assert after["ssd_load_hits"] - before["ssd_load_hits"] == n_full - len(own)  # nothing read twice
    assert after["kv_evictions"] > before["kv_evictions"]  # room was made from other cached blocks
    assert_same_output(result, uncached(prompt))
    assert_no_leaks(engine)
    engine.shutdown(30)


def test_a_crowded_queue_with_cancels_and_preemption_leaks_nothing(model, tmp_path):
    """Ten requests (six of them disk hits) through three slots of a 21-block pool:
    prefetches, loads at admission, shared-prefix deferrals, preemptions (48-token decodes
    outgrow the pool) and two cancels mix; every finished output equals the uncached one
    and every block comes back."""
    on_disk_prompts = [ask(model, f"Review change {i}: " + "ledger.post(amount, fee); " * (3 + i)) for i in range(6)]
    writer = tiered(model, tmp_path)
    writer.generate(on_disk_prompts, GREEDY)
    assert writer.shutdown(30)
    longer = SamplingParams(max_tokens=48, temperature=0.0, logprobs=True, ignore_eos=True)  # decodes grow: preemption
    fresh = [chat_ids(model, f"Explain rounding mode {i} in two lines.") for i in range(4)]
    prompts = [p for pair in zip(on_disk_prompts, [*fresh, None, None], strict=True) for p in pair if p is not None]

    engine = tiered(model, tmp_path, max_num_seqs=3, kv_cache_blocks=22)
    handles = [engine.submit(p, longer) for p in prompts]
    engine.step()
    engine.step()
    cancelled = {handles[3].seq_id, handles[6].seq_id}
    for h in handles:
        if h.seq_id in cancelled:
            h.cancel()
    engine.run_until_idle()
    stats = observability.snapshot(engine)
    assert stats["sched_prefetch_reads"] > 0 and stats["sched_prefetched_blocks"] > 0
    assert stats["ssd_load_calls"] > stats["sched_prefetch_reads"]  # some loads start at admission
    assert stats["sched_deferred_for_shared_prefix"] > 0
    assert stats["sched_preemptions"] > 0
    finished = [(p, engine.collect(h)) for p, h in zip(prompts, handles, strict=True) if h.seq_id not in cancelled]
    assert all(engine.collect(h).finish_reason == "abort" for h in handles if h.seq_id in cancelled)
    # the reference: the same prompts with the cache disabled, in one batch
    reference = uncached_runner(model, longer).many([p for p, _ in finished])
    for (_prompt, result), expected in zip(finished, reference, strict=True):
        assert_same_output(result, expected)
        assert sum(result.cached_tokens_by_tier.values()) == result.num_cached_tokens
    assert_no_leaks(engine)
    engine.shutdown(30)
