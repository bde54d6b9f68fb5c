"""The tier's contract with the engine when nothing answers at its URL, for a single Redis
and for a Redis Cluster: every verb returns (a miss, a drop, 0), never raises; the tier
is degraded with the error's type in ``last_error``; it keeps probing and serves again,
without a restart, once a server answers at that address."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import wait_until
from tests.remote.redis_server import RedisServer, cluster_port
from tests.storage.helpers import bits_equal, chain, load_request

# Errors a tier shows for nothing listening: redis-py's cluster client raises its own
# exception family (not a RedisError) when no seed node answers.
KINDS = {
    "redis": ("redis://127.0.0.1:{port}/0", "ConnectionError"),
    "cluster": ("redis+cluster://127.0.0.1:{port}", "RedisClusterException"),
}


def ok(tier) -> bool:
    return tier.health()["state"] == "ok"


def every_verb_misses_or_drops(tier, blocks) -> None:
    keys = [b.key for b in blocks]
    stored = tier.stats()["remote_stored_blocks"]
    assert tier.lookup(keys) == 0
    loads = [load_request(b) for b in blocks]
    assert tier.load(loads).result(30) == 0
    assert all(torch.isnan(r.dest).all() for r in loads)  # nothing written into the destinations
    tier.store(blocks)
    assert tier.wait_idle(30)
    assert tier.wants(keys[0]) is False  # no point queueing for a server known to be down
    tier.touch(keys)
    tier.pin(keys)
    tier.unpin(keys)
    assert tier.remove(keys) == 0
    s = tier.stats()
    assert s["remote_stored_blocks"] == stored and s["remote_ok_state"] == 0


def cluster_ok(server: RedisServer) -> bool:
    return b"cluster_state:ok" in server.client().execute_command("CLUSTER", "INFO")


def start_server(kind: str, private_redis, port: int) -> RedisServer:
    if kind == "redis":
        return private_redis(port=port).start()
    # One node holding every slot is a whole cluster (redis-cli --cluster create wants three).
    # It serves no slot until given them (CLUSTER ADDSLOTSRANGE).
    return private_redis(port=port, **{"cluster-enabled": "yes", "cluster-config-file": "nodes.conf"}).start()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unreachable_from_start_is_degraded_then_serves_when_a_server_comes(kind, private_redis, open_remote):
    url_pattern, error_type = KINDS[kind]
    port = cluster_port()  # nothing listens there yet (its bus port is valid too, for the cluster)
    url = url_pattern.format(port=port)
    tier = open_remote(url, probe_interval_s=0.1)
    blocks = chain(4)
    keys = [b.key for b in blocks]

    every_verb_misses_or_drops(tier, blocks)
    h = tier.health()
    assert h["state"] == "degraded" and error_type in str(h["last_error"]), h
    assert h["remote"]["cluster"] is (kind == "cluster")
    failures = tier.stats()["remote_probe_failures"]
    wait_until(lambda: tier.stats()["remote_probe_failures"] >= failures + 2, timeout=30, what="probes to go on")
    every_verb_misses_or_drops(tier, blocks)  # the same, during the episode (no network at all)

    closing = open_remote(url)  # close while degraded: prompt, nothing to drop
    assert closing.lookup(keys) == 0
    s = closing.stats()  # one fault, counted once (its probes are not errors of a real call)
    assert s["remote_conn_errors"] == 1 and s[f"remote_conn_errors_{error_type.lower()}"] == 1
    closing.store(blocks)
    assert closing.close(10) is True
    assert closing.lookup(keys) == 0 and closing.load([load_request(blocks[0])]).result(30) == 0
    closing.store(blocks)  # after close: dropped, counted
    assert closing.stats()["remote_dropped_closed"] >= 1

    server = start_server(kind, private_redis, port)
    if kind == "cluster":
        # The node answers but serves no slot yet: the probe reaches it and still says no.
        wait_until(lambda: "covered" in str(tier.health()["last_error"]), timeout=30,
                   what="a probe of the slotless cluster")
        assert tier.health()["state"] == "degraded"
        server.client().execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        # Until the node says its cluster is ok, a probe's PING may pass and a write then
        # fail with ClusterDownError (a fault again): wait for it, not for the tier alone.
        wait_until(lambda: cluster_ok(server), timeout=30, what="the one-node cluster to be ok")
    wait_until(lambda: ok(tier), timeout=30, what="the tier to find the server by itself")

    tier.store(blocks)
    assert tier.wait_idle(30)
    assert tier.stats()["remote_stored_blocks"] == 4
    assert tier.lookup(keys) == 4
    loads = [load_request(b) for b in blocks]
    assert tier.load(loads).result(30) == 4
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    assert tier.remove(keys[3:]) == 1 and tier.lookup(keys) == 3
    assert tier.close(10) is True


def test_a_cluster_that_goes_away_is_a_fault_and_comes_back(private_redis, open_remote):
    """A cluster client that was connected raises ``RedisClusterException`` (not a
    ``RedisError``) from every call once no node answers; the probe must survive it."""
    port = cluster_port()
    server = start_server("cluster", private_redis, port)
    server.client().execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    wait_until(lambda: cluster_ok(server), timeout=30, what="the one-node cluster to be ok")
    tier = open_remote(f"redis+cluster://127.0.0.1:{port}", probe_interval_s=0.1)
    blocks = chain(3)
    tier.store(blocks)
    assert tier.wait_idle(30) and tier.lookup([b.key for b in blocks]) == 3
    server.kill()
    every_verb_misses_or_drops(tier, chain(3, seed=1))
    assert tier.health()["state"] == "degraded"
    failures = tier.stats()["remote_probe_failures"]
    wait_until(lambda: tier.stats()["remote_probe_failures"] >= failures + 2, timeout=30, what="probes to go on")
    server.start()  # its nodes.conf keeps the slots; the data is gone (no persistence)
    wait_until(lambda: cluster_ok(server), timeout=30, what="the restarted cluster to be ok")
    wait_until(lambda: ok(tier), timeout=30, what="the tier to find the cluster again")
    tier.store(blocks)
    assert tier.wait_idle(30)
    loads = [load_request(b) for b in blocks]
    assert tier.load(loads).result(30) == 3
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
