"""Floods of what any client may send, against a real server (127.0.0.1 only, bounded in count
and time): the server's peak RSS stays within a stated bound and normal requests keep being
answered. And the slow clients: a body that trickles gets 408, requests past the admission
limits get 503 with ``Retry-After`` before their bodies are read.

The bound: the flood's peak RSS (``VmHWM``) at most ``FLOOD_BOUND`` above the server's peak
before it, with ``--max-body-mb-in-flight 8`` (bodies held at once) and
``--max-stored-responses-mb 8`` (conversations kept). The counts are the issue's scaled to
half a minute of this suite on 2 cores (a stored response costs ~0.1 s, a distinct schema
~0.2 s); the bounds they press on are checked at full scale without a server
(tests/server/test_responses.py, tests/engine/test_constraints.py, tests/server/test_units.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests._models import stand_in_args
from tests.helpers import ServerProcess, wait_until

FLOOD_BOUND = 1 << 30
MODEL = "stand-in"


@pytest.fixture(scope="module")
def flooded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("floods"), *stand_in_args(), "--max-body-mb-in-flight", "8",
                           "--max-stored-responses-mb", "8", "--body-timeout", "10", "--max-inflight-requests", "600",
                           "--serve-any-model").start()
    try:
        yield server
    finally:
        server.stop()


def peak_rss(server: ServerProcess) -> int:
    """The server process's peak resident set so far, bytes."""
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def answered_normally(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


async def _send_all(url: str, bodies: list[tuple[str, bytes]], concurrency: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(path: str, body: bytes) -> httpx.Response:
            async with gate:
                return await client.post(path, content=body, headers={"Content-Type": "application/json"})

        return await asyncio.gather(*(one(path, body) for path, body in bodies))


def send_all(server: ServerProcess, bodies: list[tuple[str, bytes]], concurrency: int = 8) -> list[httpx.Response]:
    return asyncio.run(_send_all(server.url, bodies, concurrency))


def test_floods_of_what_any_client_may_send_stay_within_the_bound(flooded: ServerProcess) -> None:
    answered_normally(flooded)
    before = peak_rss(flooded)

    # 100 stored responses, each with the largest metadata the API allows.
    metadata = {f"key{i:02d}" + "k" * 58: "v" * 512 for i in range(16)}
    stored = [("/v1/responses", json.dumps({"model": MODEL, "input": f"Reply {i}.", "metadata": metadata,
                                            "max_output_tokens": 1, "store": True}).encode()) for i in range(100)]
    assert {r.status_code for r in send_all(flooded, stored)} == {200}

    # 10,000 tool types this server ignores (hosted tools, Anthropic server tools), 100 a request.
    hosted = [("/v1/responses/input_tokens", json.dumps({
        "model": MODEL, "input": "hi", "tools": [{"type": f"hosted_{i}_{j}" + "x" * 200} for j in range(100)],
    }).encode()) for i in range(50)]
    server_tools = [("/v1/messages/count_tokens", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": f"server_{i}_{j}" + "x" * 200, "name": f"t{j}"} for j in range(100)]}).encode())
        for i in range(50)]
    assert {r.status_code for r in send_all(flooded, hosted + server_tools)} == {200}

    # 100 distinct schemas of ~6 KB each, compiled into grammars.
    schemas = [("/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Fill it in."}], "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {f"field_{i}_{j}_" + "p" * 40: {"type": "string"} for j in range(60)}}}},
    }).encode()) for i in range(100)]
    assert {r.status_code for r in send_all(flooded, schemas)} == {200}

    # 500 concurrent token counts of 200 KB each: 100 MB offered at once; the gate holds 8 MB.
    big = [("/v1/messages/count_tokens", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": f"{i} " + "lorem ipsum " * 17_000}]}).encode())
        for i in range(500)]
    counted = send_all(flooded, big, concurrency=500)
    statuses = [r.status_code for r in counted]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 20 and statuses.count(503) >= 100, statuses
    assert all(r.headers["retry-after"] == "1" for r in counted if r.status_code == 503)

    grown = peak_rss(flooded) - before
    print(f"floods: peak RSS {before / 2**20:.0f} -> {(before + grown) / 2**20:.0f} MiB; token counts: "
          f"{statuses.count(200)} answered, {statuses.count(503)} refused")
    assert grown < FLOOD_BOUND, f"peak RSS grew {grown / 2**20:.0f} MiB"
    answered_normally(flooded)
    health = flooded.health()
    assert health["status"] == "ok" and health["server"]["server_internal_errors"] == 0


def _raw_request(server: ServerProcess, length: int, sent: bytes = b"{") -> socket.socket:
    """A POST whose body has ``length`` bytes declared and only ``sent`` of them sent."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (length, sent))
    return sock


def _status(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_slow_bodies_hold_the_gate_until_they_get_408_and_requests_past_it_are_refused(flooded: ServerProcess) -> None:
    """Two clients that declared 8 MiB bodies and send none of them hold all the gate's 16 MiB
    (the largest body, 16 MiB, always fits): the next request is refused at once, before its body
    is read (503, Retry-After). The slow ones get 408 when --body-timeout (10 s) is over, which
    frees the gate."""
    holders = [_raw_request(flooded, 8 << 20) for _ in range(2)]
    try:
        def refused() -> bool:
            r = httpx.post(flooded.url + "/v1/messages/count_tokens", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            return r.status_code == 503 and r.headers.get("retry-after") == "1" and \
                r.json()["error"]["type"] == "overloaded_error"
        wait_until(refused, timeout=8, what="a request past the bodies in flight to be refused")
        for sock in holders:  # the server answers them by itself
            status, head = _status(sock)
            assert status == 408, head
    finally:
        for sock in holders:
            sock.close()
    answered_normally(flooded)


def test_preparing_a_request_counts_against_its_first_token_timeout(flooded: ServerProcess) -> None:
    """Tokenizing a 4 MB message takes seconds here: with a first-token timeout of 0.5 s the
    request is cancelled while it is still prepared (504), not after, and nothing reaches the engine."""
    before = flooded.health()["engine"]["engine_requests_total"]
    r = httpx.post(flooded.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 1, "first_token_timeout": 0.5,
        "messages": [{"role": "user", "content": "lorem ipsum " * 350_000}]})
    assert r.status_code == 504 and r.json()["error"]["code"] == "first_token_timeout", r.text
    assert "preparing" in r.json()["error"]["message"]
    assert flooded.health()["engine"]["engine_requests_total"] == before
    answered_normally(flooded)
