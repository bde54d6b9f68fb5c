"""Floods of what any client may send, against a real server (127.0.0.1 only, bounded in count
and time): the server's peak RSS stays within a stated bound and normal requests keep being
answered. And the slow clients: a body that trickles gets 408, requests past the admission
limits get 503 with ``Retry-After`` before their bodies are read.

The bound: the flood's peak RSS (``VmHWM``) at most ``FLOOD_BOUND`` above the server's peak
before it, with ``--max-body-mb-in-flight 8`` (bodies held at once) and
``--max-stored-responses-mb 8`` (conversations kept). The counts are the issue's scaled to
a quarter of a minute of this suite on 2 cores (a stored response costs ~0.1 s, a distinct
schema ~0.2 s); the bounds they press on are checked at full scale without a server
(tests/server/test_responses.py, tests/engine/test_constraints.py, tests/server/test_units.py),
and benchmarks/bench_floods.py sends the issue's full counts to a server.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests._models import stand_in_args
from tests.floods import distinct_schemas, peak_rss, send_all, stored_responses, token_counts, unknown_tools
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


def answered_normally(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_floods_of_what_any_client_may_send_stay_within_the_bound(flooded: ServerProcess) -> None:
    answered_normally(flooded)
    pid = flooded.proc.pid
    before = peak_rss(pid)
    assert {r.status_code for r in send_all(flooded.url, stored_responses(MODEL, 50))} == {200}
    # 10,000 tool types
    assert {r.status_code for r in send_all(flooded.url, unknown_tools(MODEL, 100))} == {200}
    assert {r.status_code for r in send_all(flooded.url, distinct_schemas(MODEL, 40))} == {200}
    # 500 at once, 100 MB offered; the gate holds 8 MB
    counted = send_all(flooded.url, token_counts(MODEL, 500), concurrency=500)
    statuses = [r.status_code for r in counted]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 20 and statuses.count(503) >= 100, statuses
    assert all(r.headers["retry-after"] == "1" for r in counted if r.status_code == 503)

    grown = peak_rss(pid) - before
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
