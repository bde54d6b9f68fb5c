"""RemoteTier against a real redis-server: round trips, key layout, per-key lookups,
verification of every value, namespaces, removal."""

from __future__ import annotations

import pytest
import redis
import torch

from kvcellar.storage.block_format import FORMAT_VERSION, encode_block
from kvcellar.storage.remote.connection import redacted
from tests.helpers import wait_until
from tests.storage.helpers import SPEC, SPEC_F32, bits_equal, chain, load_request


def stored(tier, blocks) -> None:
    tier.store(blocks)
    assert tier.wait_idle(30)


def test_roundtrip_between_two_tiers_sharing_one_server(redis_server, open_remote):
    blocks = chain(6)
    writer = open_remote(redis_server.url)
    stored(writer, blocks)
    assert writer.stats()["remote_stored_blocks"] == 6
    keys = sorted(redis_server.client().keys("kvc:*"))
    assert keys == sorted(f"kvc:fp-v{FORMAT_VERSION}:{b.key.hex()}".encode() for b in blocks)

    reader = open_remote(redis_server.url)  # another replica: nothing known locally
    assert reader.lookup([b.key for b in blocks]) == 6
    loads = [load_request(b) for b in blocks]
    assert reader.load(loads).result(30) == 6
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    s = reader.stats()
    assert s["remote_load_hits"] == 6 and s["remote_load_bytes"] == 6 * SPEC.nbytes
    assert reader.health()["state"] == "ok" and reader.health()["remote"]["namespace"] == f"fp-v{FORMAT_VERSION}"
    assert not reader.health()["remote"]["sealed"] and "not sealed" in reader.health()["remote"]["warning"]


def test_sealed_values_serve_only_replicas_with_the_same_secret(redis_server, open_remote):
    blocks = chain(3)
    secret = b"one deployment's secret"
    stored(open_remote(redis_server.url, secret=secret), blocks)
    reader = open_remote(redis_server.url, secret=secret)
    loads = [load_request(b) for b in blocks]
    assert reader.load(loads).result(30) == 3
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    assert reader.health()["remote"]["sealed"] and "warning" not in reader.health()["remote"]
    other = open_remote(redis_server.url, secret=b"another deployment's secret")
    assert other.load([load_request(blocks[0])]).result(30) == 0
    assert other.stats()["remote_corrupt_seal"] == 1 and redis_server.client().exists(
        f"kvc:fp-v{FORMAT_VERSION}:{blocks[0].key.hex()}") == 0


def test_a_value_planted_to_be_huge_is_never_read_whole(redis_server, open_remote):
    """A value's size is bounded before it is fetched: one planted under a block's key at
    64 MiB costs a load a block's bytes (the server's own count of what it sent), not 64 MiB."""
    blocks = chain(1)
    name = f"kvc:fp-v{FORMAT_VERSION}:{blocks[0].key.hex()}"
    r = redis_server.client()
    r.set(name, bytes(64 << 20))
    tier = open_remote(redis_server.url)
    before = int(r.info("stats")["total_net_output_bytes"])
    assert tier.load([load_request(blocks[0])]).result(30) == 0
    assert int(r.info("stats")["total_net_output_bytes"]) - before < 1 << 20
    assert tier.stats()["remote_corrupt_size"] == 1 and r.exists(name) == 0


def test_lookup_answers_per_key_and_stores_are_written_once(redis_server, open_remote):
    blocks = chain(5)
    tier = open_remote(redis_server.url)
    stored(tier, [blocks[0], blocks[1], blocks[3]])
    assert tier.lookup([b.key for b in blocks]) == 2  # a hole at 2: the run ends there
    assert not tier.wants(blocks[0].key) and tier.wants(blocks[2].key)
    again = open_remote(redis_server.url)  # does not know what is stored: asks the server
    stored(again, blocks[:3])
    assert again.stats()["remote_stored_blocks"] == 1
    assert again.stats()["remote_store_skipped_existing"] == 2


