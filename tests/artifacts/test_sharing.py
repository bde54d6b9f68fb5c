"""Several processes on one cache dir: LRU eviction that spares entries in use, concurrent
preparation of one model, and the ``kvcellar models`` commands."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvcellar.artifacts import ArtifactCache, ArtifactDescriptor
from kvcellar.runtime import prepare_and_load

REPO = Path(__file__).resolve().parents[2]


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.artifacts.child", *args], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@contextmanager
def held_by_another_process(models_root: Path, key: str) -> Iterator[None]:
    proc = _child("hold", str(models_root), key)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "held", (line, proc.stderr.read() if proc.poll() is not None else "")
        yield
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()


def _load_released(gguf: Path, cache: ArtifactCache) -> str:
    """Load (preparing if needed) and let go of the entry, as a server that stopped would."""
    loaded = prepare_and_load(str(gguf), device="cpu", artifacts=cache, weights="full")
    loaded.artifact.release()
    return loaded.artifact.key


def _build_four(ggufs: list[Path], cache: ArtifactCache) -> list[str]:
    """Entries A, B, C, then A used again: LRU order is B, C, A (a fourth comes later)."""
    keys = [_load_released(g, cache) for g in ggufs[:3]]
    _load_released(ggufs[0], cache)
    return keys


def _limit_for_two_evictions(cache: ArtifactCache) -> int:
    # Four near-equal entries of size s: with a limit of 3.2 s, adding the fourth (4 s) goes
    # over, and eviction to 80 % (2.56 s) removes exactly two.
    sizes = [e.size_bytes for e in cache.entries()]
    return int(max(sizes) * 3.2)


def test_lru_eviction_down_to_80_percent(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "models")
    a, b, c = _build_four(tiny_ggufs, cache)
    cache.max_bytes = _limit_for_two_evictions(cache)
    d = prepare_and_load(str(tiny_ggufs[3]), device="cpu", artifacts=cache, weights="full")
    remaining = {e.key for e in cache.entries()}
    assert remaining == {a, d.artifact.key}  # B and C were least recently used
    stats = cache.stats()
    assert stats["artifact_evictions"] == 2
    assert stats["artifact_bytes_used"] <= 0.8 * cache.max_bytes
    assert not (cache.entries_dir / b).exists() and not (cache.entries_dir / c).exists()


def test_hit_and_miss_counts_and_the_last_eviction(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    """/health and /metrics read these: hits and misses as counters (the hit rate is derived in
    health), the last LRU eviction as a gauge (its time) and in health (which entry)."""
    cache = ArtifactCache(tmp_path / "models")
    assert cache.stats()["artifact_last_eviction_time"] == 0.0
    assert cache.health() == {"hit_rate": None, "last_eviction": None}
    assert "artifact_last_eviction_time" in cache.GAUGES
    assert {"artifact_hits", "artifact_misses"}.isdisjoint(cache.GAUGES)
    a, _, c = _build_four(tiny_ggufs, cache)  # three misses (built), then A again: a hit
    stats = cache.stats()
    assert (stats["artifact_hits"], stats["artifact_misses"]) == (1, 3)
    assert (stats["artifact_lifetime_hits"], stats["artifact_lifetime_misses"]) == (1, 3)
    assert cache.health() == {"hit_rate": 0.25, "last_eviction": None}
    label_c = next(ArtifactDescriptor.from_dict(e.descriptor).label for e in cache.entries() if e.key == c)

    cache.max_bytes = _limit_for_two_evictions(cache)
    before = time.time()
    d = _load_released(tiny_ggufs[3], cache)
    after = time.time()
    assert {e.key for e in cache.entries()} == {a, d}  # B went first, then C: C is the last
    last = cache.health()["last_eviction"]
    assert (last["key"], last["label"]) == (c, label_c) and before <= last["time"] <= after
    assert cache.stats()["artifact_last_eviction_time"] == last["time"]
    # Kept in the index: another process on the same cache reports the same eviction.
    other = ArtifactCache(tmp_path / "models")
    assert other.health()["last_eviction"] == last and other.health()["hit_rate"] == 0.2
    assert other.stats()["artifact_last_eviction_time"] == last["time"]
    assert other.stats()["artifact_hits"] == 0  # its own counters start at zero


def test_entry_held_by_another_process_is_not_evicted(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "models")
    a, b, c = (_load_released(g, cache) for g in tiny_ggufs[:3])
    with held_by_another_process(cache.root, b):  # a server started on B...
        _load_released(tiny_ggufs[2], cache)  # ... then C and A were used: B is the LRU entry
        _load_released(tiny_ggufs[0], cache)
        assert [e.key for e in cache.entries()] == [b, c, a]
        cache.max_bytes = _limit_for_two_evictions(cache)
        d = prepare_and_load(str(tiny_ggufs[3]), device="cpu", artifacts=cache, weights="full")
        assert {e.key for e in cache.entries()} == {b, d.artifact.key}  # C, then A, went instead
        assert not (cache.entries_dir / a).exists() and not (cache.entries_dir / c).exists()
        assert cache.stats()["artifact_evict_skipped_in_use"] == 1
        in_use = {e.key: e.in_use for e in cache.entries()}
        assert in_use == {b: True, d.artifact.key: True}  # d: held by this process's lease
        # Nor do `clear` and `prune` touch what is in use.
        d.artifact.release()
        report = cache.clear()
        assert report == {"removed": [d.artifact.key], "skipped_in_use": [b]}
    assert cache.clear() == {"removed": [b], "skipped_in_use": []}
    assert not list(cache.entries_dir.iterdir())


def test_concurrent_starts_prepare_once(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    procs = [_child("load", str(tiny_ggufs[4]), str(tmp_path)) for _ in range(2)]
    try:
        for p in procs:  # both imported everything; now release them together
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(r["built"] for r in results) == [False, True]
    builder = next(i for i, r in enumerate(results) if r["built"])
    waiter = results[1 - builder]
    assert waiter["hit"]
    assert "Preparing tiny-4" in outs[builder][1]  # the progress bar
    for field in ("key", "weights_id", "tokenizer_id", "tokens"):
        assert results[0][field] == results[1][field], field
    stats = ArtifactCache(tmp_path / "models").stats()
    assert stats["artifact_lifetime_builds"] == 1
    assert stats["artifact_entries"] == 1


def test_models_cli(tiny_ggufs: list[Path], tmp_path: Path, capsys: Any) -> None:
    from kvcellar.cli import main

    cache = ArtifactCache(tmp_path / "models")
    keys = _build_four(tiny_ggufs, cache)
    d = str(tmp_path)
    assert main(["models", "list", "--cache-dir", d]) == 0
    text = capsys.readouterr().out
    assert "3 entries" in text and "tiny-1" in text and keys[1][:10] in text

    assert main(["models", "list", "--cache-dir", d, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["key"] for e in listed["entries"]] == [keys[1], keys[2], keys[0]]  # LRU first
    assert listed["entries"][-1]["access_count"] == 2
    assert listed["stats"]["artifact_lifetime_builds"] == 3

    size = listed["entries"][0]["size_bytes"]
    max_gb = (size * 2.6) / (1 << 30)  # 3 entries > 2.6 s: evict down to 2.08 s -> one goes
    assert main(["models", "prune", "--cache-dir", d, "--max-gb", repr(max_gb), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicted"] == [keys[1]]

    assert main(["models", "clear", "--cache-dir", d]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert main(["models", "list", "--cache-dir", d, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == []
