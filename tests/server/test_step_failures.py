"""Over HTTP: a request whose engine step fails gets a 500 in its API's error shape, the
requests beside it finish as in a clean run, /metrics counts the failure, and steps failing
in a row turn /health 503 until one succeeds (issue 24). The fault is a forward that raises
for one request's input (tests/engine/test_step_failures.py's runner), in a real uvicorn
server on 127.0.0.1 driven by the official clients."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvcellar.server.app import create_app
from kvcellar.server.config import ServerConfig
from tests.engine.test_step_failures import POISONED, poisoned_engine
from tests.helpers import InProcessServer

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Give me a name for a grey cat."]
MODEL = "kvcellar-test"


@pytest.fixture(scope="module")
def served(model: Any) -> Iterator[tuple[InProcessServer, Any]]:
    engine = poisoned_engine(model, unhealthy_after_failed_steps=2)
    app = create_app(engine, ServerConfig(served_model_name=MODEL))
    with InProcessServer(app) as server:
        yield server, engine


def chat(server: InProcessServer, prompt: str, **kw: Any) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=16, temperature=0, **kw)
    return out.choices[0].message.content or ""


def test_failed_request_gets_a_500_and_the_others_finish_as_in_a_clean_run(served):
    server, engine = served
    clean = [chat(server, p) for p in PROMPTS]
    failures = engine.stats.step_failures
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        good = [pool.submit(chat, server, p) for p in PROMPTS]
        bad = pool.submit(chat, server, POISONED)
        assert [f.result() for f in good] == clean
        with pytest.raises(openai.InternalServerError) as err:
            bad.result()
    assert err.value.status_code == 500
    body = err.value.body
    assert isinstance(body, dict) and "kernel failed for this shape" in body["message"]
    assert body["type"] == "server_error"
    assert engine.stats.step_failures == failures + 1
    metrics = httpx.get(server.url + "/metrics").text
    assert "kvcellar_engine_step_failures_total" in metrics


def test_streamed_and_anthropic_requests_fail_in_their_own_shape(served):
    server, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": POISONED}],
                                                max_tokens=16, stream=True):
            pass
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as err:
        claude.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": POISONED}])
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "api_error" and "kernel failed" in body["error"]["message"]
    assert chat(server, PROMPTS[0])  # a success between: the failures were not in a row


def test_failing_steps_in_a_row_turn_health_503_until_one_succeeds(served):
    server, _ = served
    assert httpx.get(server.url + "/health").status_code == 200
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            chat(server, POISONED)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "unhealthy"
    assert body["engine_steps"]["step_failures_in_a_row"] == 2
    assert "RuntimeError: kernel failed for this shape" in body["engine_steps"]["last_step_error"]
    assert chat(server, PROMPTS[1])
    assert httpx.get(server.url + "/health").status_code == 200
