"""A hybrid model's snapshots in the SSD tier (the Redis tier's case is in
``tests/remote/test_engine_remote.py``): kept beside the blocks, in a namespace of their own, in
the same verified format; read back after a restart for the same prompt and for the next turn
of a conversation; a damaged snapshot deleted and the prefix computed again; RAM's snapshots
stored when evicted under the evict-only policy, and at shutdown; none of the warm-up's kept; a server killed
while they are written serves nothing half-written. Every output equals, to the bit, the
uncached engine's under the native kernels (int8 weights)."""

from __future__ import annotations

import concurrent.futures
import signal
from pathlib import Path
from typing import Any

import pytest

from kvcellar.engine import SamplingParams
from kvcellar.runtime import SNAPSHOT_NAMESPACE
from tests._models import (
    assert_identical_output,
    assert_no_leaks,
    chat_ids,
    needs_native,
    qwen35_gguf,
    served_file,
    tiered,
    uncached_runner,
)
from tests.helpers import ServerProcess, verified_namespaces, wait_until
from tests.integration.test_qwen35 import PARAMS, SYSTEM, folder, prompts, resumable

pytestmark = needs_native
REPLY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def loaded():
    return served_file(folder(), "int8")


def snapshot_files(root: Path) -> list[Path]:
    return sorted(p for d in root.glob(f"*{SNAPSHOT_NAMESPACE}-v*") for p in d.rglob("*.kvb"))


def ssd(engine) -> dict[str, float]:
    return engine.lower.stats_by_tier()["ssd"]


def test_a_restart_resumes_the_prompt_and_the_next_turn_from_snapshots_on_disk(loaded, tmp_path):
    uncached = uncached_runner(loaded, REPLY)
    first = prompts(loaded)[0]
    engine = tiered(loaded, tmp_path, max_step_tokens=64)
    reply = engine.generate([first], REPLY)[0]
    assert_identical_output(reply, uncached(first))
    assert ssd(engine)["ssd_link_snapshots_stored"] == 2  # where the prefill ended, where the reply did
    assert engine.shutdown(30)
    assert len(snapshot_files(tmp_path)) == 2

    again = tiered(loaded, tmp_path, max_step_tokens=64)
    got = again.generate([first], REPLY)[0]
    assert got.num_cached_tokens == resumable(len(first))
    assert got.cached_tokens_by_tier.get("ssd") == resumable(len(first))
    assert_identical_output(got, uncached(first))
    assert ssd(again)["ssd_link_snapshots_loaded"] == 1
    assert again.shutdown(30)

    computed = len(first) + len(reply.token_ids) - 1  # the last sampled token is never fed
    turn = first + reply.token_ids + chat_ids(loaded, "And the one after it?")[1:]
    later = tiered(loaded, tmp_path, max_step_tokens=64)
    got = later.generate([turn], REPLY)[0]
    assert got.num_cached_tokens == computed // 16 * 16 > len(first)
    assert_identical_output(got, uncached(turn))
    assert later.scheduler.cache.states.stats.resume_distance_tokens == 0
    assert_no_leaks(later)
    assert later.shutdown(30)


def test_a_damaged_snapshot_is_deleted_and_the_prefix_computed_again(loaded, tmp_path):
    uncached = uncached_runner(loaded, PARAMS)
    prompt = prompts(loaded)[1]
    engine = tiered(loaded, tmp_path)
    engine.generate([prompt], PARAMS)
    assert engine.shutdown(30)
    files = snapshot_files(tmp_path)
    assert len(files) == 2
    for path in files:  # one bit of each state's payload
        with path.open("r+b") as f:
            f.seek(-100, 2)
            byte = f.read(1)
            f.seek(-100, 2)
            f.write(bytes([byte[0] ^ 0x01]))

    again = tiered(loaded, tmp_path)
    got = again.generate([prompt], PARAMS)[0]
    assert got.num_cached_tokens == 0  # the prompt-end snapshot failed; the reply's is past the prompt
    assert_identical_output(got, uncached(prompt))
    stats = ssd(again)
    assert stats["ssd_link_snapshots_load_failed"] == 1 and stats["snapshots_ssd_corrupt_checksum"] == 1
    assert again.scheduler.cache.states.stats.snapshots_loaded == 1  # the one attempt, then none
    assert_no_leaks(again)
    assert again.shutdown(30)
    assert len(snapshot_files(tmp_path)) == 2  # the damaged one deleted, the prompt's kept anew


def test_without_its_blocks_a_snapshot_on_disk_is_not_used(loaded, tmp_path):
    uncached = uncached_runner(loaded, PARAMS)
    prompt = prompts(loaded)[2]
    engine = tiered(loaded, tmp_path)
    engine.generate([prompt], PARAMS)
    assert engine.shutdown(30)
    blocks = sorted(p for p in tmp_path.rglob("*.kvb") if p not in set(snapshot_files(tmp_path)))
    for path in blocks:
        path.unlink()
    again = tiered(loaded, tmp_path)
    got = again.generate([prompt], PARAMS)[0]
    assert got.num_cached_tokens == 0
    assert_identical_output(got, uncached(prompt))
    assert ssd(again).get("ssd_link_snapshots_lookups", 0) == 0  # no block held: no snapshot asked for
    assert again.shutdown(30)


