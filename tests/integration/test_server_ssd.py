"""The persistent tier across real server processes: clean restarts and SIGKILLs.

Outputs after every restart are compared with a cache-disabled in-process run of the same
prompt (greedy, fp32): a corrupt or misplaced block would change them. The servers serve the
stand-in (``tests._models.server_stand_in``: the embedded model's KV geometry and tokenizer,
a tenth of its compute).
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys

import pytest

from kvcellar.engine import SamplingParams
from tests._models import SERVER_STAND_IN, chat_ids, served_stand_in, stand_in_args, uncached_runner
from tests.helpers import ServerProcess, kvcellar_command, verified_namespaces, wait_until

pytestmark = pytest.mark.slow

BS = 16
MAX_TOKENS = 8
SYSTEM = ("You are the on-call assistant for a storage team. Answer with the exact command to run and "
          "one sentence of why. Never suggest deleting data without a backup. " * 4)


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def model():
    return served_stand_in()


def stand_in_server(cache, *args: str, models_dir) -> ServerProcess:
    return ServerProcess(cache, *stand_in_args(), *args, models_dir=models_dir)


@pytest.fixture(scope="module")
def reference(model):
    """The uncached greedy reply to a question, from an in-process engine."""
    run = uncached_runner(model, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return lambda question: run(chat_ids(model, question, SYSTEM)).text


def ask(server: ServerProcess, question: str):
    return server.client().chat.completions.create(model=SERVER_STAND_IN, messages=messages(question),
                                                   max_tokens=MAX_TOKENS, temperature=0)


def test_restart_serves_the_prefix_from_disk(tmp_path, models_dir, reference):
    cache = tmp_path / "cache"
    first = stand_in_server(cache, models_dir=models_dir).start()
    try:
        a = ask(first, "The disk is 95% full. What do I check first?")
        assert a.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert first.stop() == 0

    second = stand_in_server(cache, models_dir=models_dir).start()
    try:
        health = second.health()
        assert health["last_shutdown_clean"] is True and health["last_shutdown_reason"] is None
        assert health["tiers"]["ssd"]["state"] == "ok"
        b = ask(second, "The disk is 95% full. What do I check first?")
        prompt_tokens = b.usage.prompt_tokens
        assert b.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - BS
        assert b.choices[0].message.content == a.choices[0].message.content
        assert b.choices[0].message.content == reference("The disk is 95% full. What do I check first?")
        loaded = second.health()["tiers"]["ssd"]["counters"]["ssd_load_hits"]
        assert loaded * BS == b.usage.prompt_tokens_details.cached_tokens

        c = ask(second, "A replica is lagging by an hour. What now?")  # shares the system prompt only
        assert 0 < c.usage.prompt_tokens_details.cached_tokens < c.usage.prompt_tokens - BS
        assert c.choices[0].message.content == reference("A replica is lagging by an hour. What now?")
    finally:
        assert second.stop() == 0


def questions(round_no: int) -> list[str]:
    """Distinct prompts per round, so every round writes new blocks."""
    return [f"Incident {round_no}-{i}: volume vol-{i:03d} reports I/O errors on node {i % 5}. Next step?"
            for i in range(12)]


def _fire(server: ServerProcess, questions: list[str]) -> None:
    """Send every question concurrently; the server may die mid-way (that is the point)."""
    def one(q: str) -> None:
        try:
            server.client(timeout=60).chat.completions.create(
                model=SERVER_STAND_IN, messages=messages(q), max_tokens=48, temperature=0)
        except Exception:
            pass

    pool = concurrent.futures.ThreadPoolExecutor(len(questions))
    for q in questions:
        pool.submit(one, q)
    pool.shutdown(wait=False)


def test_sigkill_during_writes_never_serves_a_corrupt_block(tmp_path, models_dir, reference):
    cache = tmp_path / "cache"
    stored_before_kill = []
    for round_no, durability in enumerate(["best_effort", "persistent"]):
        server = stand_in_server(cache, "--ssd-durability", durability, models_dir=models_dir).start()
        try:
            health = server.health()
            if round_no > 0:
                assert health["last_shutdown_clean"] is False
                assert health["tiers"]["ssd"]["counters"]["ssd_recovered_unclean_sessions"] >= 1
            # write-heavy: many distinct long prompts at once; kill while blocks are being written
            _fire(server, questions(round_no))
            stored = wait_until(
                lambda s=server: (n := s.health()["tiers"]["ssd"]["counters"]["ssd_stored_blocks"]) >= 20 and n,
                timeout=180, interval=0.01, what="blocks to reach the disk")
            stored_before_kill.append(stored)
        finally:
            server.signal(signal.SIGKILL)
            server.wait_exit(30)

    final = stand_in_server(cache, models_dir=models_dir).start()
    try:
        health = final.health()
        assert health["last_shutdown_clean"] is False
        assert "killed or crashed" in health["last_shutdown_reason"]
        ssd = health["tiers"]["ssd"]["counters"]
        assert ssd["ssd_recovered_unclean_sessions"] >= 1
        cached = 0
        for q in [*questions(0)[:3], *questions(1)[:3]]:
            r = ask(final, q)
            assert r.choices[0].message.content == reference(q), q
            cached += r.usage.prompt_tokens_details.cached_tokens
        assert cached > 0, "blocks written before the kills are reused"
        ssd = final.health()["tiers"]["ssd"]["counters"]
        assert ssd["ssd_corrupt_total"] == 0, "a killed writer never leaves a final file that fails its checks"
    finally:
        assert final.stop() == 0

    namespaces = verified_namespaces(cache)
    assert len(namespaces) == 1
    print(f"blocks stored before each kill: {stored_before_kill}; verified {namespaces[0]['ok']}", file=sys.stderr)


def test_cache_clear_under_a_running_server_does_not_block_rewrites(tmp_path, models_dir, reference):
    """After ``kvcellar cache clear`` the server's table still lists the deleted blocks.
    A prefix recomputed after the clear must be written again, not skipped as present."""
    cache = tmp_path / "cache"
    question = "The disk is 95% full. What do I check first?"
    # A pool of ~24 fp32 blocks (15 per filler prompt).
    server = stand_in_server(cache, "--kv-cache-gb", "0.017", "--dtype", "float32", models_dir=models_dir).start()
    try:
        first = ask(server, question)
        client = server.client()
        for i in range(3):  # unrelated prompts push the first one out of RAM (it stays on disk)
            client.completions.create(model=SERVER_STAND_IN, prompt=f"Filler {i}: " + "tick tock " * 120, max_tokens=1)
        server.wait_idle()
        assert wait_until(lambda: server.health()["tiers"]["ssd"]["writer_queue_depth"] == 0, timeout=60)
        clear = subprocess.run([*kvcellar_command(), "cache", "clear", "--cache-dir", str(cache)],
                               capture_output=True, text=True, timeout=120)
        assert clear.returncode == 0, clear.stderr
        assert not list((cache / "kv").rglob("*.kvb"))
        before = server.health()["tiers"]["ssd"]["counters"]
        again = ask(server, question)  # a RAM miss and a disk miss: recomputed
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].message.content == reference(question) == first.choices[0].message.content
        server.wait_idle()
        assert wait_until(lambda: server.health()["tiers"]["ssd"]["writer_queue_depth"] == 0
                          and server.health()["tiers"]["ssd"]["ssd"]["writer_in_flight"] == 0, timeout=60)
        after = server.health()["tiers"]["ssd"]["counters"]
        rewritten = after["ssd_stored_blocks"] - before["ssd_stored_blocks"]
        assert rewritten >= again.usage.prompt_tokens // BS - 1, (before, after)
        assert after["ssd_store_skipped_existing"] == before["ssd_store_skipped_existing"]
    finally:
        assert server.stop() == 0


def test_restart_with_8bit_kv_serves_its_blocks_and_another_setting_starts_empty(tmp_path, models_dir, model):
    """``kvcellar serve --kv-bits 8``: /health shows the setting and what a token costs; a
    start with ``--kv-bits 4`` in between is another cache (empty) that leaves the 8-bit one
    intact: the next 8-bit start serves the 8-bit blocks from disk with the uncached 8-bit reply."""
    question = "The disk is 95% full. What do I check first?"
    reference = uncached_runner(model, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), kv_bits=8)
    want = reference(chat_ids(model, question, SYSTEM)).text
    cache = tmp_path / "cache"

    def served(bits: int):
        server = stand_in_server(cache, "--kv-bits", str(bits), models_dir=models_dir).start()
        try:
            engine = server.health()["engine"]
            reply = ask(server, question)
            assert server.health()["tiers"]["ssd"]["state"] == "ok"
        finally:
            assert server.stop() == 0
        return engine, reply

    engine, first = served(8)
    assert engine["engine_kv_bits"] == 8 and engine["engine_kv_group_size"] == 64
    assert engine["engine_kv_bytes_per_token"] <= 0.55 * 46_080  # float32 KV: 30 layers x 2 x 3 heads x 64 x 4
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].message.content == want
    eight = sorted((cache / "kv").rglob("*.kvb"))
    assert eight

    engine, other = served(4)
    assert engine["engine_kv_bits"] == 4
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert set(eight) <= set((cache / "kv").rglob("*.kvb"))

    _, back = served(8)
    assert back.usage.prompt_tokens_details.cached_tokens >= back.usage.prompt_tokens - BS
    assert back.choices[0].message.content == want
