"""A writer process killed for real with SIGKILL, again and again: every re-open
succeeds, reconciliation removes and counts the orphans, the unclean shutdown
is reported with its reason, and every block that lookup reports present loads
and verifies."""

from __future__ import annotations

import os
import signal

import pytest

from kvcellar.storage.block_format import FORMAT_VERSION
from tests.storage.helpers import bits_equal, block, files, load_request, spawn_child

CYCLES = 3


@pytest.mark.parametrize(("durability", "async_writes"), [("best_effort", "1"), ("persistent", "0")],
                         ids=["best_effort-async", "persistent-sync"])
def test_sigkill_while_writing(tmp_path, open_tier, durability: str, async_writes: str) -> None:
    start = 0
    written_total = 0
    for _ in range(CYCLES):
        child = spawn_child("write", str(tmp_path), "ns", durability, async_writes, str(start))
        reported = start
        written = 0
        assert child.stdout is not None
        for line in child.stdout:  # synchronise on the child's own progress reports
            if line.startswith("stored "):
                reported, written = (int(x) for x in line.split()[1:3])
                if written >= 24 or reported - start > 20_000:  # a writer that stores nothing fails below
                    break
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        stderr = child.stderr.read() if child.stderr else ""
        assert child.returncode == -signal.SIGKILL, stderr
        assert written >= 24, stderr

        blocks_dir = tmp_path / f"ns-v{FORMAT_VERSION}" / "blocks"
        orphans = len(files(blocks_dir, ".tmp"))
        tier = open_tier(tmp_path)
        assert tier.wait_scanned(60)
        health, stats = tier.health(), tier.stats()
        assert health["last_shutdown_clean"] is False
        assert stats["ssd_recovered_unclean_sessions"] == 1
        assert stats["ssd_recovered_orphan_tmp"] == orphans
        assert not files(blocks_dir, ".tmp")
        written_total += written

        present = 0
        for i in range(reported + 8):  # async: up to `reported` submitted, maybe more being written
            b = block(i)
            if tier.lookup([b.key]) == 0:
                # Synchronous writes that returned before the kill are on disk.
                assert async_writes == "1" or i >= reported, f"block {i} lost after store() returned"
                continue
            present += 1
            req = load_request(b)
            assert tier.load([req]).result(timeout=30) == 1, f"block {i}: present but not served"
            assert bits_equal(req.dest, b.data)
        assert stats["ssd_corrupt_total"] == tier.stats()["ssd_corrupt_total"] == 0
        assert present >= written_total  # async: submitted blocks may have been dropped, not written
        assert tier.close(30) is True
        start = reported

    last = open_tier(tmp_path)
    assert last.health()["last_shutdown_clean"] is True  # the test's own closes were clean


def test_shutdown_reason_names_the_killed_process_then_clears(tmp_path, open_tier) -> None:
    child = spawn_child("write", str(tmp_path), "ns", "best_effort", "1", "0")
    assert child.stdout is not None
    line = child.stdout.readline()  # the tier is open and writing
    assert line.startswith("stored "), child.stderr.read() if child.stderr else ""
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    tier = open_tier(tmp_path)
    health = tier.health()
    reason = health["ssd"]["last_shutdown_reason"]
    assert health["last_shutdown_clean"] is False
    assert reason == f"process {child.pid} ended without recording a shutdown (killed or crashed)", reason
    assert tier.close(30) is True

    again = open_tier(tmp_path)
    assert again.health()["last_shutdown_clean"] is True
    assert again.health()["ssd"]["last_shutdown_reason"] is None