def test_corrupt_and_foreign_values_are_counted_misses_and_deleted(redis_server, open_remote):
    blocks = chain(4)
    tier = open_remote(redis_server.url)
    stored(tier, blocks)
    r = redis_server.client()
    name = lambda b: f"kvc:fp-v{FORMAT_VERSION}:{b.key.hex()}"  # noqa: E731
    value = bytearray(r.get(name(blocks[1])))
    value[-1] ^= 0xFF  # payload bit flip
    r.set(name(blocks[1]), bytes(value))
    # a valid block of another prefix planted under a real key
    r.set(name(blocks[2]), encode_block(SPEC, blocks[3].key, blocks[3].digest, blocks[3].token_ids,
                                        blocks[3].data, 0))
    r.set(name(blocks[3]), b"not a block")
    for victim, reason in ((1, "checksum"), (2, "key"), (3, "size")):
        loads = [load_request(b) for b in blocks[victim:]]
        assert tier.load(loads).result(30) == 0
        assert tier.stats()[f"remote_corrupt_{reason}"] == 1
        assert r.exists(name(blocks[victim])) == 0  # deleted: the next writer stores a good copy
    loads = [load_request(b) for b in blocks[:1]]
    assert tier.load(loads).result(30) == 1 and bits_equal(loads[0].dest, blocks[0].data)
    assert tier.stats()["remote_corrupt_total"] == 3


def test_namespaces_and_geometries_never_share(redis_server, open_remote):
    blocks = chain(3)
    stored(open_remote(redis_server.url, fingerprint="model-a"), blocks)
    other_model = open_remote(redis_server.url, fingerprint="model-b")
    assert other_model.lookup([b.key for b in blocks]) == 0
    # same fingerprint string, another dtype (a misconfigured replica): the format refuses it
    f32 = open_remote(redis_server.url, fingerprint="model-a", spec=SPEC_F32)
    dest = torch.zeros(SPEC_F32.shape, dtype=SPEC_F32.dtype)
    req = load_request(blocks[0], dest)
    assert f32.load([req]).result(30) == 0
    assert f32.stats()["remote_corrupt_size"] == 1  # another geometry is another value size
    assert torch.count_nonzero(dest) == 0  # nothing of the foreign block reached dest


def test_remove_ttl_and_redacted_url(redis_server, open_remote):
    blocks = chain(3)
    tier = open_remote(redis_server.url, ttl_s=600)
    stored(tier, blocks)
    r = redis_server.client()
    assert 0 < r.pttl(f"kvc:fp-v{FORMAT_VERSION}:{blocks[0].key.hex()}") <= 600_000
    assert tier.remove([b.key for b in blocks[:2]]) == 2
    assert tier.lookup([b.key for b in blocks]) == 0 and tier.lookup([blocks[2].key]) == 1
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("rediss://h:1/0?ssl_ca_certs=/ca.pem&password=secret") == "rediss://h:1/0?ssl_ca_certs=/ca.pem&password=***"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


def test_a_full_queue_drops_instead_of_waiting(redis_server, open_remote):
    tier = open_remote(redis_server.url, queue_blocks=1, write_batch_blocks=1)
    stalled = redis_server.sleep_in_background(1)  # the writer waits on the server meanwhile
    try:
        tier.store(chain(40))
    finally:
        stalled.wait(30)
    assert tier.wait_idle(30)
    s = tier.stats()
    assert s["remote_dropped_queue_full"] + s["remote_dropped_backoff"] + s["remote_dropped_error"] > 0
    assert s["remote_stored_blocks"] + s["remote_dropped_queue_full"] + s["remote_dropped_backoff"] \
        + s["remote_dropped_error"] == 40
    wait_until(lambda: tier.health()["state"] == "ok", timeout=30, what="recovery after the stall")


def test_redis_cluster_spreads_blocks_over_its_nodes(redis_cluster, open_remote):
    blocks = chain(24)
    tier = open_remote(f"redis+cluster://127.0.0.1:{redis_cluster[0].port}")
    stored(tier, blocks)
    assert tier.stats()["remote_stored_blocks"] == 24
    per_node = [n.client().dbsize() for n in redis_cluster]
    assert sum(per_node) == 24 and all(per_node)  # sharded by key slot across the 3 nodes
    reader = open_remote(f"redis+cluster://127.0.0.1:{redis_cluster[1].port}")  # any node is a seed
    assert reader.lookup([b.key for b in blocks]) == 24
    loads = [load_request(b) for b in blocks]
    assert reader.load(loads).result(30) == 24
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    assert reader.health()["remote"]["cluster"] is True


