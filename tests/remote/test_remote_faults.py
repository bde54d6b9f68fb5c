"""A Redis that is down, killed, stalled or full: the tier misses and drops (counted),
shows ``degraded`` with the last error, backs off, and recovers without a restart."""

from __future__ import annotations

from tests.helpers import free_port, wait_until
from tests.storage.helpers import bits_equal, chain, load_request


def ok(tier) -> bool:
    return tier.health()["state"] == "ok"


def test_down_at_start_then_up(private_redis, open_remote):
    port = free_port()
    tier = open_remote(f"redis://127.0.0.1:{port}/0")
    blocks = chain(3)
    assert tier.lookup([b.key for b in blocks]) == 0
    h = tier.health()
    assert h["state"] == "degraded" and "ConnectionError" in str(h["last_error"])
    tier.store(blocks)  # dropped, not queued behind a dead server
    assert tier.wait_idle(30)
    s = tier.stats()
    assert s["remote_stored_blocks"] == 0 and s["remote_conn_errors"] >= 1
    server = private_redis(port=port).start()
    wait_until(lambda: ok(tier), timeout=30, what="the tier to reconnect by itself")
    tier.store(blocks)
    assert tier.wait_idle(30) and server.client().dbsize() == 3
    assert tier.lookup([b.key for b in blocks]) == 3


def test_killed_mid_run_and_restarted(private_redis, open_remote):
    server = private_redis().start()
    tier = open_remote(server.url)
    blocks = chain(4)
    tier.store(blocks)
    assert tier.wait_idle(30)
    server.kill()
    loads = [load_request(b) for b in blocks]
    assert tier.load(loads).result(30) == 0  # a miss, not an exception
    assert tier.health()["state"] == "degraded"
    server.start()  # same port, empty (no persistence): blocks are gone, the tier is back
    wait_until(lambda: ok(tier), timeout=30, what="recovery after the restart")
    assert tier.lookup([b.key for b in blocks]) == 0
    tier.store(blocks)
    assert tier.wait_idle(30)
    loads = [load_request(b) for b in blocks]
    assert tier.load(loads).result(30) == 4
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))


def test_a_long_outage_is_probed_at_a_steady_pace_not_backed_off_further(private_redis, open_remote):
    """However long Redis was away, the tier is back within about one probe interval of its
    return: failed probes do not lengthen the wait, and lookups meanwhile cost nothing."""
    server = private_redis().start()
    tier = open_remote(server.url, probe_interval_s=0.2, backoff_initial_s=0.5, backoff_max_s=30.0)
    blocks = chain(3)
    keys = [b.key for b in blocks]
    tier.store(blocks)
    assert tier.wait_idle(30)
    server.kill()
    assert tier.lookup(keys) == 0  # the failure that starts the episode
    wait_until(lambda: tier.stats()["remote_probe_failures"] >= 8, timeout=60, what="a long outage")
    before = tier.stats()["remote_lookup_seconds"]
    for _ in range(20):  # an engine thread asking all along: answered without a round trip
        assert tier.lookup(keys) == 0
    assert tier.stats()["remote_lookup_seconds"] == before
    h = tier.health()
    assert h["state"] == "degraded" and h["remote"]["connection_backoff_s"] <= 0.5
    server.start()  # same port, empty
    probes = tier.stats()["remote_probes"]
    wait_until(lambda: ok(tier), timeout=30, what="the next probe to find the server")
    assert tier.stats()["remote_probes"] - probes <= 3  # found by the first probes after its return
    tier.store(blocks)
    assert tier.wait_idle(30) and tier.lookup(keys) == 3


def test_stalled_server_costs_one_bounded_wait(private_redis, open_remote):
    server = private_redis().start()
    tier = open_remote(server.url, timeout_s=0.1, backoff_initial_s=0.5, backoff_max_s=1.0)
    blocks = chain(2)
    tier.store(blocks)
    assert tier.wait_idle(30)
    stall = server.sleep_in_background(3)
    try:
        wait_until(lambda: tier.lookup([b.key for b in blocks]) == 0, timeout=30, what="the stall to be noticed")
        h = tier.health()
        assert h["state"] == "degraded" and "Timeout" in str(h["last_error"])
        # during the episode the caller's thread does not touch the network at all
        before = tier.stats()["remote_lookup_seconds"]
        assert tier.lookup([b.key for b in blocks]) == 0
        assert tier.stats()["remote_lookup_seconds"] == before
    finally:
        stall.wait(30)
    wait_until(lambda: ok(tier), timeout=30, what="recovery after the stall")
    assert tier.lookup([b.key for b in blocks]) == 2


def test_full_server_with_noeviction_drops_writes_and_keeps_serving_reads(private_redis, open_remote):
    server = private_redis(maxmemory="3mb", **{"maxmemory-policy": "noeviction"}).start()
    tier = open_remote(server.url)
    first = chain(4)
    tier.store(first)
    assert tier.wait_idle(30)
    assert tier.lookup([b.key for b in first]) == 4
    flood = chain(2000, seed=1)  # 6 KiB values: ~12 MiB, four times the limit
    for i in range(0, len(flood), 50):
        tier.store(flood[i: i + 50])
        assert tier.wait_idle(30)
    s, h = tier.stats(), tier.health()
    assert s["remote_dropped_oom"] >= 1
    assert h["state"] == "degraded" and "maxmemory" in str(h["last_error"])
    loads = [load_request(b) for b in first]  # reads still work while writes back off
    assert tier.load(loads).result(30) == 4
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, first, strict=True))
    server.client().config_set("maxmemory", "64mb")
    wait_until(lambda: ok(tier), timeout=30, what="recovery once the server has room")
    late = chain(2, seed=2)
    tier.store(late)
    assert tier.wait_idle(30) and tier.lookup([b.key for b in late]) == 2
