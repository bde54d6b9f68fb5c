"""The remote tier's settings: flags over environment over ``[remote]`` in the TOML file,
and clear errors for bad values (exit code 2 from the CLI, not a traceback)."""

from __future__ import annotations

import pytest

from kvcellar.cli import build_parser, main, settings_from_args


def settings_for(*argv: str):
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_flags_over_environment_over_file(tmp_path, monkeypatch):
    conf = tmp_path / "kvcellar.toml"
    conf.write_text('[remote]\nremote_url = "redis://file:6379/0"\nremote_policy = "read_only"\nremote_ttl_s = 60\n')
    monkeypatch.setenv("KVCELLAR_CONFIG", str(conf))
    s = settings_for()
    assert (s.remote.url, s.remote.policy, s.remote.ttl_s) == \
        ("redis://file:6379/0", "read_only", 60)
    monkeypatch.setenv("KVCELLAR_REMOTE_URL", "rediss://env:6380/1")
    assert settings_for().remote.url == "rediss://env:6380/1"
    s = settings_for("--remote-url", "redis+cluster://flag:7000", "--remote-policy", "evict_only",
                     "--remote-timeout", "0.1")
    assert (s.remote.url, s.remote.policy, s.remote.timeout_s) == \
        ("redis+cluster://flag:7000", "evict_only", 0.1)
    assert settings_for("--remote-url", "redis://x:1/0", "--no-prefix-caching").remote.url == ""


def test_no_url_means_no_remote_tier():
    assert settings_for().remote.url == ""


@pytest.mark.parametrize("argv", [["--remote-url", "http://host:6379"],
                                  ["--remote-url", "redis://h:1", "--remote-timeout", "0"]])
def test_bad_values_are_clear_errors(argv, capsys, tmp_path):
    assert main(["serve", "--cache-dir", str(tmp_path), *argv]) == 2
    assert "remote" in capsys.readouterr().err
