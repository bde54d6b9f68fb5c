"""The artifact cache with tiny real GGUF models: identity, validation, corruption, index,
fallbacks and what is (not) stored."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcellar.artifacts import ArtifactCache
from kvcellar.artifacts.locks import FileLock
from kvcellar.artifacts.prepare import read_quantized
from kvcellar.engine.linears import row_layout
from kvcellar.engine.loader import LoadedModel
from kvcellar.identity import file_sha256
from kvcellar.runtime import open_artifacts, prepare_and_load
from kvcellar.settings import Settings
from tests.artifacts.helpers import greedy


def _cache(cache_dir: Path, **kw: object) -> ArtifactCache:
    return ArtifactCache(cache_dir / "models", **kw)  # type: ignore[arg-type]


def _load(gguf: Path, cache_dir: Path | None = None, **kw: object) -> LoadedModel:
    """Load as ``build_engine`` does, through the artifact cache under ``cache_dir`` if given."""
    cache = None if cache_dir is None else open_artifacts(Settings(cache_dir=cache_dir))
    kw.setdefault("weights", "full")  # these tests are about the dense entry (auto picks int8 for Q8_0)
    return prepare_and_load(str(gguf), device="cpu", artifacts=cache, **kw)  # type: ignore[arg-type]


def test_identity_and_outputs_equal_direct_prepared_and_cached(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    direct = _load(tiny_ggufs[0])  # no cache: dequantized in memory, as without this module
    first = _load(tiny_ggufs[0], tmp_path)
    second = _load(tiny_ggufs[0], tmp_path)
    assert direct.artifact is None
    assert first.artifact.built and second.artifact.hit
    for m in (first, second):
        assert (m.weights_id, m.tokenizer_id, m.dtype) == (direct.weights_id, direct.tokenizer_id, direct.dtype)
        assert m.eos_token_ids == direct.eos_token_ids
    assert greedy(direct) == greedy(first) == greedy(second)
    assert greedy(direct, "or the hello") == greedy(second, "or the hello")


def test_dtype_is_part_of_the_key(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    bf16 = _load(tiny_ggufs[0], tmp_path, dtype="bfloat16")
    fp32 = _load(tiny_ggufs[0], tmp_path, dtype="float32")
    assert bf16.artifact.key != fp32.artifact.key
    assert fp32.artifact.built
    assert bf16.weights_id == fp32.weights_id
    assert len(_cache(tmp_path).entries()) == 2


def _flip(path: Path, keep_mtime: bool = False) -> None:
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2 + 123)  # between the sampled windows
        old = fh.read(16)
        fh.seek(-16, os.SEEK_CUR)
        fh.write(bytes(b ^ 0xFF for b in old))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


DAMAGE = {
    # name: (damage, caught by the start-up scan already)
    "flip-weights": (lambda e: _flip(e / "model.safetensors"), False),
    "flip-weights-mtime-restored": (lambda e: _flip(e / "model.safetensors", keep_mtime=True), False),
    "flip-tokenizer": (lambda e: _flip(e / "tokenizer.json", keep_mtime=True), False),
    "truncate-weights": (lambda e: os.truncate(e / "model.safetensors", 1000), True),
    "delete-tokenizer": (lambda e: (e / "tokenizer.json").unlink(), True),
    "delete-config": (lambda e: (e / "config.json").unlink(), True),
    "delete-manifest": (lambda e: (e / "manifest.json").unlink(), True),
    "garbage-manifest": (lambda e: (e / "manifest.json").write_text("{not json"), True),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_entry_is_detected_and_rebuilt(kind: str, tiny_ggufs: list[Path], tmp_path: Path) -> None:
    first = _load(tiny_ggufs[1], tmp_path)
    expected = greedy(first)
    entry = first.artifact.path
    first.artifact.release()
    damage, at_startup = DAMAGE[kind]
    damage(entry)

    cache = _cache(tmp_path)  # a new start: the start-up scan runs here
    assert (not entry.exists()) == at_startup
    assert cache.stats()["artifact_corrupt"] == (1 if at_startup else 0)

    again = prepare_and_load(str(tiny_ggufs[1]), device="cpu", artifacts=cache, weights="full")
    assert again.artifact.built, "a damaged entry must be rebuilt, never loaded"
    assert cache.stats()["artifact_corrupt"] == 1
    assert cache.stats()["artifact_lifetime_builds"] == 2
    assert (again.weights_id, again.tokenizer_id) == (first.weights_id, first.tokenizer_id)
    assert greedy(again) == expected
    assert not list((tmp_path / "models" / "tmp").iterdir())


def test_fast_verify_trusts_unchanged_stats_full_verify_does_not(tmp_path: Path) -> None:
    """The documented trade-off, on an entry whose weights file (13 MB) is sampled, not
    hashed whole, by the fast check: content changed without any write the filesystem
    records (bit rot) between sampled windows passes ``fast``; ``full`` and ``models verify``
    catch it. Any ordinary write changes mtime/ctime and is caught by ``fast`` too."""
    from kvcellar.artifacts.manifest import SAMPLE_WHOLE_LIMIT, stat_signature
    from tests.artifacts.helpers import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "wide.gguf", seed=9, hidden=256, ffn=4096)
    first = _load(gguf, tmp_path)
    entry, key = first.artifact.path, first.artifact.key
    assert (entry / "model.safetensors").stat().st_size > SAMPLE_WHOLE_LIMIT
    first.artifact.release()

    _flip(entry / "model.safetensors")  # an ordinary write: caught by the stat check
    assert _load(gguf, tmp_path).artifact.built

    _flip(entry / "model.safetensors")
    cache = _cache(tmp_path)  # simulate bit rot: the index still trusts the file's stat
    cache.index.set_verified(key, {p.name: stat_signature(p) for p in entry.iterdir() if p.name != "manifest.json"})
    assert prepare_and_load(str(gguf), device="cpu", artifacts=cache, weights="full").artifact.hit
    assert prepare_and_load(str(gguf), device="cpu", artifacts=_cache(tmp_path, verify="full"),
                            weights="full").artifact.built

    _flip(entry / "model.safetensors")
    _cache(tmp_path).index.set_verified(key, {p.name: stat_signature(p) for p in entry.iterdir()
                                              if p.name != "manifest.json"})
    assert _cache(tmp_path).verify_all() == {"ok": [], "corrupt": [key]}
    assert not entry.exists()


def test_entry_that_validates_but_fails_to_load_is_dropped_and_rebuilt(tiny_ggufs: list[Path],
                                                                      tmp_path: Path) -> None:
    """A bad build (manifest consistent with broken files) is caught by loading, once."""
    first = _load(tiny_ggufs[2], tmp_path)
    expected = greedy(first)
    entry = first.artifact.path
    first.artifact.release()
    (entry / "config.json").write_text('{"model_type": "no-such-architecture"}')
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["files"]["config.json"] = {"size": (entry / "config.json").stat().st_size,
                                        "sha256": file_sha256(entry / "config.json"),
                                        "sample": _sample(entry / "config.json")}
    (entry / "manifest.json").write_text(json.dumps(manifest))

    again = _load(tiny_ggufs[2], tmp_path)
    assert again.artifact.built
    assert greedy(again) == expected
    assert _cache(tmp_path).stats()["artifact_lifetime_corrupt"] == 1


def _sample(path: Path) -> str:
    from kvcellar.artifacts.manifest import sample_digest

    return sample_digest(path)


def test_leftover_build_dirs_removed_unless_their_builder_is_alive(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    dead = cache.tmp_dir / ("a" * 32 + ".999999.dead")
    live = cache.tmp_dir / ("b" * 32 + ".1.live")
    trash = cache.tmp_dir / ("trash-" + "c" * 32 + "-x")
    for d in (dead, live, trash):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    with FileLock(cache.locks_dir / f"{'b' * 32}.build") as builder:
        builder.acquire(exclusive=True)  # a live builder of key b...
        _cache(tmp_path)  # a new start: its scan removes what no live builder owns
    assert live.exists() and not dead.exists() and not trash.exists()


def test_index_is_rebuilt_from_the_entries(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    first = _load(tiny_ggufs[3], tmp_path)
    first.artifact.release()
    index = tmp_path / "models" / "index.sqlite"
    for suffix in ("", "-wal", "-shm"):
        Path(str(index) + suffix).unlink(missing_ok=True)
    cache = _cache(tmp_path)
    assert [e.key for e in cache.entries()] == [first.artifact.key]
    again = prepare_and_load(str(tiny_ggufs[3]), device="cpu", artifacts=cache, weights="full")
    assert again.artifact.hit  # re-registered, fully re-verified, not rebuilt
    assert cache.index.get(first.artifact.key).verified
    again.artifact.release()

    cache.close()
    for suffix in ("-wal", "-shm"):
        Path(str(index) + suffix).unlink(missing_ok=True)
    index.write_bytes(b"this is not a database" * 100)
    cache = _cache(tmp_path)
    assert prepare_and_load(str(tiny_ggufs[3]), device="cpu", artifacts=cache, weights="full").artifact.hit


def test_source_digest_is_memoized_and_follows_changes(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    src = tmp_path / "copy.gguf"
    shutil.copy(tiny_ggufs[0], src)
    d1 = cache.file_digest(src)
    d2 = cache.file_digest(src)
    assert d1 == d2 == file_sha256(src)
    assert cache.stats()["artifact_digest_hits"] == 1
    shutil.copy(tiny_ggufs[1], src)  # new content under the same path
    assert cache.file_digest(src) == file_sha256(tiny_ggufs[1]) != d1
    assert _cache(tmp_path).file_digest(src) == file_sha256(tiny_ggufs[1])  # persisted across opens


def test_hf_format_dirs_load_in_place_and_are_not_copied(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    prepared = _load(tiny_ggufs[0], tmp_path / "a")
    hf_dir = tmp_path / "hf-model"
    shutil.copytree(prepared.artifact.path, hf_dir)
    (hf_dir / "manifest.json").unlink()
    loaded = _load(hf_dir, tmp_path / "b")
    assert loaded.artifact is None
    assert not list((tmp_path / "b" / "models" / "entries").iterdir())
    assert loaded.weights_id.startswith("dir-sha256:")
    assert greedy(loaded) == greedy(prepared)


def test_unusable_cache_dir_falls_back_to_loading_the_gguf(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    loaded = _load(tiny_ggufs[0], not_a_dir)
    assert loaded.artifact is None
    direct = _load(tiny_ggufs[0])
    assert (loaded.weights_id, loaded.tokenizer_id) == (direct.weights_id, direct.tokenizer_id)


def test_disk_full_while_preparing_falls_back_and_leaves_nothing(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        loaded = _load(tiny_ggufs[0], mnt)  # the entry (~190 KB) does not fit
        assert loaded.artifact is None
        assert greedy(loaded) == greedy(_load(tiny_ggufs[0]))
        assert not list((mnt / "models" / "tmp").iterdir())
        assert not list((mnt / "models" / "entries").iterdir())
    finally:
        gc.collect()  # the cache's index connection lives on the mount
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_config_precedence_and_disabling(tiny_ggufs: list[Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcellar.settings import load_settings

    assert load_settings().artifacts.max_gb == 50.0
    config = tmp_path / "kvcellar.toml"
    config.write_text('[artifacts]\nmax_gb = 9\nverify = "fast"\n')
    monkeypatch.setenv("KVCELLAR_ARTIFACT_MAX_GB", "2.5")
    monkeypatch.setenv("KVCELLAR_ARTIFACT_VERIFY", "full")
    cfg = load_settings(config).artifacts
    assert (cfg.max_gb, cfg.verify, cfg.max_bytes) == (2.5, "full", int(2.5 * (1 << 30)))
    assert load_settings(config, flags={"artifacts": {"max_gb": 1.0}}).artifacts.max_gb == 1.0
    monkeypatch.setenv("KVCELLAR_ARTIFACT_VERIFY", "sometimes")
    with pytest.raises(ValueError, match="verify"):
        load_settings()
    monkeypatch.delenv("KVCELLAR_ARTIFACT_VERIFY")
    monkeypatch.setenv("KVCELLAR_ARTIFACT_ENABLED", "0")
    artifacts = open_artifacts(load_settings(cache_dir=tmp_path))
    assert artifacts is None
    loaded = prepare_and_load(str(tiny_ggufs[0]), device="cpu", artifacts=artifacts, weights="full")
    assert loaded.artifact is None and not (tmp_path / "models").exists()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_linears_are_an_entry_of_their_own(tiny_ggufs: list[Path], tmp_path: Path, mode: str) -> None:
    """``--weights int8|int4`` on a GGUF: the quantized form is stored beside the dense
    entry, read back on the next start (not quantized again), and gives the same weights
    and outputs as quantizing without the cache."""
    import torch

    direct = _load(tiny_ggufs[1], weights=mode)
    first = _load(tiny_ggufs[1], tmp_path, weights=mode)
    second = _load(tiny_ggufs[1], tmp_path, weights=mode)
    assert direct.quantized_artifact is None
    assert first.quantized_artifact.built and second.quantized_artifact.hit and second.artifact.hit
    assert first.quantized_artifact.key != first.artifact.key
    assert second.quantized_artifact.manifest.info["linears"] == 1 + 7 * 2
    assert sorted(direct.quantized) == sorted(second.quantized) and len(direct.quantized) == 1 + 7 * 2
    for name, q in direct.quantized.items():
        got = row_layout(second.quantized[name])  # int4 linears stored as this CPU's panels: the same values
        assert got.kind == q.kind and torch.equal(got.qweight, q.qweight) and torch.equal(got.scales, q.scales)
    from kvcellar.engine.loader import resolve_serving
    from kvcellar.model_source import resolve_source

    # ``--dtype auto``: on a CPU without native bf16 the kernels' bf16 activations are named too
    suffix = resolve_serving("auto", mode, resolve_source(str(tiny_ggufs[1])), torch.device("cpu")).weights_suffix
    assert suffix.startswith(f"|weights={mode}")
    assert direct.weights_id == first.weights_id == second.weights_id == _load(tiny_ggufs[1]).weights_id + suffix
    assert greedy(direct) == greedy(second)
    from safetensors import safe_open

    with safe_open(str(second.quantized_artifact.path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names and all(n.endswith((".qweight", ".scales", ".offsets")) for n in names)  # linears only
    # the dense entry, shared, and the quantized one, which holds the int4 linears as this CPU's
    # panels where kvcellar's kernels run, and not in the row layout too
    panels = {n for n, q in read_quantized(second.quantized_artifact).items() if q.panels}
    assert bool(panels) == (mode == "int4" and second.kernel_dtype == torch.int8)
    assert not any(n.startswith(tuple(f"{p}." for p in panels)) for n in names)
    assert len(_cache(tmp_path).entries()) == 2


def test_a_damaged_quantized_entry_is_rebuilt(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    first = _load(tiny_ggufs[2], tmp_path, weights="int4")
    entry = first.quantized_artifact.path / "model.safetensors"
    first.quantized_artifact.release()
    first.artifact.release()
    _flip(entry)
    again = _load(tiny_ggufs[2], tmp_path, weights="int4")
    assert again.quantized_artifact.built, "a damaged entry must be rebuilt, never loaded"
    assert greedy(again) == greedy(_load(tiny_ggufs[2], weights="int4"))
