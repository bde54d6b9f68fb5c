"""The engine over SSD + a real Redis, in process: replica B reuses what replica A
computed, promotion into B's SSD, a prefix split across SSD and Redis, planted values,
and a Redis that is down. Every output is compared with a cache-disabled run, on the
stand-in model (a small random-weight Llama with the real tokenizer: what the tiers move is
the same for any model, and a wrong block moves the logprobs as surely)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcellar.engine import SamplingParams, native, observability
from kvcellar.runtime import open_disk_tier, open_remote_tier
from kvcellar.storage.block_format import FIXED_SIZE, FORMAT_VERSION, SEAL_SIZE, CacheSecret, header_size_for
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.remote.config import RemoteConfig
from tests._models import (
    TEST_DEVICE,
    assert_identical_output,
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    needs_native,
    served_file,
    served_moe,
    stand_in,
    uncached_runner,
)
from tests.helpers import free_port
from tests.integration import test_qwen35 as qwen35
from tests.storage.helpers import forged

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
DOC = ("Section 4.2. A payment intent moves from created to authorized to captured; a refund references "
       "a captured intent and may be partial. Idempotency keys are scoped per merchant and expire after "
       "24 hours. Retries after a network timeout must reuse the key. " * 6)

_engines: list[Any] = []


@pytest.fixture(scope="module")
def model():
    return stand_in()


@pytest.fixture(autouse=True)
def _shut_down_engines() -> Iterator[None]:
    """Engines a test left running (it failed before its own shutdown): their tiers' writer
    threads are not daemons and would keep pytest from exiting."""
    yield
    while _engines:
        _engines.pop().shutdown(30)


def replica(model, url: str | None, ssd_dir: Path | None, remote_policy: str = "write_through",
            engine_config: dict[str, Any] | None = None, secret: bytes | None = None, **cfg):
    """An engine with the SSD tier at ``ssd_dir`` and the remote tier at ``url`` (either may be
    absent), sealing blocks with ``secret`` when given."""
    engine = make_engine(model, **(engine_config or {}))
    _engines.append(engine)
    if ssd_dir is not None:
        open_disk_tier(engine, ssd_dir, DiskConfig(min_free_bytes=0), secret=secret)
    if url is not None:
        cfg.setdefault("backoff_initial_s", 0.05)
        open_remote_tier(engine, RemoteConfig(url=url, **cfg), remote_policy, secret)
    return engine


def tier(engine, name: str):
    return next(a.tier for a in engine.lower.tiers if a.tier.name == name)


def ask(model, question: str) -> list[int]:
    return chat_ids(model, question, DOC)


def test_replica_b_serves_what_a_computed_and_promotes_it_to_its_ssd(model, uncached, redis_server, tmp_path):
    prompt = ask(model, "Can a refund reference an authorized intent?")
    a = replica(model, redis_server.url, tmp_path / "a")
    a.generate([prompt], GREEDY)
    assert a.shutdown(30)  # drains both writers

    b = replica(model, redis_server.url, tmp_path / "b")
    result = b.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt)) >= 0.9 * len(prompt)
    assert_same_output(result, uncached(prompt))
    s = observability.snapshot(b)
    assert s["remote_link_loaded_blocks"] == -(-result.num_cached_tokens // BS)  # all of it from Redis
    assert s["ssd_link_loaded_blocks"] == 0 and s["remote_corrupt_total"] == 0
    assert result.cached_tokens_by_tier == {"ram": 0, "remote": result.num_cached_tokens}
    assert tier(b, "ssd").wait_idle(30)
    assert observability.snapshot(b)["ssd_stored_blocks"] >= s["remote_link_loaded_blocks"]  # promoted to B's SSD
    assert_no_leaks(b)
    b.shutdown(30)

    again = replica(model, redis_server.url, tmp_path / "b")  # B restarted: its SSD comes first now
    result = again.generate([prompt], GREEDY)[0]
    assert_same_output(result, uncached(prompt))
    s = observability.snapshot(again)
    assert s["ssd_link_loaded_blocks"] == -(-result.num_cached_tokens // BS) and s["remote_link_loaded_blocks"] == 0
    again.shutdown(30)


@pytest.mark.skipif(not native.available() or TEST_DEVICE != "cpu", reason="kvcellar's CPU kernels")
@pytest.mark.parametrize("served", [lambda: embedded("auto", "auto"), lambda: served_moe("auto")],
                         ids=["embedded", "qwen3moe"])
def test_a_redis_hit_under_the_default_weights_gives_the_uncached_bits(served, redis_server, tmp_path):
    """The embedded model and a qwen3moe GGUF as ``--weights auto`` serves them (int4 on
    kvcellar's kernels): the prefix another replica computed in chunks of 64, loaded from
    Redis, and the last token computed alone give the cache-disabled engine's tokens and
    logprobs to the bit (for the MoE model: the same experts routed)."""
    loaded = served()
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
    prompt = chat_ids(loaded, "Can a refund reference an authorized intent?", DOC)
    a = replica(loaded, redis_server.url, None, engine_config={"max_step_tokens": 64})
    a.generate([prompt], params)
    assert a.shutdown(30)
    b = replica(loaded, redis_server.url, None)
    result = b.generate([prompt], params)[0]
    assert result.cached_tokens_by_tier == {"ram": 0, "remote": expected_cached(len(prompt), len(prompt))}
    assert_identical_output(result, uncached_runner(loaded, params)(prompt))
    b.shutdown(30)


@needs_native
def test_replicas_share_a_hybrid_models_snapshots_through_redis(redis_server, tmp_path):
    """Qwen3.5's recurrent state: replica B resumes from the snapshot A kept in Redis (with the
    blocks before it), to the uncached engine's bits, and keeps it on its own SSD, from where
    it resumes after a restart."""
    loaded = served_file(qwen35.folder(), "int8")
    prompt = qwen35.prompts(loaded)[0]
    reference = uncached_runner(loaded, qwen35.PARAMS)(prompt)
    a = replica(loaded, redis_server.url, None, engine_config={"max_step_tokens": 64})
    a.generate([prompt], qwen35.PARAMS)
    assert a.shutdown(30)
    cached = qwen35.resumable(len(prompt))
    b = replica(loaded, redis_server.url, tmp_path / "b")
    result = b.generate([prompt], qwen35.PARAMS)[0]
    assert result.cached_tokens_by_tier == {"ram": 0, "remote": cached}
    assert_identical_output(result, reference)
    s = observability.snapshot(b)
    assert s["remote_link_snapshots_loaded"] == 1 and s["snapshots_remote_corrupt_total"] == 0
    assert b.shutdown(30)
    again = replica(loaded, redis_server.url, tmp_path / "b")
    result = again.generate([prompt], qwen35.PARAMS)[0]
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": cached}
    assert_identical_output(result, reference)
    assert observability.snapshot(again)["ssd_link_snapshots_loaded"] == 1
    again.shutdown(30)


def test_a_prefix_split_across_ssd_and_redis_is_loaded_from_both(model, uncached, redis_server, tmp_path):
    prompt = ask(model, "Which state does a partial refund need?")
    full = replica(model, redis_server.url, None)  # Redis gets every block
    full.generate([prompt], GREEDY)
    full.shutdown(30)
    half = len(prompt) // 2
    local = replica(model, None, tmp_path / "ssd")  # this SSD gets only the first half
    local.generate([prompt[:half]], GREEDY)
    local.shutdown(30)

    both = replica(model, redis_server.url, tmp_path / "ssd")
    result = both.generate([prompt], GREEDY)[0]
    assert_same_output(result, uncached(prompt))
    assert result.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    s = observability.snapshot(both)
    assert s["ssd_link_loaded_blocks"] == half // BS
    assert s["remote_link_loaded_blocks"] == -(-result.num_cached_tokens // BS) - half // BS
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": half // BS * BS,
                                            "remote": result.num_cached_tokens - half // BS * BS}
    both.shutdown(30)


def test_a_queued_request_prefetches_from_both_tiers_and_credits_each(model, uncached, redis_server, tmp_path):
    """With the only sequence slot taken, the queued request's prefix (half on the SSD,
    the rest in Redis) is read while it waits; admitted later as a RAM hit, it still
    reports each block under the tier that served it, and Redis' blocks reach the SSD."""
    prompt = ask(model, "Can a partial refund be retried?")
    full = replica(model, redis_server.url, None)
    full.generate([prompt], GREEDY)
    full.shutdown(30)
    half = len(prompt) // 2
    local = replica(model, None, tmp_path / "ssd")
    local.generate([prompt[:half]], GREEDY)
    local.shutdown(30)

    engine = replica(model, redis_server.url, tmp_path / "ssd", engine_config={"max_num_seqs": 1})
    busy = engine.submit(chat_ids(model, "Count to fifty."), SamplingParams(max_tokens=30, temperature=0.0,
                                                                            ignore_eos=True))
    engine.step()
    handle = engine.submit(prompt, GREEDY)
    engine.step()
    (read,) = engine.scheduler.cache.prefetch.reads
    assert read.pending.plan.runs == ((0, half // BS), (1, len(prompt) // BS - half // BS))
    engine.run_until_idle()
    result = engine.collect(handle)
    assert engine.collect(busy).finish_reason == "length"
    assert_same_output(result, uncached(prompt))
    cached = expected_cached(len(prompt), len(prompt))
    assert result.num_cached_tokens == cached
    assert result.cached_tokens_by_tier == {"ram": 0, "ssd": half // BS * BS, "remote": cached - half // BS * BS}
    s = observability.snapshot(engine)
    assert s["sched_prefetched_blocks"] == len(prompt) // BS
    assert s["ssd_link_loaded_blocks"] == half // BS
    assert s["remote_link_loaded_blocks"] == len(prompt) // BS - half // BS
    assert s["sched_lower_tier_hit_tokens"] == cached and s["kv_lookup_hits"] == 0
    assert tier(engine, "ssd").wait_idle(30)
    assert observability.snapshot(engine)["ssd_stored_blocks"] >= s["remote_link_loaded_blocks"]  # promoted to the SSD
    assert_no_leaks(engine)
    engine.shutdown(30)


def test_planted_values_are_misses_and_the_prefix_is_recomputed(model, uncached, redis_server, tmp_path):
    prompt = ask(model, "How long do idempotency keys live?")
    a = replica(model, redis_server.url, None)
    a.generate([prompt], GREEDY)
    a.shutdown(30)
    from kvcellar.cache.hashing import block_digests, root_digest

    chain = block_digests(root_digest(a.fingerprint), prompt, BS)
    r = redis_server.client()
    names = [f"kvc:{a.fingerprint}-v{FORMAT_VERSION}:{a.blocks.key(d).hex()}" for d in chain]
    victim = 3
    r.set(names[victim], r.get(names[victim + 1]))  # a real block of this model, in the wrong place
    foreign = f"kvc:other-model-v{FORMAT_VERSION}:{a.blocks.key(chain[0]).hex()}"
    r.set(foreign, r.get(names[0]))  # another namespace

    b = replica(model, redis_server.url, None)
    result = b.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == victim * BS
    assert_same_output(result, uncached(prompt))
    assert observability.snapshot(b)["remote_corrupt_key"] == 1
    b.shutdown(30)


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_redis_that_is_down_degrades_to_compute(model, uncached, tmp_path, scheme):
    prompt = ask(model, "Must a retry reuse the key?")
    engine = replica(model, f"{scheme}://127.0.0.1:{free_port()}", tmp_path / "ssd")
    result = engine.generate([prompt], GREEDY)[0]
    assert_same_output(result, uncached(prompt))
    health = engine.lower.health()
    assert health["remote"]["state"] == "degraded" and health["ssd"]["state"] == "ok"
    error = "RedisClusterException" if scheme == "redis+cluster" else "ConnectionError"
    assert error in str(health["remote"]["last_error"])
    assert observability.snapshot(engine)["remote_guard_call_errors"] == 0  # the tier kept the contract, not the guard
    again = engine.generate([prompt], GREEDY)[0]  # the RAM tier still works
    assert again.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    engine.shutdown(30)


def test_a_full_redis_with_noeviction_drops_writes_and_answers_stay_right(model, uncached, private_redis):
    redis = private_redis(maxmemory="2mb", **{"maxmemory-policy": "noeviction"}).start()  # ~2 fp32 blocks
    engine = replica(model, redis.url, None)
    prompts = [ask(model, f"Question {i}: may a partial refund exceed the capture?") for i in range(3)]
    for prompt in prompts:
        assert_same_output(engine.generate([prompt], GREEDY)[0], uncached(prompt))
    assert tier(engine, "remote").wait_idle(30)
    s, health = observability.snapshot(engine), engine.lower.health()["remote"]
    # writes back off and probe; the state may already be "ok" again between two failed writes
    assert s["remote_dropped_oom"] >= 1 and "maxmemory" in str(health["last_error"])
    engine.blocks.evict_all()  # what did fit is still served, verified
    result = engine.generate([prompts[0]], GREEDY)[0]
    assert_same_output(result, uncached(prompts[0]))
    assert result.num_cached_tokens == observability.snapshot(engine)["remote_link_loaded_blocks"] * BS
    engine.shutdown(30)


def test_a_whole_prefill_chunk_reaches_redis_at_once_with_the_default_queue(model, uncached, redis_server,
                                                                           tmp_path):
    """A 2048-token chunk publishes 128 blocks in one step; with the old default queue (64)
    half of them were dropped, and another replica recomputed them until A evicted them."""
    prompt = (ask(model, "Summarise the section.") * 12)[:2048 + 5]
    a = replica(model, redis_server.url, None, engine_config={"max_prefill_step_tokens": 2048, "kv_cache_gb": 0.25})
    a.generate([prompt], GREEDY)
    assert tier(a, "remote").wait_idle(60)
    stats = observability.snapshot(a)
    assert stats["remote_dropped_queue_full"] == 0 and stats["remote_stored_blocks"] == len(prompt) // BS
    b = replica(model, redis_server.url, None, engine_config={"kv_cache_gb": 0.25})
    result = b.generate([prompt], GREEDY)[0]
    assert result.cached_tokens_by_tier.get("remote") == len(prompt) // BS * BS
    assert_same_output(result, uncached(prompt))
    for engine in (a, b):
        assert engine.shutdown(30)


def test_replicas_share_8bit_kv_through_redis_and_other_settings_never_mix(model, redis_server):
    """Replica B with ``--kv-bits 8`` serves A's 8-bit blocks from Redis: the very KV A
    computed (B's tokens equal A's RAM hit), within tolerance of an uncached 8-bit run. A
    replica with 16-bit or 4-bit KV on the same Redis finds nothing of it and computes."""
    from tests._models import assert_equivalent_output, uncached_runner

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5)
    prompt = ask(model, "Is a refund of an authorized intent allowed?")
    a = replica(model, redis_server.url, None, engine_config={"kv_bits": 8})
    first = a.generate([prompt], params)[0]
    hit = a.generate([prompt], params)[0]  # A's own RAM hit over the stored 8-bit KV
    assert tier(a, "remote").wait_idle(30)
    stored = observability.snapshot(a)["remote_stored_blocks"]
    assert stored >= len(prompt) // BS  # the prompt, and generated blocks too
    assert a.shutdown(30)
    assert_equivalent_output(first, uncached_runner(model, params, kv_bits=8)(prompt), 0.15, 0.3)

    b = replica(model, redis_server.url, None, engine_config={"kv_bits": 8})
    result = b.generate([prompt], params)[0]
    assert result.cached_tokens_by_tier == {"ram": 0, "remote": expected_cached(len(prompt), len(prompt))}
    assert result.token_ids == hit.token_ids and result.logprobs == hit.logprobs
    assert observability.snapshot(b)["remote_corrupt_total"] == 0
    assert_no_leaks(b)
    assert b.shutdown(30)

    for bits in (16, 4):
        other = replica(model, redis_server.url, None, engine_config={"kv_bits": bits})
        assert other.fingerprint != a.fingerprint
        assert other.generate([prompt], params)[0].num_cached_tokens == 0
        assert observability.snapshot(other)["remote_corrupt_total"] == 0  # another key space, not rejected values
        assert other.shutdown(30)
    again = replica(model, redis_server.url, None, engine_config={"kv_bits": 8})  # A's blocks still there
    assert again.generate([prompt], params)[0].cached_tokens_by_tier.get("remote", 0) > 0
    assert again.shutdown(30)


SECRET = b"the secret every replica is given"


def block_keys(engine, prompt: list[int]) -> list[bytes]:
    """The keys of ``prompt``'s whole blocks as ``engine`` names them."""
    from kvcellar.cache.hashing import block_digests, root_digest

    return [engine.blocks.key(d) for d in block_digests(root_digest(engine.fingerprint), prompt, BS)]


def shuffled_forgeries(values: list[bytes]) -> list[bytes]:
    """Each block's header (key, digest, token ids, seal) over the next block's KV, checksums
    recomputed: KV of other text under every key, which passes every check but the seal."""
    hs = header_size_for(BS)
    return [forged(v, values[(i + 1) % len(values)][hs:]) for i, v in enumerate(values)]


def test_forged_blocks_in_redis_are_served_only_to_replicas_without_the_secret(model, uncached, redis_server):
    """The attack of issue 46: whoever can write to the shared Redis puts KV of other text under
    the keys of a prompt (checksums, key, digest and token ids all right). A replica with the
    deployment secret finds no seal it made, serves none of it (counted, deleted) and answers
    as uncached; a replica without it is misled. An unsealed block (a replica that has no
    secret wrote it) is not served to one that has."""
    prompt = ask(model, "Which key scope do idempotency keys have?")
    a = replica(model, redis_server.url, None, secret=SECRET)
    a.generate([prompt], GREEDY)
    assert a.shutdown(30)
    r = redis_server.client()
    names = [tier_key(a, k) for k in block_keys(a, prompt)]
    for name, value in zip(names, shuffled_forgeries([r.get(n) for n in names]), strict=True):
        r.set(name, value)

    misled = replica(model, redis_server.url, None)
    result = misled.generate([prompt], GREEDY)[0]
    assert result.cached_tokens_by_tier["remote"] == expected_cached(len(prompt), len(prompt))
    assert result.logprobs != uncached(prompt).logprobs  # the forgery is KV of other text
    assert misled.shutdown(30)

    b = replica(model, redis_server.url, None, secret=SECRET)
    result = b.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == 0
    assert_same_output(result, uncached(prompt))
    s = observability.snapshot(b)
    assert s["remote_corrupt_seal"] == 1 and s["remote_corrupt_deleted"] == 1 and s["remote_corrupt_total"] == 1
    assert b.shutdown(30)
    seal_at = FIXED_SIZE + 4 * BS + 4
    assert any(r.get(names[0])[seal_at:seal_at + SEAL_SIZE])  # B wrote block 0 again, sealed

    r.flushall()
    unsealed = replica(model, redis_server.url, None)
    unsealed.generate([prompt], GREEDY)
    assert unsealed.shutdown(30)
    c = replica(model, redis_server.url, None, secret=SECRET)
    result = c.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == 0
    assert_same_output(result, uncached(prompt))
    assert observability.snapshot(c)["remote_corrupt_unsealed"] == 1
    assert c.shutdown(30)


def test_forged_block_files_on_a_shared_ssd_are_not_served_with_the_secret(model, uncached, tmp_path):
    """The same attack on a cache directory others can write to: each block file rewritten with
    another block's KV and valid checksums is a counted miss, deleted, with the secret."""
    prompt = ask(model, "How are retries after a timeout made safe?")
    a = replica(model, None, tmp_path / "ssd", secret=SECRET)
    a.generate([prompt], GREEDY)
    assert a.shutdown(30)
    paths = [tier(a, "ssd").layout.block_path(k) for k in block_keys(a, prompt)]
    for path, value in zip(paths, shuffled_forgeries([p.read_bytes() for p in paths]), strict=True):
        path.write_bytes(value)

    misled = replica(model, None, tmp_path / "ssd")
    result = misled.generate([prompt], GREEDY)[0]
    assert result.cached_tokens_by_tier["ssd"] == expected_cached(len(prompt), len(prompt))
    assert result.logprobs != uncached(prompt).logprobs
    assert misled.shutdown(30)

    b = replica(model, None, tmp_path / "ssd", secret=SECRET)
    result = b.generate([prompt], GREEDY)[0]
    assert result.num_cached_tokens == 0
    assert_same_output(result, uncached(prompt))
    # After the writer drained: storing the recomputed blocks checks each suspect file first, so
    # a forgery no read reached is counted and deleted there, on the writer's thread.
    assert b.shutdown(30)
    s = observability.snapshot(b)
    assert 1 <= s["ssd_corrupt_seal"] == s["ssd_corrupt_deleted"] == s["ssd_corrupt_total"] <= len(paths)
    again = replica(model, None, tmp_path / "ssd", secret=SECRET)  # B wrote what it deleted, sealed
    result = again.generate([prompt], GREEDY)[0]
    assert result.cached_tokens_by_tier["ssd"] >= BS
    assert_same_output(result, uncached(prompt))
    assert again.shutdown(30)


def test_a_secret_rotation_keeps_the_cache_and_cache_verify_checks_the_seals(model, uncached, tmp_path, capsys):
    """Rotating the secret: replicas given the new secret and the old one as previous read what
    the old one sealed and seal with the new; once the old one is dropped its blocks are
    counted misses. ``kvcellar cache verify`` with the secrets says how many blocks a previous
    secret still seals (when it can go) and finds a forged file, which it deletes."""
    from kvcellar.cli import main

    new = b"the secret after the rotation!"
    old_prompt = ask(model, "Who may approve a refund?")
    new_prompt = chat_ids(model, "Who may roll back a deploy?", "Deploy handbook, release team. " * 12)
    a = replica(model, None, tmp_path / "ssd", secret=SECRET)
    a.generate([old_prompt], GREEDY)
    assert a.shutdown(30)
    old_blocks = len(list((tmp_path / "ssd").rglob("*.kvb")))

    rotating = replica(model, None, tmp_path / "ssd", secret=CacheSecret(new, (SECRET,)))
    results = rotating.generate([old_prompt, new_prompt], GREEDY)
    assert results[0].cached_tokens_by_tier["ssd"] == expected_cached(len(old_prompt), len(old_prompt))
    assert_same_output(results[0], uncached(old_prompt))
    assert_same_output(results[1], uncached(new_prompt))
    assert observability.snapshot(rotating)["ssd_corrupt_total"] == 0
    assert rotating.shutdown(30)

    secrets = tmp_path / "secret"
    secrets.write_bytes(new)
    previous = tmp_path / "previous"
    previous.write_bytes(SECRET + b"\n")
    kv = tmp_path / "ssd"

    def verify(*args: str) -> dict[str, Any]:
        assert main(["cache", "verify", "--json", "--cache-dir", str(tmp_path), *args]) in (0, 1)
        return json.loads(capsys.readouterr().out)["namespaces"][0]

    (tmp_path / "kv").symlink_to(kv)  # ``kvcellar cache`` reads <cache-dir>/kv
    rotation = verify("--keep", "--cache-secret-file", str(secrets), "--cache-previous-secrets-file", str(previous))
    assert rotation["seals_checked"] and rotation["sealed_by_previous_secret"] == old_blocks
    assert rotation["ok"] == rotation["checked"] and not rotation["bad"]
    unchecked = verify("--keep")
    assert not unchecked["seals_checked"] and unchecked["ok"] == unchecked["checked"]

    paths = [tier(a, "ssd").layout.block_path(k) for k in block_keys(a, new_prompt)]  # sealed with the new one
    paths[0].write_bytes(shuffled_forgeries([p.read_bytes() for p in paths[:2]])[0])
    dropped = verify("--cache-secret-file", str(secrets))  # the old secret dropped: its blocks are bad too
    assert dropped["bad"] == {"seal": old_blocks + 1} and dropped["deleted"] == old_blocks + 1

    after = replica(model, None, tmp_path / "ssd", secret=new)
    result = after.generate([new_prompt], GREEDY)[0]
    assert_same_output(result, uncached(new_prompt))
    assert after.shutdown(30)


@needs_native
def test_a_forged_snapshot_in_redis_is_not_resumed_from_with_the_secret(redis_server):
    """A hybrid model's recurrent-state snapshot forged the same way (another state under its
    key, checksums right): a replica without the secret resumes from it and answers otherwise;
    one with the secret loads the blocks, refuses the snapshot (counted) and answers as uncached."""
    import numpy as np

    loaded = served_file(qwen35.folder(), "int8")
    prompt = qwen35.prompts(loaded)[0]
    reference = uncached_runner(loaded, qwen35.PARAMS)(prompt)
    a = replica(loaded, redis_server.url, None, engine_config={"max_step_tokens": 64}, secret=SECRET)
    a.generate([prompt], qwen35.PARAMS)
    assert a.shutdown(30)
    r = redis_server.client()
    snapshots = r.keys(f"kvc:{a.fingerprint}.snapshots-v{FORMAT_VERSION}:*")
    assert snapshots
    hs = header_size_for(BS)
    for name in snapshots:
        value = r.get(name)
        state = np.frombuffer(value[hs:], dtype=np.float32) * np.float32(0.5)  # another state
        r.set(name, forged(value, state.tobytes()))

    misled = replica(loaded, redis_server.url, None)
    result = misled.generate([prompt], qwen35.PARAMS)[0]
    assert result.cached_tokens_by_tier["remote"] == qwen35.resumable(len(prompt))
    assert result.logprobs != reference.logprobs
    assert misled.shutdown(30)

    b = replica(loaded, redis_server.url, None, secret=SECRET)
    result = b.generate([prompt], qwen35.PARAMS)[0]
    assert_identical_output(result, reference)
    s = observability.snapshot(b)
    assert s["snapshots_remote_corrupt_seal"] >= 1 and s["remote_link_snapshots_loaded"] == 0
    assert b.shutdown(30)


def tier_key(engine, key: bytes) -> str:
    return f"kvc:{engine.fingerprint}-v{FORMAT_VERSION}:{key.hex()}"