def test_evict_only_stores_the_snapshots_ram_drops_and_resumes_from_them(loaded, tmp_path):
    uncached = uncached_runner(loaded, PARAMS)
    asked = prompts(loaded)
    engine = tiered(loaded, tmp_path, policy="evict_only", state_snapshots=1)
    engine.generate([asked[0]], PARAMS)
    assert ssd(engine).get("ssd_link_snapshots_stored", 0) == 1  # the prompt's, when the reply's took its room
    engine.generate([asked[1]], PARAMS)  # evicts the first prompt's last snapshot too
    engine.generate([chat_ids(loaded, "Something else entirely.")], PARAMS)
    got = engine.generate([asked[0]], PARAMS)[0]
    assert got.num_cached_tokens == resumable(len(asked[0]))
    assert_identical_output(got, uncached(asked[0]))
    assert ssd(engine)["ssd_link_snapshots_loaded"] == 1
    assert_no_leaks(engine)
    assert engine.shutdown(30)


def test_evict_only_takes_what_ram_holds_at_shutdown_and_a_restart_resumes_from_it(loaded, tmp_path):
    uncached = uncached_runner(loaded, REPLY)
    first = prompts(loaded)[0]
    engine = tiered(loaded, tmp_path, policy="evict_only")
    engine.generate([first], REPLY)
    engine.lower.tiers[0].tier.wait_idle(30)
    assert snapshot_files(tmp_path) == []  # RAM evicted nothing
    assert engine.shutdown(30)
    assert len(snapshot_files(tmp_path)) == 2  # where the prefill ended, where the reply did

    again = tiered(loaded, tmp_path, policy="evict_only")
    got = again.generate([first], REPLY)[0]
    assert got.num_cached_tokens == resumable(len(first))
    assert_identical_output(got, uncached(first))
    assert ssd(again)["ssd_link_snapshots_loaded"] == 1
    assert again.shutdown(30)


def test_warm_up_leaves_no_snapshot_in_ram_or_on_disk(loaded, tmp_path):
    from kvcellar.engine.warmup import warm_up

    engine = tiered(loaded, tmp_path, state_snapshots=2)
    warm_up(engine, budget_s=60)
    states = engine.scheduler.cache.states
    assert states.stats.snapshots == 0 and states.num_free == states.slots
    engine.generate([prompts(loaded)[0]], PARAMS)  # evicts nothing of the warm-up's: it kept none
    assert engine.shutdown(30)
    assert len(snapshot_files(tmp_path)) == 2  # this prompt's own two


def test_sigkill_while_snapshots_are_written_serves_nothing_half_written(tmp_path, models_dir):
    """A served qwen35 GGUF (the default weights) killed while a dozen prompts' blocks and
    snapshots are being written: the next start serves the prompts from what was finished (each
    reply what the prompt computed cold gives), and every entry left on disk, snapshots
    included, verifies."""
    cache = tmp_path / "cache"
    asked = [f"Incident {i}: volume vol-{i:03d} reports I/O errors on node {i % 5}. Next step?" for i in range(12)]

    def serve() -> ServerProcess:
        return ServerProcess(cache, "--model", str(qwen35_gguf()), "--weights", "auto", models_dir=models_dir)

    def ask(server: ServerProcess, question: str, **extra: Any) -> Any:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return server.client(timeout=120).chat.completions.create(
            model="tiny-qwen35", messages=messages, max_tokens=24, temperature=0, **extra)

    server = serve().start()
    try:
        pool = concurrent.futures.ThreadPoolExecutor(len(asked))
        for q in asked:
            pool.submit(ask, server, q)  # it dies mid-way (the point): the futures' errors are dropped
        wait_until(lambda: server.health()["tiers"]["ssd"]["counters"].get("snapshots_ssd_stored_blocks", 0) >= 4,
                   timeout=180, interval=0.01, what="snapshots to reach the disk")
    finally:
        server.signal(signal.SIGKILL)
        server.wait_exit(30)
        pool.shutdown(wait=False)

    final = serve().start()
    try:
        assert final.health()["last_shutdown_clean"] is False
        replies = [ask(final, q) for q in asked]  # which prompts' entries were finished is the race's
        cold = [ask(final, q, extra_body={"cache_salt": f"cold {i}"}) for i, q in enumerate(asked)]
        for got, want in zip(replies, cold, strict=True):
            assert got.choices[0].message.content == want.choices[0].message.content
            assert want.usage.prompt_tokens_details.cached_tokens == 0
        assert sum(r.usage.prompt_tokens_details.cached_tokens for r in replies) > 0
        counters = final.health()["tiers"]["ssd"]["counters"]
        assert counters["ssd_link_snapshots_loaded"] >= 1
        assert counters["ssd_corrupt_total"] == 0 and counters["snapshots_ssd_corrupt_total"] == 0
    finally:
        assert final.stop() == 0

    assert len(verified_namespaces(cache)) == 2  # the blocks' and the snapshots'
