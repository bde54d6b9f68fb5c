"""Process-level behaviour: exiting without close(), and two processes sharing
one cache directory."""

from __future__ import annotations

from tests.storage.helpers import bits_equal, block, files, load_request, spawn_child


def test_exit_without_close_drains_and_exits(tmp_path, open_tier) -> None:
    child = spawn_child("batch", str(tmp_path), "ns", "0", "300", "0")
    out, err = child.communicate(timeout=120)  # must not hang on the non-daemon threads
    assert child.returncode == 0, err
    assert "done" in out
    tier = open_tier(tmp_path)
    assert tier.health()["last_shutdown_clean"] is True  # drained by the exit path
    assert tier.lookup([block(i).key for i in range(300)]) == 300


def test_two_processes_write_one_directory(tmp_path, open_tier) -> None:
    # Overlapping ranges: both processes write blocks 100..199 at the same time.
    a = spawn_child("batch", str(tmp_path), "ns", "0", "200", "1")
    b = spawn_child("batch", str(tmp_path), "ns", "100", "200", "1")
    for p in (a, b):
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    tier = open_tier(tmp_path)
    assert tier.wait_scanned(60)
    assert tier.health()["last_shutdown_clean"] is True
    assert not files(tmp_path, ".tmp")
    blocks = [block(i) for i in range(300)]
    assert tier.lookup([b.key for b in blocks]) == 300
    reqs = [load_request(x) for x in blocks]
    assert tier.load(reqs).result(timeout=60) == 300
    assert all(bits_equal(r.dest, x.data) for r, x in zip(reqs, blocks, strict=True))
    s = tier.stats()
    assert s["ssd_blocks"] == 300 and s["ssd_corrupt_total"] == 0
