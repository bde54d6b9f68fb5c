"""A server set up for a team (README, "Running it for a team"): several API keys
(``--api-key-file``), each key's prefix cache its own, so no caller's ``cached_tokens`` says
anything about another's prompts; sharing is explicit (``--shared-cache-keys``,
``X-Kvcellar-Cache: shared``); a stored response resolves only for the key that stored it; bad
key settings stop the server before it starts; the names and origins it was given are answered
(``--allowed-hosts``, ``--allowed-origins`` with CORS), others refused."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvcellar.cli import main
from kvcellar.server.tenants import TurnTaking
from tests._models import stand_in_args
from tests.helpers import ServerProcess, wait_until

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"
DOC = ("Section 4.2. A payment intent moves from created to authorized to captured; a refund references a "
       "captured intent and may be partial. Idempotency keys are scoped per merchant. ") * 4


@pytest.fixture(scope="module")
def tenants_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys"
    keys.write_text(f"# name key\nalice {ALICE}\nbob {BOB}\n\ncarol {CAROL}\n")
    server = ServerProcess(tmp / "cache", *stand_in_args(), "--api-key-file", str(keys),
                           "--shared-cache-keys", "carol", "--allowed-hosts", "kvc.internal",
                           "--allowed-origins", "https://app.example, http://localhost:5173",
                           "--max-inflight-per-key", "2").start()
    try:
        yield server
    finally:
        server.stop()


def chat(server: ServerProcess, key: str, question: str, **headers: str) -> int:
    """The cached prompt tokens of one chat request under ``key`` (the system prompt starts with
    the question: each test its own prefix)."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}", **headers},
                   json={"model": "stand-in", "max_tokens": 2,
                         "messages": [{"role": "system", "content": question + " " + DOC},
                                      {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_keys_prompt_is_no_hit_for_another_key(tenants_server: ServerProcess) -> None:
    assert chat(tenants_server, ALICE, "Is a partial refund allowed?") == 0
    assert chat(tenants_server, ALICE, "Is a partial refund allowed?") > 0  # alice's own cache works
    assert chat(tenants_server, BOB, "Is a partial refund allowed?") == 0  # the same prompt: nothing of alice's
    assert chat(tenants_server, BOB, "Is a partial refund allowed?") > 0


def test_sharing_is_explicit(tenants_server: ServerProcess) -> None:
    shared = {"X-Kvcellar-Cache": "shared"}
    assert chat(tenants_server, CAROL, "Which scope do idempotency keys have?") == 0
    assert chat(tenants_server, ALICE, "Which scope do idempotency keys have?") == 0  # alice's own cache
    assert chat(tenants_server, ALICE, "Which scope do idempotency keys have?", **shared) > 0  # carol shares
    assert chat(tenants_server, BOB, "Which scope do idempotency keys have?", **shared) > 0


def test_a_stored_response_resolves_only_for_the_key_that_stored_it(tenants_server: ServerProcess) -> None:
    def respond(key: str, **fields: object) -> httpx.Response:
        return httpx.post(tenants_server.url + "/v1/responses", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "stand-in", "input": "Hello there.", "max_output_tokens": 2, **fields},
                          timeout=120)

    first = respond(ALICE)
    assert first.status_code == 200, first.text
    again = respond(ALICE, previous_response_id=first.json()["id"])
    assert again.status_code == 200, again.text
    stolen = respond(BOB, previous_response_id=first.json()["id"])
    assert stolen.status_code == 404 and stolen.json()["error"]["code"] == "previous_response_not_found"


def test_one_key_cannot_take_every_slot(tenants_server: ServerProcess) -> None:
    """``--max-inflight-per-key 2``: alice's third request while two of hers stream is a 429 in
    the API's error shape; bob is served meanwhile; once hers end, alice is served again."""
    url = tenants_server.url + "/v1/chat/completions"

    def ask(key: str, **fields: object) -> dict[str, object]:
        return {"headers": {"Authorization": f"Bearer {key}"}, "json": {
            "model": "stand-in", "max_tokens": 2, "messages": [{"role": "user", "content": "Count to a thousand."}],
            **fields}}

    long = {"max_tokens": 4000, "ignore_eos": True, "stream": True}
    with (httpx.Client(timeout=120) as client, client.stream("POST", url, **ask(ALICE, **long)) as one,
          client.stream("POST", url, **ask(ALICE, **long)) as two):
        assert one.status_code == two.status_code == 200
        lines = [one.iter_lines(), two.iter_lines()]  # held: a dropped iterator closes its stream
        assert all(next(it).startswith("data: ") for it in lines)  # both generating
        third = client.post(url, **ask(ALICE))
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["code"] == "rate_limit_exceeded"
        assert client.post(url, **ask(BOB)).status_code == 200
        claude = client.post(tenants_server.url + "/v1/messages", headers={"x-api-key": ALICE}, json={
            "model": "stand-in", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert claude.status_code == 429 and claude.json()["error"]["type"] == "rate_limit_error"
    wait_until(lambda: httpx.post(url, timeout=120, **ask(ALICE)).status_code == 200, timeout=60,
               what="alice's slots to come back once her streams closed")


def test_health_details_and_metrics_are_for_key_holders(tenants_server: ServerProcess) -> None:
    url = tenants_server.url
    assert set(httpx.get(url + "/health", timeout=30).json()) == {"status", "pid"}
    assert "tiers" in httpx.get(url + "/health", headers={"x-api-key": BOB}, timeout=30).json()
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {CAROL}"}, timeout=30).status_code == 200


@pytest.mark.parametrize(("setup", "needle"), [
    (lambda tmp, env: env.setenv("KVCELLAR_API_KEY", ""), "api_key is empty"),
    (lambda tmp, env: env.setenv("KVCELLAR_API_KEY_FILE", str(tmp / "missing")), "No such file"),
    (lambda tmp, env: (tmp / "k").write_text("a x\na y\n") and env.setenv("KVCELLAR_API_KEY_FILE", str(tmp / "k")),
     "used twice"),
    (lambda tmp, env: env.setenv("KVCELLAR_SHARED_CACHE_KEYS", "nobody"), "needs API keys"),
])
def test_bad_key_settings_are_clear_errors(setup, needle, tmp_path: Path, monkeypatch, capsys) -> None:
    setup(tmp_path, monkeypatch)
    assert main(["serve", "--cache-dir", str(tmp_path / "cache")]) == 2
    assert needle in capsys.readouterr().err


def test_allowed_hosts_and_origins_are_answered_with_cors(tenants_server: ServerProcess) -> None:
    server = tenants_server
    assert httpx.get(server.url + "/health", headers={"Host": "kvc.internal:80"}, timeout=30).status_code == 200
    assert httpx.get(server.url + "/health", headers={"Host": "other.internal"}, timeout=30).status_code == 403
    preflight = httpx.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    listed = httpx.get(server.url + "/v1/models", timeout=30,
                       headers={"Origin": "http://localhost:5173", "Authorization": f"Bearer {ALICE}"})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"},
                     timeout=30).status_code == 403


def test_the_tokenizer_thread_takes_tenants_in_turn() -> None:
    """Alice's three queued jobs and bob's one, behind a running job: bob's runs second, not
    last; a job cancelled before it starts never runs; closing cancels what waits."""
    worker = TurnTaking("test-turns")
    ran: list[str] = []
    gate = threading.Event()
    first = worker.submit(None, gate.wait)
    jobs = [worker.submit(who, lambda name=f"{who}{i}": ran.append(name))
            for who, i in [("alice", 1), ("alice", 2), ("alice", 3), ("bob", 1)]]
    dropped = worker.submit("carol", lambda: ran.append("carol"))
    assert dropped.cancel()
    gate.set()
    for job in [first, *jobs]:
        job.result(timeout=30)
    assert ran == ["alice1", "bob1", "alice2", "alice3"]
    gate.clear()
    worker.submit(None, gate.wait)
    waiting = worker.submit("bob", lambda: ran.append("late"))
    worker.close()
    gate.set()
    assert waiting.cancelled() and ran[-1] == "alice3"
