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


def test_the_cache_secret_comes_from_a_file_or_the_environment_and_is_never_printed(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("KVCELLAR_CACHE_SECRET", raising=False)
    monkeypatch.delenv("KVCELLAR_CACHE_SECRET_FILE", raising=False)
    assert settings_for().cache_secret is None
    secret = tmp_path / "secret"
    secret.write_text("  s3cret-shared-by-every-replica\n")
    secret.chmod(0o600)
    s = settings_for("--cache-secret-file", str(secret))
    assert s.cache_secret.current == b"s3cret-shared-by-every-replica" and "s3cret" not in repr(s)
    assert not caplog.records
    secret.chmod(0o644)
    conf = tmp_path / "kvcellar.toml"
    conf.write_text(f'cache_secret_file = "{secret}"\n')
    monkeypatch.setenv("KVCELLAR_CONFIG", str(conf))
    assert settings_for().cache_secret.current == b"s3cret-shared-by-every-replica"
    assert "can be read by other users" in caplog.text
    monkeypatch.setenv("KVCELLAR_CACHE_SECRET", "from-the-environment-0123")
    assert settings_for().cache_secret.current == b"from-the-environment-0123"

    # a rotation: the secrets before it, one a line, accepted on reads
    previous = tmp_path / "previous"
    previous.write_text("the-secret-before-this-one\n\n  and-the-one-before-that  \n")
    previous.chmod(0o600)
    s = settings_for("--cache-previous-secrets-file", str(previous))
    assert s.cache_secret.current == b"from-the-environment-0123"
    assert s.cache_secret.previous == (b"the-secret-before-this-one", b"and-the-one-before-that")
    assert "the-secret" not in repr(s)
    monkeypatch.setenv("KVCELLAR_CACHE_PREVIOUS_SECRETS_FILE", str(previous))
    assert len(settings_for().cache_secret.previous) == 2


@pytest.mark.parametrize(("env", "needle"), [({"KVCELLAR_CACHE_SECRET": ""}, "at least 16 bytes"),
                                             ({"KVCELLAR_CACHE_SECRET": "short"}, "at least 16 bytes"),
                                             ({"KVCELLAR_CACHE_SECRET_FILE": "/nonexistent/secret"}, "No such file"),
                                             ({"KVCELLAR_CACHE_PREVIOUS_SECRETS_FILE": "/dev/null/x"},
                                              "Not a directory")])
def test_a_bad_cache_secret_is_a_clear_error(env, needle, capsys, tmp_path, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", "--cache-dir", str(tmp_path)]) == 2
    assert needle in capsys.readouterr().err


def test_previous_secrets_without_a_current_one_are_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("KVCELLAR_CACHE_SECRET", raising=False)
    monkeypatch.delenv("KVCELLAR_CACHE_SECRET_FILE", raising=False)
    previous = tmp_path / "previous"
    previous.write_text("the-secret-before-this-one\n")
    assert main(["serve", "--cache-dir", str(tmp_path), "--cache-previous-secrets-file", str(previous)]) == 2
    assert "but no current one" in capsys.readouterr().err
