"""The config file's ``[artifacts]`` table reaches every command that loads a model
(``serve``, ``generate``), not only ``kvcellar models``."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kvcellar.cli import build_parser, load_settings
from kvcellar.runtime import open_artifacts
from tests.helpers import kvcellar_command


def settings_with(tmp_path: Path, table: str, command: str = "serve"):
    config = tmp_path / "kvcellar.toml"
    config.write_text(f"[artifacts]\n{table}\n")
    argv = ["--config", str(config), command, "--cache-dir", str(tmp_path / "cache")]
    if command == "generate":
        argv += ["--prompt", "hi"]
    return load_settings(build_parser().parse_args(argv))


def test_serve_and_generate_open_the_cache_with_the_files_artifacts_table(tmp_path: Path) -> None:
    for command in ("serve", "generate"):
        settings = settings_with(tmp_path, 'verify = "full"\nmax_gb = 3', command)
        assert (settings.artifacts.verify, settings.artifacts.max_gb) == ("full", 3)
        cache = open_artifacts(settings)
        assert cache is not None
        try:
            assert cache.root == tmp_path / "cache" / "models"
            assert (cache.verify, cache.max_bytes) == ("full", 3 << 30)
        finally:
            cache.close()


def test_artifacts_turned_off_in_the_file_load_without_the_cache(tmp_path: Path) -> None:
    settings = settings_with(tmp_path, "enabled = false")
    assert open_artifacts(settings) is None


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVCELLAR_ARTIFACT_MAX_GB", "7")
    assert settings_with(tmp_path, "max_gb = 3").artifacts.max_gb == 7


def test_a_bad_value_stops_generate_before_any_model_is_loaded(tmp_path: Path) -> None:
    config = tmp_path / "kvcellar.toml"
    config.write_text('[artifacts]\nverify = "sometimes"\n')
    done = subprocess.run([*kvcellar_command(), "--config", str(config), "generate", "--prompt", "hi",
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "artifacts.verify" in done.stderr
    assert not (tmp_path / "cache" / "models").exists()
