"""``kvcellar bench`` end to end in its fast mode, against real servers.

Servers started here: the ttft run's own kvcellar (started, then restarted for the disk
hit); agent and decode measure the session server through ``--base-url`` (the peer-mode
path, where restarts do not apply). Each run must write valid JSON with numeric figures and
a PNG.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcellar.bench import stats
from kvcellar.bench.prompts import PromptMaker, find_tokenizer_dir, load_tokenizer, resolve_tokenizer
from kvcellar.bench.registry import discover
from kvcellar.bench.targets import CommandTarget
from kvcellar.cli import main
from kvcellar.engine.tokenization import shared_prefix_len
from tests.helpers import DEFAULT_SERVE_ARGS, MODEL, ServerProcess

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(capsys: pytest.CaptureFixture[str], out: Path, *argv: str) -> dict[str, Any]:
    assert main(["bench", *argv, "--fast", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "|" in printed and "result.json" in printed
    result = json.loads((out / "result.json").read_text())
    png = out / f"{argv[0]}.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    return result


def is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def median(summary: dict[str, Any] | None) -> float:
    assert summary is not None, "figure missing"
    assert all(is_num(summary[k]) for k in ("median", "min", "max"))
    assert summary["min"] <= summary["median"] <= summary["max"]
    return float(summary["median"])


def test_scenarios_registered() -> None:
    assert {"ttft", "agent", "decode", "spec"} <= set(discover())


def test_stats() -> None:
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([5.0], 95) == 5.0
    s = stats.summarize([3.0, 1.0, None, 2.0, float("nan")])
    assert s is not None and (s.median, s.min, s.max, s.n) == (2.0, 1.0, 3.0, 3)
    assert stats.summarize([]) is None
    assert stats.ratio(s, stats.summarize([4.0])) == 0.5 and stats.ratio(1.0, 0.0) is None


def test_prompts_are_tokenizer_exact(server: ServerProcess, models_dir: Path) -> None:
    tok_dir = find_tokenizer_dir(models_dir, MODEL)
    assert tok_dir is not None
    maker = PromptMaker(load_tokenizer(tok_dir))
    for n in (48, 300, 1000):
        p = maker.chat(n, f"t{n}")
        assert p.n_tokens == n
        assert p == maker.chat(n, f"t{n}")  # deterministic
        assert shared_prefix_len(p.token_ids, maker.chat(n, "other").token_ids) < 16  # no shared block
    a, b = maker.partial_pair(512, "pp", 96)
    assert a.n_tokens == b.n_tokens == 512
    assert 512 - shared_prefix_len(a.token_ids, b.token_ids) == 96
    # the server counts the same tokens
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": a.messages, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == 512
    # without a prepared model, the embedded GGUF's own tokenizer makes the very same prompts
    from_gguf = PromptMaker(resolve_tokenizer(None))
    assert from_gguf.chat(300, "t300") == maker.chat(300, "t300")


def test_command_target_restarts(tmp_path: Path) -> None:
    """A peer started from a command: placeholders substituted, ready on /v1/models, restarted
    (process group stopped, page cache dropped) and stopped."""
    cmd = ("mkdir -p {cache_dir}/www/v1 && echo '{{\"data\": [{{\"id\": \"m\"}}]}}' > {cache_dir}/www/v1/models && "
           f"exec {sys.executable} -m http.server {{port}} --bind 127.0.0.1 -d {{cache_dir}}/www")
    peer = CommandTarget("peer", tmp_path / "peer", cmd, ready_timeout=30)
    try:
        peer.start()
        assert peer.served_model() == "m" and peer.health() is None and peer.counters() == {}
        first = peer.proc
        method = peer.restart()
        assert method.split()[0] in ("drop_caches", "fadvise_dontneed", "none")
        assert first is not None and first.poll() is not None and peer.proc is not first
        assert peer.served_model() == "m" and peer.starts == 2
    finally:
        peer.stop()
    assert peer.proc is not None and peer.proc.poll() is not None


@pytest.mark.slow
def test_ttft_fast(tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_bench(capsys, tmp_path / "ttft", "ttft", "--models-dir", str(models_dir),
                    "--serve-args", " ".join([*DEFAULT_SERVE_ARGS, "--no-warmup"]))  # warm-up: seconds a start
    kv = res["targets"]["kvcellar"]
    assert kv["is_kvcellar"] and not kv["errors"] and kv["restart"]["exit_code"] == 0
    assert set(kv["lengths"]) == {"64", "128"}
    for n, row in kv["lengths"].items():
        assert row["prompt_tokens"] == [int(n)] and row["server_prompt_tokens"] == [int(n)]
        for key in ("cold_s", "ram_hit_s", "partial_s", "disk_hit_s", "decode_step_s"):
            assert median(row[key]) > 0, key
        assert is_num(row["floor_s"]) and row["floor_s"] > 0
        assert all(is_num(v) for v in row["ratios"].values())
        disk = row["requests"]["disk"][0]
        # the disk hit really came from the SSD tier of a restarted server
        assert disk["cached_tokens"] > 0 and disk["tiers"]["ssd_tokens"] == disk["cached_tokens"]
        assert row["requests"]["ram"][0]["cached_tokens"] > 0
    floor = res["floor"]
    assert median(floor["read_bandwidth_bytes_per_s"]) > 0 and floor["kv_bytes_per_token"] > 0
    assert res["tables"][0]["title"].startswith("TTFT")


@pytest.mark.slow
def test_agent_fast_against_url(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_bench(capsys, tmp_path / "agent", "agent", "--base-url", server.url, "--name", "session-server")
    t = res["targets"]["session-server"]
    assert t["is_kvcellar"] and not t["restarted"]
    for n in ("1", "2"):
        s = t["summary"][n]
        assert s["errors"] == 0
        for key in ("ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s", "output_tok_s"):
            assert median(s[key]) > 0, key
        # RAM hits are a share of all hits; in pass 1 too, a session's turn 2 reuses its turn 1 from RAM
        assert 0 < median(s["ram_ratio"]) <= median(s["cached_ratio"]) <= 1
    # pass 2 repeats pass 1's sessions on a server that still holds them
    assert median(t["summary"]["2"]["cached_ratio"]) > median(t["summary"]["1"]["cached_ratio"])
    assert len(t["repeats"][0]["passes"][0]["records"]) == 4


@pytest.mark.slow
def test_decode_fast_against_url(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_bench(capsys, tmp_path / "decode", "decode", "--base-url", server.url,
                    "--concurrency-levels", "1,2")
    t = res["targets"]["server"]
    for c in ("1", "2"):
        row = t["concurrency"][c]
        assert median(row["aggregate_tok_s"]) > 0 and not row["errors"]
        assert row["tokens_per_stream"] == [16]  # ignore_eos: exactly max_tokens
    assert t["ssd"] is not None and t["ssd"]["generated_tokens"] >= 2 * 16 and t["ssd"]["stored_blocks"] >= 0


@pytest.mark.slow
def test_spec_fast_against_url(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The session server drafts by default (``--speculative auto``: suffix on a CPU): a code edit's
    drafts are verified and taken, and /health says so."""
    res = run_bench(capsys, tmp_path / "spec", "spec", "--base-url", server.url, "--kinds", "code-edit",
                    "--max-tokens", "48", "--streams", "2")
    t = res["targets"]["server"]
    assert t["rows"]["code-edit"]["tok_s"] > 0 and t["batch_tok_s"][0] > 0
    drafts = t["accepted_by_kind"]["code-edit"]
    assert drafts["verifies"] > 0 and 0 < drafts["accepted"] <= drafts["drafted"]
    assert t["speculative"]["mode"] == "suffix" and t["speculative"]["acceptance_rate"] > 0
