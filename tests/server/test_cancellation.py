"""Clients that go away and requests that time out are cancelled in the engine; afterwards
nothing of theirs is left: no running or queued sequence, no KV block in use, no server-side
stream. Timeouts are per-request overrides here (never above the server's own)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import MODEL, ServerProcess, wait_until

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
        "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def counters(server: ServerProcess) -> dict[str, float]:
    h = server.health()
    return {**h["engine"], **h["server"]}


def test_disconnect_mid_stream_cancels(server: ServerProcess) -> None:
    server.wait_idle()
    before = counters(server)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LONG, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 4:
                    # The engine really is generating for us before we hang up.
                    assert server.health()["running"] >= 1
                    break
        assert seen == 4
    # Leaving the loop already dropped the connection (httpx closes an unfinished stream).
    after = server.wait_idle()
    assert after["engine"]["engine_requests_aborted"] == before["engine_requests_aborted"] + 1
    assert after["server"]["server_client_disconnects"] == before["server_client_disconnects"] + 1
    assert after["engine"]["engine_generated_tokens"] - before["engine_generated_tokens"] < 2000


def test_disconnect_while_waiting_for_full_response_cancels(server: ServerProcess) -> None:
    server.wait_idle()
    before = counters(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=httpx.Timeout(60, read=1.5))
    after = server.wait_idle()
    assert after["engine"]["engine_requests_aborted"] == before["engine_requests_aborted"] + 1
    assert after["server"]["server_client_disconnects"] == before["server_client_disconnects"] + 1


def test_disconnect_with_openai_client_stream(server: ServerProcess) -> None:
    server.wait_idle()
    before = counters(server)
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=LONG["messages"], max_tokens=2000, stream=True,
                                            extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    after = server.wait_idle()
    assert after["engine"]["engine_requests_aborted"] == before["engine_requests_aborted"] + 1


@pytest.mark.parametrize("stream", [False, True])
def test_first_token_timeout_is_504_after_cancel(server: ServerProcess, stream: bool) -> None:
    """A 1 ms first-token timeout, counted from the request's arrival, ends it while it is
    prepared or just after its two choices were submitted: either way a 504, counted once, and
    whatever reached the engine cancelled there (tests/server/test_first_token_deadline.py and
    test_floods.py hold each path alone)."""
    server.wait_idle()
    before = counters(server)
    r = server.post("/v1/chat/completions", {**LONG, "stream": stream, "n": 2, "first_token_timeout": 0.001})
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "first_token_timeout"
    after = server.wait_idle()
    assert after["server"]["server_first_token_timeouts"] == before["server_first_token_timeouts"] + 1
    submitted = after["engine"]["engine_requests_total"] - before["engine_requests_total"]
    assert submitted in (0, 2)
    assert after["engine"]["engine_requests_aborted"] == before["engine_requests_aborted"] + submitted


def test_inter_token_timeout_full_response(server: ServerProcess) -> None:
    server.wait_idle()
    before = counters(server)
    r = server.post("/v1/chat/completions", {**LONG, "inter_token_timeout": 0.001})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "inter_token_timeout"
    after = server.wait_idle()
    assert after["server"]["server_inter_token_timeouts"] == before["server_inter_token_timeouts"] + 1
    assert after["engine"]["engine_requests_aborted"] == before["engine_requests_aborted"] + 1


def test_inter_token_timeout_mid_stream_sends_error_event(server: ServerProcess) -> None:
    server.wait_idle()
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**LONG, "stream": True, "inter_token_timeout": 0.001}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "inter_token_timeout"
    server.wait_idle()
    # The official client surfaces it as an error too.
    client = server.client()
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model=MODEL, messages=LONG["messages"], max_tokens=50, stream=True,
                                                extra_body={"inter_token_timeout": 0.001}):
            pass
    server.wait_idle()


def test_failed_submission_cancels_choices_already_submitted(server: ServerProcess) -> None:
    """The second prompt is refused by the engine after the first one's two choices were
    submitted: those are cancelled, nothing stays registered."""
    server.wait_idle()
    before = counters(server)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": [[504, 3145, 30], [10**9]], "n": 2,
                                        "max_tokens": 500, "ignore_eos": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    after = server.wait_idle()
    assert after["engine"]["engine_requests_aborted"] == before["engine_requests_aborted"] + 2
    assert after["engine"]["engine_generated_tokens"] - before["engine_generated_tokens"] < 500


def test_timeouts_never_exceed_the_servers(server: ServerProcess) -> None:
    # A huge per-request timeout is capped, not an error; the request simply completes.
    r = server.post("/v1/chat/completions", {**LONG, "max_tokens": 3, "first_token_timeout": 1e9,
                                             "inter_token_timeout": 1e9})
    assert r.status_code == 200


def test_many_cancellations_leave_nothing_behind(server: ServerProcess) -> None:
    """Mixed: disconnects at various points and timeouts, concurrently."""
    import concurrent.futures

    def hang_up(after_events: int) -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LONG, "stream": True, "n": 2},
                          timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= after_events:
                        return

    def time_out(_: int) -> None:
        server.post("/v1/chat/completions", {**LONG, "inter_token_timeout": 0.001})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(hang_up, k) for k in (1, 2, 5, 9)] + [pool.submit(time_out, k) for k in range(4)]
        for job in jobs:
            job.result()
    h = server.wait_idle()
    assert h["kv_blocks_used"] == 0
    wait_until(lambda: server.health()["server"]["server_inflight_requests"] == 0, what="no inflight requests")


def test_a_cancelled_reader_stays_cancelled_when_its_event_arrives_at_the_same_moment() -> None:
    """A stream writer cancelled (its client hung up) just as the next event landed must still
    stop: were the cancellation swallowed, the response would stream into a dead socket until
    the generation ended, holding its sequences and blocks (asyncio.wait_for on Python 3.11
    did exactly that). Whichever loop turn the cancel lands on, a reader that accepted it ends
    cancelled and the event stays queued; one that had already returned gave the event."""
    import asyncio

    from kvcellar.engine import EventStream, TokenEvent

    async def scenario(turns: int) -> bool:
        stream = EventStream(asyncio.get_running_loop())
        reader = asyncio.ensure_future(stream.get(timeout=30))
        await asyncio.sleep(0)  # the reader is waiting on the queue
        event = TokenEvent(seq_id=1, token_id=5, text="x")
        stream._async_q.put_nowait(event)  # what put() schedules from the engine thread
        for _ in range(turns):
            await asyncio.sleep(0)
        accepted = reader.cancel()
        if accepted:
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert await stream.get(timeout=1) is event
        else:
            assert reader.result() is event
        return accepted

    outcomes = [asyncio.run(scenario(turns)) for turns in range(4)]
    assert outcomes[0], "a cancel before the event is handed over must be accepted"
