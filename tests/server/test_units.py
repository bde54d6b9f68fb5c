"""Pieces of the server that need no model: error mapping, stats merging, settings, logs."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcellar.errors import EngineStoppedError, InvalidRequestError, ModelNotFoundError
from kvcellar.server import errors
from kvcellar.server.logs import JsonFormatter, KeyValueFormatter
from kvcellar.server.metrics import SnapshotCollector, group_by_prefix
from kvcellar.server.protocol import ChatCompletionRequest


@pytest.mark.parametrize(("loc", "param"), [
    (("body", "temperature"), "temperature"),
    (("body", "messages", 0, "content", "str"), "messages[0].content"),
    (("body", "prompt", "list[int]", 0), "prompt"),
    (("body", "stop", "list[str]"), "stop"),
    (("body", "messages", 2, "content", "list[ContentPart]", 0, "type"), "messages[2].content"),
    (("body",), None),
    (("body", 12), None),  # a JSON decode position, not a field
])
def test_param_path(loc: tuple, param: str | None) -> None:
    assert errors._param_path(loc) == param


def test_validation_errors_map_to_openai_fields() -> None:
    try:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": 5}],
                                             "temperature": "hot"})
    except Exception as exc:  # pydantic.ValidationError
        err = errors.from_validation_errors(exc.errors())  # type: ignore[attr-defined]
    assert err.status == 400
    assert err.param == "temperature"  # the first invalid field; every one is in the message
    assert err.code == "invalid_type"
    assert "'messages[0].content'" in err.message
    missing = errors.from_validation_errors([{"type": "missing", "loc": ("body", "model"), "msg": "Field required"}])
    assert (missing.param, missing.code) == ("model", "missing_required_parameter")
    bad_json = errors.from_validation_errors([{"type": "json_invalid", "loc": ("body", 3), "msg": "x",
                                               "ctx": {"error": "Expecting value"}}])
    assert bad_json.code == "invalid_json"


def test_exception_mapping() -> None:
    assert errors.from_exception(InvalidRequestError("x", param="p", code="c")).body() == {
        "error": {"message": "x", "type": "invalid_request_error", "param": "p", "code": "c"}}
    assert errors.from_exception(ModelNotFoundError("m")).status == 404
    assert errors.from_exception(EngineStoppedError("s")).status == 503
    internal = errors.from_exception(RuntimeError("secret detail"))
    assert internal.status == 500 and "secret" not in internal.message


def test_integral_floats_count_as_integers() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                "n": 2.0, "max_tokens": 3.0})
    assert (req.n, req.max_tokens) == (2, 3)
    for bad in ({"n": 1.5}, {"n": True}, {"n": "2"}):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  **bad})


def test_stats_grouped_by_owner_prefix() -> None:
    stats = {"engine_running": 1, "engine_steps": 4, "sched_admitted": 2, "server_requests_total": 7,
             "artifact_hits": 1}
    assert group_by_prefix(stats) == {"engine": {"engine_running": 1, "engine_steps": 4},
                                      "sched": {"sched_admitted": 2}, "server": {"server_requests_total": 7},
                                      "artifact": {"artifact_hits": 1}}
    assert group_by_prefix({}) == {}


def test_prometheus_kinds_come_from_declarations_not_names() -> None:
    """A declared level is a gauge whatever its name; an undeclared key is a counter."""
    registry = CollectorRegistry()
    tiers = [{"tier": "ssd", "state": "degraded", "last_shutdown_clean": False, "queried_blocks": 7, "hit_blocks": 3}]
    registry.register(SnapshotCollector(lambda: {"kv_blocks_total": 3, "engine_running": 2, "kv_lookup_hits": 9},
                                        lambda: {"kv_blocks_total"}, lambda: tiers))
    text = generate_latest(registry).decode()
    assert "# TYPE kvcellar_kv_blocks_total gauge" in text and "kvcellar_kv_blocks_total 3.0" in text
    assert "# TYPE kvcellar_engine_running_total counter" in text  # not declared: a count
    assert "kvcellar_kv_lookup_hits_total 9.0" in text
    assert 'kvcellar_tier_state{state="degraded",tier="ssd"} 1.0' in text
    assert 'kvcellar_tier_state{state="ok",tier="ssd"} 0.0' in text
    assert 'kvcellar_tier_last_shutdown_clean{tier="ssd"} 0.0' in text
    assert 'kvcellar_tier_queried_blocks_total{tier="ssd"} 7.0' in text
    assert 'kvcellar_tier_hit_blocks_total{tier="ssd"} 3.0' in text


def _serve_settings(*argv: str):
    from kvcellar.cli import build_parser, settings_from_args

    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_settings_precedence(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_file = tmp_path / "kvcellar.toml"
    cfg_file.write_text('[server]\nport = 9000\ninter_token_timeout = 5.0\n'
                        '[disk]\nssd_policy = "evict_only"\ndisk_cache_gb = 3\n[engine]\nblock_size = 32\n')
    monkeypatch.setenv("KVCELLAR_API_KEY", "from-env")
    monkeypatch.setenv("KVCELLAR_PORT", "9100")
    monkeypatch.setenv("KVCELLAR_SSD_TTL_DAYS", "2")
    monkeypatch.setenv("KVCELLAR_CONFIG", str(cfg_file))
    settings = _serve_settings("--max-num-seqs", "4", "--cache-dir", str(tmp_path / "c"))
    server = settings.server
    assert (server.host, server.port, server.api_key, server.inter_token_timeout) == \
        ("127.0.0.1", 9100, "from-env", 5.0)
    assert settings.engine.max_num_seqs == 4
    assert settings.engine.block_size == 32
    assert (settings.disk.policy, settings.disk.capacity_bytes, settings.disk.ttl_s) == \
        ("evict_only", 3 << 30, 2 * 86400.0)
    assert settings.cache_dir == (tmp_path / "c").resolve()
    flags = _serve_settings("--ssd-policy", "write_through", "--port", "1234", "--no-ssd-async",
                            "--disk-cache-gb", "1.5")
    assert flags.disk.policy == "write_through"
    assert flags.disk.async_writes is False
    assert flags.disk.capacity_bytes == int(1.5 * (1 << 30))
    assert flags.server.port == 1234
    with pytest.raises(ValueError):
        _serve_settings("--first-token-timeout", "0")
    monkeypatch.setenv("KVCELLAR_SSD_POLICY", "sometimes")
    with pytest.raises(ValueError):
        _serve_settings()


def test_log_formats() -> None:
    record = logging.LogRecord("kvcellar.server", logging.INFO, __file__, 1, "request finished", None, None)
    record.fields = {"id": "cmpl-1", "finish": "stop", "note": "has space"}
    line = KeyValueFormatter().format(record)
    assert line.endswith('request finished id=cmpl-1 finish=stop note="has space"')
    obj = json.loads(JsonFormatter().format(record))
    assert obj["msg"] == "request finished" and obj["finish"] == "stop"


def test_usage_counts_tokens_of_a_stream_that_never_finished() -> None:
    """A client that hangs up mid-stream: the request log still shows what it used."""
    from kvcellar.engine import TokenEvent
    from kvcellar.server.formatting import RequestShape, ResponseBuilder

    builder = ResponseBuilder(RequestShape("chat", "m", "fp", 1, 1, False, 0, False), None)  # type: ignore[arg-type]
    for i in range(3):
        builder.chunks_for(0, TokenEvent(1, 100 + i, "x", num_prompt_tokens=20, num_cached_tokens=16,
                                         num_output_tokens=i + 1))
    assert builder.usage().model_dump() == {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23,
                               "prompt_tokens_details": {"cached_tokens": 16}}


def test_log_level_is_taken_before_or_after_serve() -> None:
    from kvcellar.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "DEBUG", "serve"]).log_level == "DEBUG"
    assert parser.parse_args(["serve", "--log-level", "INFO"]).log_level == "INFO"


def test_names_logged_once_are_bounded() -> None:
    from kvcellar.server.logs import FirstSeen

    seen = FirstSeen(limit=100, max_len=16)
    assert seen("web_search") and not seen("web_search")
    assert all(seen(f"tool-{i}") for i in range(99)) and len(seen) == 100
    assert not seen("one more") and len(seen) == 100  # full: nothing more remembered or logged
    assert max(map(len, seen._seen)) <= 16
