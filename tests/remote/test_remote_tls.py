"""``rediss://`` end to end against a TLS-only redis-server: blocks round-trip when the
client trusts the server's CA (given in the URL as ``?ssl_ca_certs=``); a server whose
certificate the client cannot verify is a degraded tier that misses, never an exception."""

from __future__ import annotations

import pytest

from tests.helpers import wait_until
from tests.remote.redis_server import make_tls_files, tls_unsupported
from tests.storage.helpers import bits_equal, chain, load_request


@pytest.fixture
def tls_redis(tmp_path, private_redis):
    reason = tls_unsupported()
    if reason is not None:
        pytest.skip(f"no TLS redis-server here: {reason}")
    return private_redis(tls=make_tls_files(tmp_path / "tls")).start()


def test_blocks_round_trip_over_tls(tls_redis, open_remote):
    assert tls_redis.url.startswith("rediss://")
    blocks = chain(5)
    keys = [b.key for b in blocks]
    writer = open_remote(tls_redis.url)
    writer.store(blocks)
    assert writer.wait_idle(30)
    assert writer.stats()["remote_stored_blocks"] == 5 and tls_redis.client().dbsize() == 5
    reader = open_remote(tls_redis.url)  # another replica
    assert reader.lookup(keys) == 5
    loads = [load_request(b) for b in blocks]
    assert reader.load(loads).result(30) == 5
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    assert reader.health()["state"] == "ok" and writer.health()["state"] == "ok"
    # the port speaks TLS only: the same address without it is a fault, not a hit
    plain = open_remote(f"redis://127.0.0.1:{tls_redis.port}/0")
    assert plain.lookup(keys) == 0 and plain.health()["state"] == "degraded"


def test_a_certificate_the_client_does_not_trust_is_a_degraded_tier(tls_redis, tmp_path, open_remote):
    other_ca = make_tls_files(tmp_path / "other").ca
    blocks = chain(3)
    keys = [b.key for b in blocks]
    tls_redis.client().set("kvc:canary", b"1")  # the server itself is fine for a client that trusts it
    tier = open_remote(f"rediss://127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={other_ca}", probe_interval_s=0.1)
    assert tier.lookup(keys) == 0
    h = tier.health()
    assert h["state"] == "degraded" and "CERTIFICATE_VERIFY_FAILED" in str(h["last_error"]), h
    loads = [load_request(b) for b in blocks]
    assert tier.load(loads).result(30) == 0
    tier.store(blocks)
    assert tier.wait_idle(30)
    assert tier.remove(keys) == 0
    failures = tier.stats()["remote_probe_failures"]
    wait_until(lambda: tier.stats()["remote_probe_failures"] > failures, timeout=30, what="a failed probe")
    assert tier.health()["state"] == "degraded"
    assert tier.stats()["remote_stored_blocks"] == 0 and tls_redis.client().keys("kvc:fp*") == []
    assert tier.close(10) is True


def test_a_certificate_that_does_not_name_the_host_dialled_is_a_degraded_tier(tls_redis, open_remote):
    """The certificate names 127.0.0.1 and localhost; dialled as 127.1 (the same address) the
    client refuses it: hostname checking is on whatever redis-py's default, and a URL can turn
    it off on purpose."""
    ca = tls_redis.tls.ca
    tier = open_remote(f"rediss://127.1:{tls_redis.port}/0?ssl_ca_certs={ca}")
    assert tier.lookup([b"k" * 32]) == 0
    h = tier.health()
    assert h["state"] == "degraded" and "Hostname mismatch" in str(h["last_error"]), h
    unchecked = open_remote(f"rediss://127.1:{tls_redis.port}/0?ssl_ca_certs={ca}&ssl_check_hostname=False")
    assert unchecked.lookup([b"k" * 32]) == 0 and unchecked.health()["state"] == "ok"