def test_quantized_kv_values_round_trip_bit_exact_and_other_settings_miss(redis_server, open_remote):
    """8- and 4-bit KV blocks (cache/kv_pool.py) are values like any other: bit-exact back;
    the value records bits and group size, so a replica of another setting misconfigured
    onto the same namespace reads none of them."""
    from kvcellar.storage import BlockSpec
    from tests.storage.helpers import SPEC_Q4, SPEC_Q8

    for spec in (SPEC_Q8, SPEC_Q4):
        blocks = chain(3, spec, seed=spec.kv_bits)
        for i, b in enumerate(blocks):
            b.data.copy_(torch.randint(0, 256, spec.shape, dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(i)))
        fp = f"q{spec.kv_bits}"
        stored(open_remote(redis_server.url, fingerprint=fp, spec=spec), blocks)
        value = redis_server.client().get(f"kvc:{fp}-v{FORMAT_VERSION}:{blocks[0].key.hex()}")
        assert len(value) == 4096 + spec.nbytes and int.from_bytes(value[10:12], "little") == spec.flags
        reader = open_remote(redis_server.url, fingerprint=fp, spec=spec)
        loads = [load_request(b, torch.zeros(spec.shape, dtype=torch.uint8)) for b in blocks]
        assert reader.load(loads).result(30) == 3
        assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
        other = BlockSpec(torch.uint8, spec.shape, 16, kv_bits=spec.kv_bits, kv_group_size=16)
        foreign = open_remote(redis_server.url, fingerprint=fp, spec=other)
        dest = torch.zeros(spec.shape, dtype=torch.uint8)
        assert foreign.load([load_request(blocks[0], dest)]).result(30) == 0
        assert foreign.stats()["remote_corrupt_geometry"] == 1 and torch.count_nonzero(dest) == 0


def test_a_loads_time_limit_grows_with_its_bytes(redis_server, open_remote):
    """``load_timeout_s`` bounds a load of any size; ``load_bytes_per_s`` adds the time its
    bytes take at that rate, so a long prefix is not cut where a short one would be."""
    blocks = chain(8)
    stored(open_remote(redis_server.url), blocks)
    fixed = open_remote(redis_server.url, load_timeout_s=1e-9, load_bytes_per_s=0.0, load_chunk_blocks=1)
    loads = [load_request(b) for b in blocks]
    assert fixed.load(loads).result(30) < len(blocks)  # cut after at most one round trip
    assert fixed.stats()["remote_load_timeouts"] == 1
    allowed = open_remote(redis_server.url, load_timeout_s=1e-9, load_bytes_per_s=SPEC.nbytes / 10.0,
                          load_chunk_blocks=1)  # ten seconds a block
    assert allowed.load_timeout_for(len(blocks) * SPEC.nbytes) >= 80.0
    loads = [load_request(b) for b in blocks]
    assert allowed.load(loads).result(30) == len(blocks)
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    assert allowed.stats()["remote_load_timeouts"] == 0


def test_the_acl_the_readme_gives_is_all_the_tier_needs(private_redis, open_remote):
    """README, "Running it for a team": a Redis user limited to ``kvc:*`` keys and six commands
    stores, finds, loads (refreshing a TTL), deletes a bad value and probes, without an error."""
    acl = "kvc on >pw ~kvc:* resetchannels -@all +getrange +set +exists +del +pexpire +ping"
    server = private_redis(user=acl).start()
    url = f"redis://kvc:pw@127.0.0.1:{server.port}/0"
    blocks = chain(3)
    writer = open_remote(url, ttl_s=600, secret=b"a secret of this deployment")
    stored(writer, blocks)
    reader = open_remote(url, ttl_s=600, secret=b"a secret of this deployment")
    assert reader.lookup([b.key for b in blocks]) == 3
    loads = [load_request(b) for b in blocks]
    assert reader.load(loads).result(30) == 3
    assert all(bits_equal(r.dest, b.data) for r, b in zip(loads, blocks, strict=True))
    r = server.client()  # the default user plants a bad value
    name = f"kvc:fp-v{FORMAT_VERSION}:{blocks[0].key.hex()}"
    r.set(name, b"not a block")
    assert reader.load([load_request(blocks[0])]).result(30) == 0 and r.exists(name) == 0
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(url).set("other:key", b"x")  # the user reaches nothing else
    for tier in (writer, reader):
        s = tier.stats()
        assert s["remote_conn_errors"] == 0 and s["remote_dropped_error"] == 0 and tier.health()["state"] == "ok"
