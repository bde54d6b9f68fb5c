"""The SSD tier's faults and limits as a running server reports them in /health, on a
real small filesystem mounted at ``<cache-dir>/kv`` (issue 14: F1, F2, F3). The servers serve
the stand-in (``tests._models.server_stand_in``), whose blocks are the embedded model's size."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._models import SERVER_STAND_IN, stand_in_args
from tests.helpers import ServerProcess, wait_until
from tests.mounts import Mount, mount_tmpfs, unmount

pytestmark = pytest.mark.slow


@pytest.fixture
def small_kv(tmp_path: Path) -> Iterator[Mount]:
    """``<tmp>/cache/kv`` on a 64 MiB tmpfs (about 88 fp32 blocks of the embedded model's geometry)."""
    m = mount_tmpfs(tmp_path / "cache" / "kv", "64m")
    if isinstance(m, str):
        pytest.skip(m)
    try:
        yield m
    finally:
        unmount(m.path)


def _prompt(i: int) -> str:
    """About 25 blocks of distinct tokens."""
    return f"Ticket {i}: " + " ".join(f"node{i}-{j} reports latency {j * 7 % 101} ms;" for j in range(60))


def _ssd(server: ServerProcess) -> dict:
    return server.health()["tiers"]["ssd"]


def _stored(server: ServerProcess) -> int:
    return server.health()["tiers"]["ssd"]["counters"]["ssd_stored_blocks"]


def _complete(server: ServerProcess, i: int) -> None:
    r = server.client().completions.create(model=SERVER_STAND_IN, prompt=_prompt(i), max_tokens=1, temperature=0)
    assert r.choices[0].text is not None


def _written(server: ServerProcess) -> bool:
    ssd = _ssd(server)
    return ssd["writer_queue_depth"] == 0 and ssd["ssd"]["writer_in_flight"] == 0


def test_full_cache_disk_remounted_read_only_is_degraded_then_recovers(small_kv, tmp_path, models_dir):
    """F1: a full cache disk remounted read-only: making room fails (the deletes answer
    EROFS) and /health says degraded with that error while requests are still served.
    F3: after the remount read-write the tier is ok and stores again within about a
    probe interval (the time is printed, not asserted)."""
    server = ServerProcess(tmp_path / "cache", *stand_in_args(), "--disk-min-free-gb", "0",
                           models_dir=models_dir).start()
    try:
        i = 0
        while server.health()["tiers"]["ssd"]["counters"]["ssd_evicted_blocks"] == 0:  # fill it
            assert i < 12, server.health()["tiers"]["ssd"]
            _complete(server, i)
            wait_until(lambda: _written(server), timeout=60, what="the writer to drain")
            i += 1
        assert _ssd(server)["state"] == "ok"

        small_kv.remount("ro")
        _complete(server, 100)  # served from RAM and compute; its blocks cannot be stored
        ssd = wait_until(lambda: (s := _ssd(server))["state"] == "degraded" and s, timeout=60,
                         what="the tier to report the fault")
        assert "EROFS" in str(ssd["last_error"]), ssd
        assert server.health()["tiers"]["ssd"]["counters"]["ssd_delete_errors_erofs"] >= 1

        small_kv.remount("rw")
        t0 = time.monotonic()
        wait_until(lambda: _ssd(server)["state"] == "ok", timeout=60, what="the tier to recover")
        t_ok = time.monotonic() - t0
        before = _stored(server)
        _complete(server, 200)
        wait_until(lambda: _stored(server) > before, timeout=60, what="blocks to be stored again")
        print(f"F3: ssd ok {t_ok:.2f}s after the remount rw; storing again {time.monotonic() - t0:.2f}s "
              "after it (including one request)", file=sys.stderr)
        assert _ssd(server)["state"] == "ok"
    finally:
        assert server.stop() == 0


def test_small_cache_filesystem_gets_a_relative_floor_or_says_no_space(small_kv, tmp_path, models_dir):
    """F2: with the default floor a 64 MiB cache filesystem is used (the floor is 5 % of it,
    not 1 GiB); a floor that leaves no room is said at start-up and in /health."""
    cache = tmp_path / "cache"
    server = ServerProcess(cache, *stand_in_args(), models_dir=models_dir, disk_floor_gb=None).start()
    try:
        _complete(server, 1)
        wait_until(lambda: _stored(server) > 0, timeout=60, what="blocks on the small filesystem")
        ssd = _ssd(server)
        assert ssd["state"] == "ok" and ssd["ssd"]["min_free_bytes"] == int(64 * 2**20 * 0.05), ssd
    finally:
        assert server.stop() == 0

    server = ServerProcess(cache, *stand_in_args(), "--disk-min-free-gb", "1", models_dir=models_dir).start()
    try:
        ssd = _ssd(server)
        assert ssd["state"] == "no_space" and "floor" in ssd["ssd"]["no_space"], ssd
        assert "will store nothing" in server.log_tail(20000)
        before = _stored(server)
        _complete(server, 2)  # still served; nothing stored, nothing even copied off the pool for it
        counters = server.health()["tiers"]["ssd"]["counters"]
        assert counters["ssd_link_declined_blocks"] > 0 and counters["ssd_link_stored_blocks"] == 0, counters
        assert counters["ssd_dropped_no_space"] == 0 and _stored(server) == before
    finally:
        assert server.stop() == 0
