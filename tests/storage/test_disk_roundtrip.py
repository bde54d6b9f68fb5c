"""Round trips, restarts, dedup, namespaces, close(): the disk tier's basic promises."""

from __future__ import annotations

import json
import os
import re
import stat
import threading

import pytest
import torch

from kvcellar.storage import BlockSpec
from kvcellar.storage.block_format import FORMAT_VERSION
from kvcellar.storage.disk import DiskConfig, DiskTier
from tests.helpers import wait_until
from tests.storage.helpers import (
    SPEC,
    SPEC_BIG,
    SPEC_F32,
    bits_equal,
    block,
    chain,
    files,
    load_request,
    spawn_child,
)


@pytest.mark.parametrize("spec", [SPEC, SPEC_F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("async_writes", [True, False], ids=["async", "sync"])
def test_store_lookup_load_bit_identical(tmp_path, open_tier, spec: BlockSpec, async_writes: bool) -> None:
    tier = open_tier(tmp_path, spec=spec, async_writes=async_writes)
    blocks = chain(12, spec)
    tier.store(blocks)
    assert tier.wait_idle(30)
    assert tier.lookup([b.key for b in blocks]) == 12
    reqs = [load_request(b) for b in blocks]
    assert tier.load(reqs).result(timeout=30) == 12
    for r, b in zip(reqs, blocks, strict=True):
        assert bits_equal(r.dest, b.data)
    s = tier.stats()
    assert s["ssd_stored_blocks"] == 12 and s["ssd_load_hits"] == 12 and s["ssd_blocks"] == 12
    # Lookup stops at the first absent key.
    assert tier.lookup([blocks[0].key, block(99, spec).key, blocks[1].key]) == 1


def test_load_into_views_of_a_pool(tmp_path, open_tier) -> None:
    """dest may be a view into a larger block pool: filled in place, neighbours untouched."""
    tier = open_tier(tmp_path, async_writes=False)
    blocks = chain(3)
    tier.store(blocks)
    pool = torch.zeros((5, *SPEC.shape), dtype=SPEC.dtype)
    reqs = [load_request(b, pool[i + 1]) for i, b in enumerate(blocks)]
    assert tier.load(reqs).result(timeout=30) == 3
    assert torch.count_nonzero(pool[0]) == 0 and torch.count_nonzero(pool[4]) == 0
    for i, b in enumerate(blocks):
        assert bits_equal(pool[i + 1], b.data)


def test_restart_same_process_and_fresh_subprocess(tmp_path, open_tier) -> None:
    blocks = chain(10)
    first = open_tier(tmp_path)
    first.store(blocks)
    assert first.close(30) is True

    second = open_tier(tmp_path)  # a new object on the same directory: no warm-up needed
    assert second.lookup([b.key for b in blocks]) == 10
    reqs = [load_request(b) for b in blocks]
    assert second.load(reqs).result(timeout=30) == 10
    assert all(bits_equal(r.dest, b.data) for r, b in zip(reqs, blocks, strict=True))
    assert second.health()["last_shutdown_clean"] is True
    second.close(10)

    child = spawn_child("check", str(tmp_path), "ns", "12")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"present": 10, "loaded": 10, "bits_equal": True, "last_shutdown_clean": True}


def test_layout_names_and_permissions(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path / "kv", descriptor={"weights": "w1", "block_size": 16})
    b = block(0)
    tier.store([b])
    assert tier.wait_idle(30)
    ns_dir = tmp_path / "kv" / f"ns-v{FORMAT_VERSION}"
    path = ns_dir / "blocks" / b.key.hex()[:2] / f"{b.key.hex()}.kvb"
    assert path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for d in (tmp_path / "kv", ns_dir, ns_dir / "blocks", path.parent, ns_dir / "sessions"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    doc = json.loads((ns_dir / "namespace.json").read_text())
    assert doc["descriptor"] == {"weights": "w1", "block_size": 16}
    assert doc["spec"]["dtype"] == "bfloat16" and doc["format_version"] == FORMAT_VERSION
    # Only hashes in file names; no other files in the blocks tree.
    assert [p.name for p in files(ns_dir / "blocks", "")] == [path.name]


def test_dedup_in_flight_and_on_disk(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, queue_blocks=64)
    b = block(7)
    barrier = threading.Barrier(8)

    def hammer() -> None:
        barrier.wait()
        for _ in range(25):
            tier.store([b])

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.wait_idle(30)
    s = tier.stats()
    assert s["ssd_stored_blocks"] == 1
    assert s["writer_dedup_inflight"] + s["ssd_store_skipped_existing"] == 8 * 25 - 1
    path = files(tmp_path, ".kvb")[0]
    before = path.stat()
    tier.close(10)

    again = open_tier(tmp_path)  # a key already on disk is not rewritten, also after a restart
    again.store([b])
    assert again.wait_idle(30)
    assert again.stats()["ssd_store_skipped_existing"] == 1
    assert again.stats()["ssd_stored_blocks"] == 0
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_namespaces_are_isolated(tmp_path, open_tier) -> None:
    a = open_tier(tmp_path, ns="modelA", spec=SPEC, async_writes=False)
    other_spec = BlockSpec(torch.float16, SPEC.shape, SPEC.block_size)  # same byte size, other dtype
    b = open_tier(tmp_path, ns="modelB", spec=other_spec, async_writes=False)
    assert b.wait_scanned(30)  # else its start-up scan may see the planted file half-written
    blocks = chain(4)
    a.store(blocks)
    assert a.lookup([x.key for x in blocks]) == 4
    assert b.lookup([x.key for x in blocks]) == 0
    # Even a file planted at B's path (same key) is never served as B's block.
    src = a.layout.block_path(blocks[0].key)
    dst = b.layout.block_path(blocks[0].key)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    assert b.lookup([blocks[0].key]) == 1  # same size, so stat says present ...
    dest = torch.zeros(other_spec.shape, dtype=other_spec.dtype)
    req = load_request(blocks[0], dest)
    assert b.load([req]).result(timeout=30) == 0  # ... but the header says bf16: a miss
    assert b.stats()["ssd_corrupt_geometry"] == 1 and not dst.exists()
    assert a.lookup([blocks[0].key]) == 1  # A is untouched


def test_other_format_version_is_a_different_directory(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, async_writes=False)
    blocks = chain(2)
    tier.store(blocks)
    tier.close(10)
    # An older kvcellar's directory under the same root is simply not seen.
    (tmp_path / f"ns-v{FORMAT_VERSION}").rename(tmp_path / "ns-v0")
    fresh = open_tier(tmp_path)
    assert fresh.lookup([b.key for b in blocks]) == 0


def test_close_drains_the_queue_and_records_a_clean_shutdown(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, queue_blocks=512, enqueue_timeout_s=5.0)
    blocks = chain(200)
    for i in range(0, 200, 20):
        tier.store(blocks[i:i + 20])
    assert tier.close(60) is True
    h = tier.health()
    assert h["closed"] is True and h["writer_queue_depth"] == 0
    assert tier.stats()["ssd_stored_blocks"] + tier.stats()["writer_dropped_queue_full"] == 200
    stored = tier.stats()["ssd_stored_blocks"]
    # After close: admits nothing, loads resolve to 0, close is idempotent.
    tier.store([block(500)])
    assert tier.stats()["writer_dropped_closed"] == 1
    assert tier.load([load_request(blocks[0])]).result(timeout=5) == 0
    assert tier.close(1) is True
    reopened = open_tier(tmp_path)
    assert reopened.health()["last_shutdown_clean"] is True
    assert reopened.health()["ssd"]["last_shutdown_reason"] is None
    assert len(files(tmp_path, ".kvb")) == stored == 200
    assert not files(tmp_path, ".tmp")


def test_contract_violations_raise_value_error(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path)
    b = block(0)
    bad_shape = b.__class__(b.key, b.digest, b.token_ids, b.data[:1])
    with pytest.raises(ValueError):
        tier.store([bad_shape])
    with pytest.raises(ValueError):
        tier.store([b.__class__(b.key, b.digest, b.token_ids[:-1], b.data)])
    with pytest.raises(ValueError):
        tier.store([b.__class__(b.key, b"short", b.token_ids, b.data)])
    with pytest.raises(ValueError):
        tier.load([load_request(b, torch.zeros(SPEC.shape, dtype=torch.float32))])
    with pytest.raises(ValueError):
        DiskTier(tmp_path, "../escape", SPEC, DiskConfig())


def test_unusable_root_is_degraded_not_an_exception(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")  # the KV root would have to be a directory below a regular file
    tier = DiskTier(blocker / "kv", "ns", SPEC, DiskConfig(async_writes=False))
    try:
        h = tier.health()
        assert h["state"] == "degraded" and "ENOTDIR" in str(h["last_error"])
        tier.store([block(0)])
        assert tier.lookup([block(0).key]) == 0
        assert tier.load([load_request(block(0))]).result(timeout=10) == 0
    finally:
        assert tier.close(10) is True
    assert os.path.isfile(blocker)


def test_close_that_cannot_drain_records_an_unclean_shutdown(tmp_path, open_tier) -> None:
    """A writer not drained within the close timeout drops the rest (counted) and the next
    opener reports last_shutdown_clean = False."""
    tier = open_tier(tmp_path, spec=SPEC_BIG, durability="persistent", queue_blocks=512, enqueue_timeout_s=1.0)
    tier.store(chain(300, SPEC_BIG))  # 300 fsync'd writes queued: far more than a zero timeout drains
    assert tier.close(0.0) is False
    s = tier.stats()
    assert s["writer_dropped_abort"] > 0
    assert s["ssd_stored_blocks"] + s["writer_dropped_abort"] <= 300
    again = open_tier(tmp_path, spec=SPEC_BIG)
    assert again.wait_scanned(30)
    health = again.health()
    assert health["last_shutdown_clean"] is False and health["ssd"]["unclean_previous_sessions"] == 1
    reason = health["ssd"]["last_shutdown_reason"]
    found = re.fullmatch(r"writer did not drain within 0\.0s: (\d+) queued block\(s\) dropped", reason)
    assert found and 0 < int(found.group(1)) <= s["writer_dropped_abort"], reason
    assert again.stats()["ssd_recovered_unclean_sessions"] == 1
    # everything that was written is whole: the scan found no bad file
    assert again.stats()["ssd_blocks"] == s["ssd_stored_blocks"]


def test_writes_wait_for_reads_in_flight(tmp_path, open_tier) -> None:
    """Reads before writes: a queued write waits while a load is reading. The load is held
    in flight by a real FIFO in place of a block file (open() blocks until a writer comes)."""
    tier = open_tier(tmp_path, write_defer_max_s=120.0)
    assert tier.wait_scanned(30)
    stuck, queued = block(0), block(1)
    fifo = tier.layout.block_path(stuck.key)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    pending = tier.load([load_request(stuck)])
    try:
        assert wait_until(lambda: tier.stats()["ssd_load_batches_in_flight"] == 1)
        tier.store([queued])
        assert wait_until(lambda: tier.stats()["writer_deferred_for_reads"] == 1)
        assert not tier.layout.block_path(queued.key).exists() and tier.stats()["writer_in_flight"] == 0
    finally:
        with open(fifo, "wb"):  # the read sees an empty file: a miss, deleted as damaged
            pass
    assert pending.result(timeout=30) == 0
    assert tier.wait_idle(30) and tier.layout.block_path(queued.key).exists()
    assert tier.stats()["ssd_corrupt_size"] == 1 and not fifo.exists()
