"""Configuration: one typed ``Settings``, built by ``load_settings`` from defaults, a TOML
file, the environment and command-line flags.

Precedence, lowest to highest: dataclass defaults < config file (``--config`` or
``KVCELLAR_CONFIG``) < environment (``KVCELLAR_<FIELD>``, upper-case; ``KVCELLAR_ARTIFACT_<FIELD>``
for ``[artifacts]``) < CLI flags. Each section is a dataclass owned by the module that uses
it (this file holds the engine's); none of them imports this module.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcellar.artifacts.config import ENV_PREFIX as ARTIFACT_ENV_PREFIX
from kvcellar.artifacts.config import ArtifactConfig
from kvcellar.engine.config import EngineConfig
from kvcellar.paths import resolve_cache_dir
from kvcellar.server.config import ServerConfig
from kvcellar.storage.disk.config import DiskSettings
from kvcellar.storage.remote.config import RemoteSettings

ENV_PREFIX = "KVCELLAR_"


@dataclass
class Settings:
    """Everything a running kvcellar needs, merged from defaults, file, env and flags."""

    model: str | None = None
    cache_dir: Path = field(default_factory=resolve_cache_dir)
    engine: EngineConfig = field(default_factory=EngineConfig)
    disk: DiskSettings = field(default_factory=DiskSettings)
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    server: ServerConfig = field(default_factory=ServerConfig)
    artifacts: ArtifactConfig = field(default_factory=ArtifactConfig)

    @property
    def kv_root(self) -> Path:
        return self.cache_dir / "kv"


# The sections: a table of the config file each, and the prefix of their environment variables.
SECTIONS = {"engine": ENV_PREFIX, "disk": ENV_PREFIX, "remote": ENV_PREFIX, "server": ENV_PREFIX,
            "artifacts": ARTIFACT_ENV_PREFIX}
TOP_LEVEL_KEYS = ("model", "cache_dir")


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    model: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    flags: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """``Settings`` from defaults < config file < environment < flags, validated.

    ``config_file``: the TOML file (else ``KVCELLAR_CONFIG``, else none), with top-level
    ``model`` and ``cache_dir`` and a table per section; an unknown table or key is an error.
    ``flags``: per section, the values given on the command line (None: not given).
    """
    file_values = _read_config_file(config_file)
    unknown = sorted(set(file_values) - set(SECTIONS) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(f"config file: unknown table or key {', '.join(map(repr, unknown))} (known: "
                         f"{', '.join(TOP_LEVEL_KEYS)}, {', '.join(f'[{name}]' for name in SECTIONS)})")
    settings = Settings(
        model=model or file_values.get("model"),
        cache_dir=resolve_cache_dir(cache_dir or os.environ.get("KVCELLAR_CACHE_DIR") or file_values.get("cache_dir")),
    )
    for name, env_prefix in SECTIONS.items():
        section = getattr(settings, name)
        table = file_values.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"config file: {name!r} must be a table ([{name}])")
        _apply(section, table, source=f"config file [{name}]")
        _apply(section, _from_environment(section, env_prefix), source="environment")
        _apply(section, {k: v for k, v in (flags or {}).get(name, {}).items() if v is not None}, source="command line")
        section.validate()
    if not settings.engine.prefix_caching:  # nothing to store or look up below the RAM tier
        settings.disk.ssd_policy = "off"
        settings.remote.remote_url = ""
    return settings


def _read_config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    path = path or os.environ.get("KVCELLAR_CONFIG")
    if not path:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"config file {path}: {exc}") from exc


def _coerce(value: Any, to: type | str) -> Any:
    kind = to if isinstance(to, str) else getattr(to, "__name__", str(to))
    if isinstance(value, str):
        if kind.startswith("bool"):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    return value


def _apply(section: Any, values: Mapping[str, Any], *, source: str) -> None:
    """Set dataclass fields of ``section`` from ``values``; unknown keys are an error."""
    known = {f.name: f for f in dataclasses.fields(section)}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"{source}: unknown setting {key!r}")
        if value is None:
            continue
        try:
            setattr(section, name, _coerce(value, known[name].type))
        except ValueError as exc:
            raise ValueError(f"{source}: bad value for {key!r}: {exc}") from exc


def _from_environment(section: Any, prefix: str) -> dict[str, str]:
    """Environment values for the fields of ``section``: ``KVCELLAR_BLOCK_SIZE=32``."""
    out = {}
    for f in dataclasses.fields(section):
        raw = os.environ.get(prefix + f.name.upper())
        if raw is not None:
            out[f.name] = raw
    return out
