"""The engine over the real SSD tier, in process: restart and promote hits, corruption,
namespaces, policies, cancellation during loads, and faults of a real filesystem.

Every output is compared with a cache-disabled run of the same prompt, on the stand-in model
(a small random-weight Llama with the real tokenizer: what the tier stores, checks and
serves is the same for any model, and a wrong block moves the logprobs as surely)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from kvcellar.engine import SamplingParams, observability
from kvcellar.runtime import attach_disk_tier
from kvcellar.settings import Settings
from kvcellar.storage.disk import maintenance
from kvcellar.storage.disk.config import DiskConfig
from tests._models import (
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    stand_in,
    tiered,
    tiny_model,
)
from tests.helpers import wait_until

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)
SYSTEM = ("You review pull requests for a payments company. Flag anything that touches money movement, "
          "idempotency keys, retries or currency rounding, and say why in one line each. " * 3)


@pytest.fixture(scope="module")
def model():
    return stand_in()




def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def ask(model, question: str) -> list[int]:
    return chat_ids(model, question, SYSTEM)


def test_restart_serves_prefix_from_disk(model, uncached, tmp_path):
    prompt = ask(model, "Review: retry the charge call up to 3 times on timeout.")
    first = tiered(model, tmp_path)
    a = first.generate([prompt], GREEDY)[0]
    assert first.shutdown(30)
    assert len(block_files(tmp_path)) >= len(prompt) // BS

    second = tiered(model, tmp_path)  # a new engine: empty RAM, same directory
    b = second.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == expected_cached(len(prompt), len(prompt)) >= len(prompt) - BS
    assert second.scheduler.cache.stats.lower_tier_hit_tokens == b.num_cached_tokens
    assert second.blocks.stats.lookup_hits == 0
    assert_same_output(a, uncached(prompt))
    assert_same_output(b, uncached(prompt))

    other = ask(model, "Review: round currency amounts with banker's rounding.")  # partial prefix
    c = second.generate([other], GREEDY)[0]
    shared = next(i for i, (x, y) in enumerate(zip(prompt, other, strict=False)) if x != y)
    assert c.num_cached_tokens == (shared // BS) * BS
    assert_same_output(c, uncached(other))
    assert_no_leaks(second)
    assert second.shutdown(30)


def test_block_aligned_prompt_from_disk_recomputes_only_the_last_token(model, uncached, tmp_path):
    prompt = ask(model, "Review: the ledger table has no unique constraint.")
    prompt = prompt[: (len(prompt) // BS) * BS]
    first = tiered(model, tmp_path)
    first.generate([prompt], GREEDY)
    first.shutdown(30)
    second = tiered(model, tmp_path)
    result = second.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == len(prompt) - 1
    assert observability.snapshot(second)["ssd_load_hits"] == len(prompt) // BS
    assert_same_output(result, uncached(prompt))
    again = second.generate([prompt], GREEDY)[0]  # RAM now holds every block, the last one included
    assert again.num_cached_tokens == len(prompt) - 1
    assert observability.snapshot(second)["ssd_load_hits"] == len(prompt) // BS
    assert_same_output(again, uncached(prompt))
    assert_no_leaks(second)
    second.shutdown(30)


def test_promote_after_ram_drop(model, uncached, tmp_path):
    engine = tiered(model, tmp_path)
    prompt = ask(model, "Review: store idempotency keys for 24 hours.")
    engine.generate([prompt], GREEDY)
    engine.lower.tiers[0].tier.wait_idle(30)
    assert engine.blocks.evict_all() > 0
    before = observability.snapshot(engine)
    loads_before = before["ssd_load_hits"]
    promoted = engine.generate([prompt], GREEDY)[0]
    after = observability.snapshot(engine)
    loaded = after["ssd_load_hits"] - loads_before
    assert loaded == promoted.num_cached_tokens // BS > 0
    # loaded blocks are registered in RAM but never stored back; only computed ones are
    registered = after["kv_registered"] - before["kv_registered"]
    # (handed to the tier, or declined by it up front because it already holds them)
    offered = sum(after[f"ssd_link_{k}_blocks"] - before[f"ssd_link_{k}_blocks"] for k in ("stored", "declined"))
    assert offered == registered - loaded
    again = engine.generate([prompt], GREEDY)[0]  # now a RAM hit: promoted blocks are registered
    assert observability.snapshot(engine)["ssd_load_hits"] - loads_before == loaded
    assert again.num_cached_tokens == promoted.num_cached_tokens
    assert_same_output(promoted, uncached(prompt))
    assert_same_output(again, uncached(prompt))
    engine.shutdown(30)


def test_write_through_drops_are_written_later(model, uncached, tmp_path):
    """Overload: a one-block queue that never waits drops most write-through blocks of a
    burst. They stay in RAM, and shutdown hands them to the tier again, so after a restart
    every full block of every finished request (prompt and generated tokens) is on disk."""
    from kvcellar.cache.hashing import block_digests, root_digest

    prompts = [ask(model, f"Review change {i}: " + "ledger.post(amount, fee); " * (4 + 2 * i)) for i in range(6)]
    overloaded = DiskConfig(min_free_bytes=0, queue_blocks=1, enqueue_timeout_s=0.0)
    first = tiered(model, tmp_path, tier_config=overloaded)
    results = first.generate(prompts, GREEDY)  # one burst: every prompt is prefilled in the same steps
    burst = observability.snapshot(first)
    assert first.shutdown(60)
    closed = observability.snapshot(first)
    offered, dropped = burst["ssd_link_stored_blocks"], burst["writer_dropped_queue_full"]
    # a block whose parent was dropped is dropped too (it would be unreachable), and both come back
    no_parent = burst["writer_dropped_no_parent"]
    written_later = closed["writer_written_after_drop"]
    assert dropped > 0, "the burst did not overload the queue"
    assert 0 < written_later <= dropped + no_parent

    root = root_digest(first.fingerprint)
    chains = [[first.blocks.key(d) for d in block_digests(root, list(p) + r.token_ids[:-1], BS)]
              for p, r in zip(prompts, results, strict=True)]
    second = tiered(model, tmp_path)
    assert second.lower.tiers[0].tier.wait_scanned(30)
    assert [second.lower.tiers[0].tier.lookup(keys) for keys in chains] == [len(keys) for keys in chains]
    again = second.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, again, strict=True):
        assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    served = observability.snapshot(second)["ssd_load_hits"]
    prompt_blocks = {key for prompt, keys in zip(prompts, chains, strict=True)
                     for key in keys[: expected_cached(len(prompt), len(prompt)) // BS]}
    assert served == len(prompt_blocks)  # shared prefixes are read once, then hit in RAM
    assert_same_output(again[-1], uncached(prompts[-1]))
    print(f"\nwrite-through overload (queue 1 block, no wait): offered {offered}, dropped {dropped} "
          f"(+{no_parent} behind a dropped parent), "
          f"written later {written_later}; after restart: {served} distinct prompt blocks served from disk, "
          f"{sum(map(len, chains))}/{sum(map(len, chains))} full blocks of the finished requests found")
    second.shutdown(30)


def test_ttl_expired_prefix_is_a_miss_and_is_recomputed(model, uncached, tmp_path):
    prompt = ask(model, "Review: the nightly job retries failed payouts forever.")
    first = tiered(model, tmp_path)
    first.generate([prompt], GREEDY)
    assert first.shutdown(30)
    expired = block_files(tmp_path)
    assert len(expired) >= len(prompt) // BS
    two_hours_ago = time.time_ns() - 2 * 3600 * 10**9
    for path in expired:
        os.utime(path, ns=(two_hours_ago, two_hours_ago))
    second = tiered(model, tmp_path, tier_config=DiskConfig(min_free_bytes=0, ttl_s=3600))
    assert second.lower.tiers[0].tier.wait_scanned(30)  # the start-up scan applies the TTL
    result = second.generate([prompt], GREEDY)[0]
    stats = observability.snapshot(second)
    assert result.num_cached_tokens == 0 and stats["ssd_load_hits"] == 0
    assert stats["ssd_ttl_pruned_blocks"] == len(expired)
    assert_same_output(result, uncached(prompt))
    assert second.lower.tiers[0].tier.wait_idle(30)
    assert len(block_files(tmp_path)) == len(expired)  # recomputed and written through again
    second.shutdown(30)


def test_ram_hits_keep_the_disk_copy_from_expiring(model, tmp_path):
    """A prefix served from RAM never touches the disk; the link refreshes the disk copy's
    access time, so the TTL prunes the cold prefix written at the same moment, not the hot one."""
    hot, cold = list(range(1000, 1000 + 3 * BS + 1)), list(range(5000, 5000 + 3 * BS + 1))
    cfg = DiskConfig(min_free_bytes=0, ttl_s=3.0, prune_interval_s=0.05)
    engine = tiered(model, tmp_path, tier_config=cfg)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([hot, cold], one)
    tier = engine.lower.tiers[0].tier
    assert tier.wait_idle(30)
    from kvcellar.cache.hashing import block_digests, root_digest

    root = root_digest(engine.fingerprint)
    hot_paths, cold_paths = ([tier.layout.block_path(engine.blocks.key(d)) for d in block_digests(root, ids, BS)]
                             for ids in (hot, cold))
    assert all(p.exists() for p in hot_paths + cold_paths)

    def cold_expired() -> bool:
        assert engine.generate([hot], one)[0].num_cached_tokens == 3 * BS  # a RAM hit
        return not any(p.exists() for p in cold_paths)

    assert wait_until(cold_expired, timeout=120, what="the cold prefix to expire")
    assert all(p.exists() for p in hot_paths)
    assert engine.blocks.stats.lookup_hits > 0 and observability.snapshot(engine)["ssd_load_hits"] == 0
    engine.shutdown(30)


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _break_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8] ^= 0x01  # inside the fixed header (format version / geometry)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate, _break_header])
def test_damaged_block_is_a_miss_and_is_recomputed(model, uncached, tmp_path, damage):
    prompt = ask(model, "Review: currency conversion happens before the fee is applied.")
    first = tiered(model, tmp_path)
    first.generate([prompt], GREEDY)
    first.shutdown(30)
    files_by_key = {p.stem: p for p in block_files(tmp_path)}
    from kvcellar.cache.hashing import block_digests, root_digest

    chain = block_digests(root_digest(first.fingerprint), prompt, BS)
    victim = 3
    damage(files_by_key[chain[victim].hex()])

    second = tiered(model, tmp_path)
    result = second.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == victim * BS  # blocks before the damaged one are used
    assert_same_output(result, uncached(prompt))
    stats = observability.snapshot(second)
    # caught by the load's checks, by the lookup's size check, or removed by the start-up scan
    assert stats["ssd_corrupt_total"] + stats["ssd_recovered_bad_size"] + stats.get("ssd_load_missing", 0) >= 1
    second.lower.tiers[0].tier.wait_idle(30)
    # the recomputed block was written through again, intact
    loads_before = stats["ssd_load_hits"]
    second.blocks.evict_all()
    again = second.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert observability.snapshot(second)["ssd_load_hits"] > loads_before
    assert_same_output(again, uncached(prompt))
    second.shutdown(30)


def test_models_dtypes_and_block_sizes_never_share(model, tmp_path):
    prompt = ask(model, "Review: the refund path skips the idempotency check.")
    bf16 = embedded("bfloat16")
    tiny = tiny_model("llama", model.tokenizer)
    variants = [(model, {}), (model, {"block_size": 32}), (bf16, {}), (tiny, {})]
    fingerprints = set()
    for loaded, kw in variants:
        engine = tiered(loaded, tmp_path, **kw)
        fingerprints.add(engine.fingerprint)
        result = engine.generate([prompt], GREEDY)[0]
        assert result.num_cached_tokens == 0, f"{loaded.name} {kw} hit another namespace's blocks"
        assert observability.snapshot(engine)["ssd_lookup_hit_blocks"] == 0
        engine.shutdown(30)
    assert len(fingerprints) == 4
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 4


@pytest.mark.parametrize("dropped_by", ["eviction", "shutdown"])
def test_evict_only_writes_the_blocks_ram_drops_and_a_restart_serves_them(model, uncached, tmp_path, dropped_by):
    """Nothing is written while RAM holds the blocks; RAM evicting them, or a graceful shutdown
    dropping all RAM holds, writes every one."""
    prompt = ask(model, "Review: webhook handler acknowledges before persisting.")
    engine = tiered(model, tmp_path, policy="evict_only")
    engine.generate([prompt], GREEDY)
    engine.lower.tiers[0].tier.wait_idle(30)
    assert block_files(tmp_path) == []
    if dropped_by == "eviction":
        dropped = engine.blocks.evict_all()
        engine.lower.tiers[0].tier.wait_idle(30)
        assert len(block_files(tmp_path)) == dropped > 0
        engine.shutdown(30)
    else:
        dropped = len(engine.blocks.cached_blocks())
        assert engine.shutdown(30)
        assert len(block_files(tmp_path)) == dropped > 0
    restarted = tiered(model, tmp_path, policy="evict_only")
    result = restarted.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens >= len(prompt) - BS
    assert_same_output(result, uncached(prompt))
    restarted.shutdown(30)


def test_cancel_while_loading_frees_blocks_after_the_read(model, uncached, tmp_path):
    long_prompt = ask(model, "Review this diff:\n" + "\n".join(f"+ charge(amount_{i}, retries=3)" for i in range(60)))
    writer = tiered(model, tmp_path)
    writer.generate([long_prompt], GREEDY)
    writer.shutdown(30)

    engine = tiered(model, tmp_path)
    handle = engine.submit(long_prompt, GREEDY)
    engine.step()  # admission: blocks reserved, reads started
    assert len(engine.scheduler.loading) == 1
    handle.cancel()
    engine.run_until_idle()
    assert engine.collect(handle).finish_reason == "abort"
    assert_no_leaks(engine)
    result = engine.generate([long_prompt], GREEDY)[0]  # the pool and the tier still work
    assert result.num_cached_tokens >= len(long_prompt) - BS
    assert_same_output(result, uncached(long_prompt))
    engine.shutdown(30)


def test_several_damaged_blocks_of_a_prompt_are_all_rewritten(model, uncached, tmp_path):
    """Issue 14, F5: the first damaged block of the prompt is a miss and the prompt is
    recomputed from there; the damaged blocks after it (never read) are checked when the
    recomputed chain is stored and rewritten, so afterwards every file is valid."""
    # Long enough that the reader threads (8) stop the load before reaching the later victims.
    diff = "".join(f"+    refund_{i} = charge_{i}.amount - fee_{i}\n" for i in range(40))
    prompt = ask(model, "Review: refunds are issued in the original currency.\n" + diff)
    first = tiered(model, tmp_path)
    first.generate([prompt], GREEDY)
    first.shutdown(30)
    from kvcellar.cache.hashing import block_digests, root_digest

    chain = block_digests(root_digest(first.fingerprint), prompt, BS)
    files_by_key = {p.stem: p for p in block_files(tmp_path)}
    n = len(prompt) // BS
    victims = [2, n // 2, n // 2 + 1, n - 2]
    assert n >= 30
    for v in victims:
        _flip_payload_byte(files_by_key[chain[v].hex()])

    second = tiered(model, tmp_path)
    result = second.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == victims[0] * BS
    assert_same_output(result, uncached(prompt))
    assert second.lower.tiers[0].tier.wait_idle(30)
    (rep,) = maintenance.verify_cache(tmp_path, delete=False)
    assert rep.bad == {} and rep.ok == rep.checked, rep.as_dict()
    stats = observability.snapshot(second)
    assert stats["ssd_corrupt_total"] == 4, {k: v for k, v in stats.items() if "corrupt" in k or "store" in k}
    assert all(chain[v].hex() in {p.stem for p in block_files(tmp_path)} for v in victims)
    second.shutdown(30)

    third = tiered(model, tmp_path)  # and the whole prompt is served from disk again
    again = third.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert_same_output(again, uncached(prompt))
    third.shutdown(30)


def test_settings_attach_the_tier_with_its_policy(model, tmp_path):
    engine = make_engine(model)
    settings = Settings(cache_dir=tmp_path, disk=DiskConfig(policy="evict_only", min_free_bytes=0))
    attach_disk_tier(engine, settings)
    assert [a.policy for a in engine.lower.tiers] == ["evict_only"]
    assert engine.lower.health()["ssd"]["ssd"]["path"].startswith(str(tmp_path / "kv"))
    engine.shutdown(10)
    off = make_engine(model)
    attach_disk_tier(off, Settings(cache_dir=tmp_path, disk=DiskConfig(policy="off")))
    assert off.lower.tiers == []


# ---- real filesystem faults ---------------------------------------------------------------


def block_file_bytes(model) -> int:
    """About one fp32 block file of ``model``: the KV of ``BS`` tokens and a header page."""
    c = model.model.config
    return c.num_hidden_layers * 2 * BS * c.num_key_value_heads * c.head_dim * 4 + 4096


@pytest.fixture
def small_fs(tmp_path, model):
    """A tmpfs of about 4 fp32 blocks of ``model``, unmounted afterwards."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    size = f"size={-(-4 * block_file_bytes(model) // 1024)}k"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_keeps_serving_and_leaves_no_partial_files(model, uncached, small_fs):
    cfg = DiskConfig(min_free_bytes=0, capacity_bytes=64 << 20, async_writes=False)
    engine = tiered(model, small_fs, tier_config=cfg)
    prompts = [ask(model, f"Review change {i}: " + "amount += fee; " * (5 + i)) for i in range(6)]
    for prompt in prompts:
        assert_same_output(engine.generate([prompt], GREEDY)[0], uncached(prompt))
    stats = observability.snapshot(engine)
    # The free-space check runs before each write, so a full disk is a capacity decision, never a
    # write error, and the tier stays healthy. The chains (one shared system prompt) are longer
    # than the disk: they are cut at the tail (dropped), never evicted from the head.
    pressure = ("ssd_evicted_blocks", "ssd_write_errors", "ssd_dropped_no_space", "writer_dropped_backoff")
    assert stats["ssd_dropped_no_space"] > 0 and stats["ssd_write_errors"] == 0, {k: stats[k] for k in pressure}
    assert stats["ssd_stored_blocks"] > 0
    (ns,) = maintenance.cache_stats(small_fs)
    assert ns.blocks == stats["ssd_blocks"] > 0 and ns.unreachable_blocks == 0
    assert not [p for p in small_fs.rglob("*") if p.is_file() and ".tmp" in p.name]
    for path in block_files(small_fs):  # whatever is on disk is whole
        assert path.stat().st_size == engine.lower.tiers[0].tier.file_size
    assert engine.lower.health()["ssd"]["state"] == "ok"
    engine.shutdown(30)


def test_read_only_filesystem_then_recovery(model, uncached, small_fs):
    cfg = DiskConfig(min_free_bytes=0, async_writes=False, fault_backoff_initial_s=0.05,
                         fault_backoff_max_s=0.2, probe_interval_s=0.05)
    engine = tiered(model, small_fs, tier_config=cfg)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    a = ask(model, "Review: fees computed in floats.")
    assert_same_output(engine.generate([a], GREEDY)[0], uncached(a))
    assert engine.lower.health()["ssd"]["state"] == "degraded"
    assert observability.snapshot(engine)["ssd_write_errors"] >= 1
    assert block_files(small_fs) == []

    subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    wait_until(lambda: engine.lower.health()["ssd"]["state"] == "ok", timeout=30, what="the tier to recover")
    b = ask(model, "Review: ledger entries written twice on retry.")
    assert_same_output(engine.generate([b], GREEDY)[0], uncached(b))
    assert len(block_files(small_fs)) > 0, "writes resume once the fault clears"
    assert os.access(small_fs, os.W_OK)
    # The blocks of ``a`` were dropped during the fault; RAM eviction now writes them.
    from kvcellar.cache.hashing import block_digests, root_digest

    a_keys = [engine.blocks.key(d) for d in block_digests(root_digest(engine.fingerprint), a, BS)]
    assert engine.lower.tiers[0].tier.lookup(a_keys) == 0
    assert observability.snapshot(engine)["writer_written_after_drop"] == 0
    engine.blocks.evict_all()  # the tmpfs holds only ~4 blocks: capacity evicts some of them again
    assert engine.lower.tiers[0].tier.lookup(a_keys) > 0
    assert observability.snapshot(engine)["writer_written_after_drop"] >= 1
    engine.shutdown(30)
