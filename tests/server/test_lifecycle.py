"""API-key auth and graceful shutdown, on servers of their own (the session server has no key
and must outlive every test)."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import MODEL, ServerProcess, wait_until

pytestmark = pytest.mark.slow

API_KEY = "sk-kvcellar-test-key"
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("keyed"), "--shutdown-timeout", "8", api_key=API_KEY,
                         models_dir=models_dir).start()
    try:
        yield proc
    finally:
        proc.kill()


def test_api_key_accepted(keyed_server: ServerProcess) -> None:
    client = keyed_server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert r.usage.completion_tokens == 3
    raw = httpx.post(keyed_server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                     headers={"Authorization": f"bearer {API_KEY}"}, timeout=60)
    assert raw.status_code == 200  # the scheme is case-insensitive


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}], ids=["none", "wrong", "no-scheme",
                                                                                  "basic"])
def test_api_key_rejected(keyed_server: ServerProcess, headers: dict[str, str]) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
        r = httpx.request(method, keyed_server.url + path, headers=headers, json={"bad": "body"}, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"


def test_api_key_rejected_by_openai_client(keyed_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=keyed_server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert exc.value.status_code == 401


def test_without_a_key_health_says_only_its_status_and_metrics_are_refused(keyed_server: ServerProcess) -> None:
    """Load balancers probe /health without a key: it answers, with nothing of the cache in it."""
    bare = httpx.get(keyed_server.url + "/health")
    assert bare.status_code == 200 and set(bare.json()) == {"status", "pid"}
    assert "tiers" in httpx.get(keyed_server.url + "/health", headers=keyed_server.headers()).json()
    assert httpx.get(keyed_server.url + "/metrics").status_code == 401
    assert httpx.get(keyed_server.url + "/metrics", headers=keyed_server.headers()).status_code == 200


def _stream(server: ServerProcess, max_tokens: int, streaming: threading.Event) -> tuple[int, list[str]]:
    """The stream's data lines; ``streaming`` is set at the first."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=120) as r:
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                streaming.set()
        return r.status_code, lines


def test_sigterm_drains_then_exits_0(keyed_server: ServerProcess) -> None:
    """In flight at SIGTERM: a short request finishes normally, a long one is cancelled at
    the shutdown deadline with an in-stream error; meanwhile new requests get 503. The signal
    goes when both have streamed a first chunk, with most of the short one's 64 tokens to go (a
    poll of /health for both running missed a short one that finished between two polls)."""
    short_streaming, long_streaming = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        short = pool.submit(_stream, keyed_server, 64, short_streaming)
        long = pool.submit(_stream, keyed_server, 4000, long_streaming)
        assert short_streaming.wait(60) and long_streaming.wait(60)
        keyed_server.signal(signal.SIGTERM)
        draining = wait_until(lambda: _draining(keyed_server), timeout=10, what="/health to report draining")
        assert draining["status"] == "draining"
        refused = keyed_server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        short_status, short_events = short.result(timeout=60)
        long_status, long_events = long.result(timeout=60)
    assert short_status == 200 and short_events[-1] == "[DONE]"
    finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, short_events[:-1]) if c["choices"]]
    assert finishes[-1] == "length"
    assert long_status == 200 and long_events[-1] == "[DONE]"
    cut = json.loads(long_events[-2])["error"]
    assert cut["code"] == "shutting_down" and "request was cancelled" in cut["message"]
    assert keyed_server.wait_exit(timeout=60) == 0
    assert "drained" in keyed_server.log_tail()


def _draining(server: ServerProcess) -> dict[str, Any] | None:
    r = httpx.get(server.url + "/health", timeout=5)
    return r.json() if r.status_code == 503 else None


def test_sigint_finishes_inflight_request_and_exits_0(tmp_path: Path, models_dir: Path) -> None:
    server = ServerProcess(tmp_path, models_dir=models_dir).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            job = pool.submit(server.post, "/v1/chat/completions",
                              {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "ignore_eos": True})
            wait_until(lambda: server.health()["running"] == 1, timeout=60, what="the request to run")
            server.signal(signal.SIGINT)
            r = job.result(timeout=60)
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 16
        assert server.wait_exit(timeout=60) == 0
    finally:
        server.kill()
