"""The disk tier's settings as users give them: ``[disk]`` in the TOML file, ``KVCELLAR_SSD_*``
in the environment, ``kvcellar serve`` flags; each reaches the ``DiskConfig`` the tier reads."""

from __future__ import annotations

import pytest

from kvcellar.cli import build_parser, main, settings_from_args
from kvcellar.storage.disk import DiskConfig


def settings_for(*argv: str):
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_persistent_retries_from_file_environment_and_flag(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVCELLAR_SSD_PERSISTENT_RETRIES", raising=False)
    monkeypatch.delenv("KVCELLAR_CONFIG", raising=False)
    assert settings_for().disk.persistent_retries == DiskConfig().persistent_retries == 3
    conf = tmp_path / "kvcellar.toml"
    conf.write_text('[disk]\nssd_durability = "persistent"\nssd_persistent_retries = 7\n')
    monkeypatch.setenv("KVCELLAR_CONFIG", str(conf))
    disk = settings_for().disk
    assert (disk.durability, disk.persistent_retries) == ("persistent", 7)
    monkeypatch.setenv("KVCELLAR_SSD_PERSISTENT_RETRIES", "5")  # the environment over the file
    assert settings_for().disk.persistent_retries == 5
    flagged = settings_for("--ssd-persistent-retries", "0")  # a flag over both; 0: one attempt
    assert flagged.disk.persistent_retries == 0


def test_bad_persistent_retries_is_a_clear_error(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVCELLAR_SSD_PERSISTENT_RETRIES", raising=False)
    monkeypatch.delenv("KVCELLAR_CONFIG", raising=False)
    assert main(["serve", "--cache-dir", str(tmp_path), "--ssd-persistent-retries", "-1"]) == 2
    assert "ssd_persistent_retries" in capsys.readouterr().err
    monkeypatch.setenv("KVCELLAR_SSD_PERSISTENT_RETRIES", "often")
    with pytest.raises(ValueError, match="ssd_persistent_retries"):
        settings_for()
    with pytest.raises(ValueError, match="persistent_retries"):
        DiskConfig(persistent_retries=-1).validate()


def test_evict_wait_from_file_environment_and_flag_and_bad_values(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVCELLAR_SSD_EVICT_WAIT_S", raising=False)
    monkeypatch.delenv("KVCELLAR_CONFIG", raising=False)
    assert settings_for().disk.evict_wait_s == DiskConfig().evict_wait_s == 0.05
    conf = tmp_path / "kvcellar.toml"
    conf.write_text("[disk]\nssd_evict_wait_s = 0.2\n")
    monkeypatch.setenv("KVCELLAR_CONFIG", str(conf))
    assert settings_for().disk.evict_wait_s == 0.2
    monkeypatch.setenv("KVCELLAR_SSD_EVICT_WAIT_S", "0.5")
    assert settings_for().disk.evict_wait_s == 0.5
    assert settings_for("--ssd-evict-wait", "0").disk.evict_wait_s == 0  # never wait
    assert main(["serve", "--cache-dir", str(tmp_path), "--ssd-evict-wait", "-1"]) == 2
    assert "ssd_evict_wait_s" in capsys.readouterr().err
