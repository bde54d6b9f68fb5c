"""The config file's ``[artifacts]`` table reaches every command that loads a model
(``serve``, ``generate``), not only ``kvcellar models``; unknown tables and keys are errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvcellar.cli import build_parser, settings_from_args
from kvcellar.runtime import open_artifacts
from tests.helpers import ServerProcess, kvcellar_command


def settings_with(tmp_path: Path, table: str, command: str = "serve"):
    config = tmp_path / "kvcellar.toml"
    config.write_text(f"[artifacts]\n{table}\n")
    argv = ["--config", str(config), command, "--cache-dir", str(tmp_path / "cache")]
    if command == "generate":
        argv += ["--prompt", "hi"]
    return settings_from_args(build_parser().parse_args(argv))


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


def _generate(gguf: Path, cache_dir: Path, config: Path | None) -> subprocess.CompletedProcess[str]:
    argv = [*kvcellar_command(), *(["--config", str(config)] if config else []), "generate", "--model", str(gguf),
            "--prompt", "hello", "--max-tokens", "3", "--dtype", "float32", "--kv-cache-gb", "0.01",
            "--ssd-policy", "off", "--cache-dir", str(cache_dir)]
    env = {k: v for k, v in os.environ.items() if k != "KVCELLAR_CONFIG"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def test_generate_honours_the_files_artifacts_table(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    config = tmp_path / "kvcellar.toml"
    config.write_text("[artifacts]\nenabled = false\n")
    off = _generate(tiny_ggufs[0], tmp_path / "off", config)
    assert off.returncode == 0, off.stderr[-2000:]
    assert not (tmp_path / "off" / "models").exists()
    on = _generate(tiny_ggufs[0], tmp_path / "on", None)  # the same command without the file prepares
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout == off.stdout
    assert list((tmp_path / "on" / "models" / "entries").iterdir())


def test_a_running_server_uses_the_files_artifacts_table(tiny_ggufs: list[Path], tmp_path: Path) -> None:
    config = tmp_path / "kvcellar.toml"
    config.write_text("[artifacts]\nmax_gb = 3\n")
    # full weights: one entry (auto keeps a quantized form beside the dense one)
    server = ServerProcess(tmp_path / "cache", "--model", str(tiny_ggufs[0]), "--ssd-policy", "off", "--weights",
                           "full", env={"KVCELLAR_CONFIG": str(config)})
    server.start()
    try:
        artifact = server.health()["artifact"]
    finally:
        server.stop()
    assert artifact["artifact_bytes_limit"] == 3 << 30  # default: 50 GiB
    assert artifact["artifact_entries"] == 1


@pytest.mark.parametrize(("text", "needle"), [
    ("[artifact]\nmax_gb = 3\n", "unknown table or key 'artifact'"),
    ("[artifacts]\nmax_size = 3\n", "config file [artifacts]: unknown setting 'max_size'"),
    ("artifacts = 3\n", "'artifacts' must be a table"),
])
def test_unknown_tables_and_keys_are_clear_errors(tmp_path: Path, text: str, needle: str, capsys) -> None:
    from kvcellar.cli import main

    config = tmp_path / "kvcellar.toml"
    config.write_text(text)
    assert main(["--config", str(config), "generate", "--prompt", "hi", "--cache-dir", str(tmp_path)]) == 2
    assert needle in capsys.readouterr().err
    assert main(["--config", str(config), "models", "list", "--cache-dir", str(tmp_path)]) == 2
