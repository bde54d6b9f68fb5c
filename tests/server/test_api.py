"""The OpenAI API against a real ``kvcellar serve``, driven by the official ``openai`` client."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from kvcellar.engine import native
from kvcellar.server.protocol import ChatCompletion, ChatCompletionChunk, Completion, ModelList
from tests._models import expected_cached
from tests.helpers import MODEL, ServerProcess

MESSAGES = [{"role": "user", "content": "Name three primary colors."}]


def chat(client: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 16)
    return client.chat.completions.create(**kwargs)


def test_models(client: Any, server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    raw = httpx.get(server.url + "/v1/models").json()
    ModelList.model_validate(raw)
    missing = httpx.get(server.url + "/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def fresh_salt() -> dict[str, Any]:
    """A cache salt no earlier request used: the session server's first sight of a prompt
    reuses exactly nothing, whatever other tests sent before."""
    return {"cache_salt": f"fresh-{uuid.uuid4().hex}"}


def test_chat_completion_shape(client: Any, server: ServerProcess) -> None:
    salt = fresh_salt()
    resp = chat(client, max_tokens=8, extra_body=salt)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(client, max_tokens=8, extra_body=salt)  # the same prompt: every whole block is reused
    n = again.usage.prompt_tokens
    assert n == resp.usage.prompt_tokens and again.usage.prompt_tokens_details.cached_tokens == expected_cached(n, n)
    # The raw body matches our documented model exactly (no missing fields).
    raw = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
    assert raw.status_code == 200
    ChatCompletion.model_validate(raw.json())


def test_greedy_is_deterministic_and_cached_tokens_reported(client: Any) -> None:
    system = "You are a terse assistant. " * 12  # several full KV blocks of shared prefix
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is 2+2?"}]
    first = chat(client, messages=messages, max_tokens=12)
    second = chat(client, messages=messages, max_tokens=12)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens  # full blocks reused, never the last token


def test_cache_salt_separates_prefixes(client: Any) -> None:
    messages = [{"role": "system", "content": "Salted prefix. " * 16}, {"role": "user", "content": "Hi"}]
    chat(client, messages=messages, max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    other = chat(client, messages=messages, max_tokens=2, extra_body={"cache_salt": "tenant-b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    same = chat(client, messages=messages, max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    assert same.usage.prompt_tokens_details.cached_tokens > 0


def test_finish_reason_stop_on_eos(client: Any) -> None:
    resp = chat(client, messages=[{"role": "user", "content": "Reply with just the word: yes"}], max_tokens=64)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 64
    assert "<|im_end|>" not in resp.choices[0].message.content


def test_max_completion_tokens_wins(client: Any) -> None:
    resp = chat(client, max_tokens=20, max_completion_tokens=3)
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


def test_default_max_tokens_runs_to_eos(client: Any) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say OK."}],
                                          temperature=0)
    assert resp.choices[0].finish_reason == "stop"


def test_stream_chat(client: Any) -> None:
    full = chat(client, max_tokens=12)
    chunks = list(chat(client, max_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert all(c.usage is None for c in chunks)


def test_stream_raw_sse_format(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    import json

    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    for p in payloads[:-1]:
        ChatCompletionChunk.model_validate(p)
        assert "usage" in p and p["usage"] is None
    last = ChatCompletionChunk.model_validate(payloads[-1])
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5


def test_stream_include_usage(client: Any) -> None:
    messages = [{"role": "user", "content": "Stream the usage of this prompt, twice. " * 3}]
    salt = fresh_salt()
    for attempt in range(2):
        chunks = list(chat(client, messages=messages, max_tokens=6, stream=True,
                           stream_options={"include_usage": True}, extra_body=salt))
        assert chunks[-1].choices == []
        usage = chunks[-1].usage
        assert usage.completion_tokens == 6
        assert usage.prompt_tokens > 16
        n = usage.prompt_tokens
        # a fresh salt: the first run reuses nothing, the second every whole block
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached == (0 if attempt == 0 else expected_cached(n, n))


def test_n_2_seeded_sampling(client: Any) -> None:
    resp = chat(client, n=2, temperature=1.0, seed=1234, max_tokens=12)
    assert [c.index for c in resp.choices] == [0, 1]
    again = chat(client, n=2, temperature=1.0, seed=1234, max_tokens=12)
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]
    assert resp.choices[0].message.content != resp.choices[1].message.content
    # Choice i samples with seed + i: choice 1 of seed s is choice 0 of seed s + 1.
    shifted = chat(client, n=1, temperature=1.0, seed=1235, max_tokens=12)
    assert shifted.choices[0].message.content == resp.choices[1].message.content


def test_n_2_stream(client: Any) -> None:
    chunks = list(chat(client, n=2, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert texts[0] == texts[1]  # greedy: both choices equal
    assert chunks[-1].usage.completion_tokens == 16


def test_chat_logprobs(client: Any) -> None:
    resp = chat(client, logprobs=True, top_logprobs=3, max_tokens=6)
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert t.logprob <= 0
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.token == t.top_logprobs[0].token  # greedy picks the top token
    streamed = list(chat(client, logprobs=True, top_logprobs=2, max_tokens=6, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in tokens] == [t.token for t in content]
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_completions(client: Any, server: ServerProcess) -> None:
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert resp.choices[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    raw = server.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    Completion.model_validate(raw.json())
    # OpenAI's default max_tokens for legacy completions is 16.
    default = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, stop=None)
    assert default.usage.completion_tokens <= 16


def test_completions_stream_matches(client: Any) -> None:
    full = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completions_logprobs_legacy_shape(client: Any) -> None:
    resp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0
    assert all(len(t) == 2 for t in lp.top_logprobs)
    for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert max(top, key=top.get) == tok


def test_completions_batch_and_echo(client: Any) -> None:
    resp = client.completions.create(model=MODEL, prompt=["Red, green,", "One, two,"], max_tokens=4, temperature=0,
                                     n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text
    assert resp.choices[2].text == resp.choices[3].text
    single = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0)
    assert resp.choices[2].text == single.choices[0].text
    red = client.completions.create(model=MODEL, prompt="Red, green,", max_tokens=4, temperature=0)
    assert resp.choices[0].text == red.choices[0].text
    # each prompt counts once, however many choices it has
    assert resp.usage.prompt_tokens == red.usage.prompt_tokens + single.usage.prompt_tokens
    assert resp.usage.completion_tokens == 4 * 4
    echo = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == "One, two," + single.choices[0].text


def test_completions_token_prompt(client: Any) -> None:
    resp = client.completions.create(model=MODEL, prompt=[504, 3145, 30], max_tokens=3, temperature=0)
    assert resp.usage.prompt_tokens == 3


def test_extras_accepted(client: Any) -> None:
    resp = chat(client, max_tokens=4, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, user="u1",
                extra_body={"top_k": 5, "ignore_eos": True, "skip_special_tokens": True, "some_future_field": 1})
    assert resp.usage.completion_tokens == 4
    # ignore_eos keeps going past EOS; stop_token_ids ends on any listed id.
    resp = chat(client, messages=[{"role": "user", "content": "Reply with just: yes"}], max_tokens=12,
                extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"


def test_health_and_metrics(server: ServerProcess) -> None:
    h = server.health()
    assert h["status"] == "ok"
    assert h["model"] == MODEL
    # the tests' --dtype float32 --weights auto: int4 from the embedded Q4_1 where the kernels pay
    assert h["dtype"] == "float32" and h["weights"] in ("int4", "full")
    for key in ("queue_depth", "running", "inflight_requests", "kv_blocks_used", "last_shutdown_clean"):
        assert key in h
    assert h["tiers"]["ram"]["state"] == "ok" and h["tiers"]["ram"]["counters"]["kv_blocks_total"] > 0
    assert "engine_requests_total" in h["engine"]
    assert h["artifact"]["artifact_entries"] >= 1  # the model came from the artifact cache
    assert 0 <= h["artifact_cache"]["hit_rate"] <= 1 and "last_eviction" in h["artifact_cache"]
    assert h["status"] == "ok" and h["engine_steps"]["healthy"] and h["engine_steps"]["step_failures"] == 0
    linears = h["linears"]
    assert h["cpu_kernels"] == native.cpu_kernels() and set(h["cpu_kernels"]) >= {"native"}
    if h["weights"] == "full":  # every linear dense
        assert linears["dense"] > 0 and linears["int4"] == linears["int8"] == linears["lean"] == 0
        assert h["kernel_dtype"] is None
    else:  # every linear on its int4 kernel without a dense copy (the head too: the embedding is tied)
        assert linears["int4"] > 0 and linears["lean"] == linears["int4"] + linears["int8"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "kvcellar_engine_requests_total" in metrics
    assert "kvcellar_kv_blocks_used " in metrics or "kvcellar_kv_blocks_used{" in metrics
    assert "# TYPE kvcellar_kv_blocks_used gauge" in metrics
    assert "kvcellar_http_request_duration_seconds_bucket" in metrics
    assert "kvcellar_time_to_first_token_seconds_count" in metrics
    assert "# TYPE kvcellar_artifact_bytes_used gauge" in metrics


LEVELS = {  # every level of the snapshot: gauges; the issue found most exported as counters
    "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_evictable", "kv_blocks_used",
    "engine_running", "engine_waiting", "engine_loading", "engine_prefetching", "engine_step_failures_in_a_row",
    "engine_kv_bits", "engine_kv_group_size", "engine_kv_bytes_per_token", "engine_kv_pool_tokens",
    "ssd_blocks", "ssd_bytes", "ssd_capacity_bytes", "ssd_free_bytes", "ssd_pinned_blocks", "ssd_scan_complete",
    "writer_queue_depth", "writer_in_flight", "writer_pending_keys", "ssd_load_batches_in_flight",
    "server_inflight_requests", "server_inflight_sequences",
    "artifact_entries", "artifact_bytes_used", "artifact_bytes_limit", "artifact_last_eviction_time",
}


def test_metrics_types_are_declared_at_the_source(client: Any, server: ServerProcess) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(2):  # the second is a RAM hit
        chat(client, messages=[{"role": "user", "content": "Say hello to the metrics test. " * 4}], max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    stats = {k: v for tier in server.health()["tiers"].values() for k, v in tier["counters"].items()}
    stats.update(server.health()["engine"], **server.health()["server"], **server.health()["artifact"])
    for key in stats:
        family = families["kvcellar_" + key.removesuffix("_total")] if key.endswith("_total") and \
            "kvcellar_" + key not in families else families["kvcellar_" + key]
        assert family.type == ("gauge" if key in LEVELS else "counter"), (key, family.type)
    assert set(stats) >= LEVELS
    for name in ("kvcellar_kv_lookup_hits", "kvcellar_engine_requests", "kvcellar_ssd_stored_blocks",
                 "kvcellar_writer_dropped_queue_full", "kvcellar_writer_written_after_drop"):
        assert families[name].type == "counter" and families[name].samples[0].name == name + "_total"

    def sample(family: str, **labels: str) -> float:
        (value,) = [s.value for s in families[family].samples if s.labels == labels]
        return value

    assert families["kvcellar_tier_state"].type == "gauge"
    assert sample("kvcellar_tier_state", tier="ssd", state="ok") == 1.0
    assert sample("kvcellar_tier_state", tier="ssd", state="degraded") == 0.0
    assert sample("kvcellar_tier_state", tier="ram", state="ok") == 1.0
    assert families["kvcellar_tier_last_shutdown_clean"].type == "gauge"
    assert sample("kvcellar_tier_last_shutdown_clean", tier="ssd") == 1.0
    for tier in ("ram", "ssd"):  # hit-rate pairs: blocks asked of each tier, and served by it
        assert families["kvcellar_tier_queried_blocks"].type == families["kvcellar_tier_hit_blocks"].type == "counter"
        assert sample("kvcellar_tier_hit_blocks", tier=tier) <= sample("kvcellar_tier_queried_blocks", tier=tier)
    assert sample("kvcellar_tier_hit_blocks", tier="ssd") == stats["ssd_link_loaded_blocks"]
    ram_hits = sample("kvcellar_tier_hit_blocks", tier="ram")
    assert ram_hits == stats["kv_lookup_hits"] > 0
    assert sample("kvcellar_tier_queried_blocks", tier="ram") == stats["kv_lookup_hits"] + stats["kv_lookup_misses"]
    assert sample("kvcellar_tier_queried_blocks", tier="ssd") == stats["ssd_link_queried_blocks"] > 0


def test_openai_client_raises_typed_errors(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        chat(client, model="gpt-4o")
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
