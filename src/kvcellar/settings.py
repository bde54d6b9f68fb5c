"""Configuration: one typed ``Settings``, built by ``load_settings`` from defaults, a TOML
file, the environment and command-line flags.

Precedence, lowest to highest: dataclass defaults < config file (``--config`` or
``KVCELLAR_CONFIG``) < environment (``KVCELLAR_<KEY>``, upper-case; ``KVCELLAR_ARTIFACT_<KEY>``
for ``[artifacts]``) < CLI flags. Each section is one dataclass, owned by the package that
reads it (``engine/config.py``, ``storage/disk/config.py``, ``storage/remote/config.py``,
``server/config.py``, ``artifacts/config.py``) and handed to it whole; none of them imports
this module, which sits above them all. A field's key is its name unless its ``key``
metadata names another (``ssd_policy`` for ``DiskConfig.policy``), given in ``unit``s of the
field; ``key=None`` is a knob users do not set. Each section is validated once, here.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from kvcellar.artifacts.config import ENV_PREFIX as ARTIFACT_ENV_PREFIX
from kvcellar.artifacts.config import ArtifactConfig
from kvcellar.engine.config import EngineConfig
from kvcellar.paths import resolve_cache_dir
from kvcellar.server.config import ServerConfig
from kvcellar.storage.block_format import CacheSecret
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.remote.config import RemoteConfig
from kvcellar.storage.secret import resolve_cache_secret

ENV_PREFIX = "KVCELLAR_"


@dataclass
class Settings:
    """Everything a running kvcellar needs, merged from defaults, file, env and flags."""

    model: str | None = None
    cache_dir: Path = field(default_factory=resolve_cache_dir)
    # The deployment secret the SSD and remote tiers seal blocks with (storage/block_format.py),
    # and during a rotation the ones before it (storage/secret.py says from where); None:
    # blocks are not sealed.
    cache_secret_file: Path | None = None
    cache_secret: CacheSecret | None = field(default=None, repr=False)
    engine: EngineConfig = field(default_factory=EngineConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    artifacts: ArtifactConfig = field(default_factory=ArtifactConfig)

    @property
    def kv_root(self) -> Path:
        return self.cache_dir / "kv"


# The sections: a table of the config file each, and the prefix of their environment variables.
SECTIONS = {"engine": ENV_PREFIX, "disk": ENV_PREFIX, "remote": ENV_PREFIX, "server": ENV_PREFIX,
            "artifacts": ARTIFACT_ENV_PREFIX}
TOP_LEVEL_KEYS = ("model", "cache_dir", "cache_secret_file", "cache_previous_secrets_file")


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    model: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_secret_file: str | os.PathLike[str] | None = None,
    cache_previous_secrets_file: str | os.PathLike[str] | None = None,
    flags: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """``Settings`` from defaults < config file < environment < flags, validated.

    ``config_file``: the TOML file (else ``KVCELLAR_CONFIG``, else none), with top-level
    ``model``, ``cache_dir``, ``cache_secret_file`` and ``cache_previous_secrets_file`` and a
    table per section; an unknown
    table or key is an error.
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
    settings.cache_secret_file, settings.cache_secret = resolve_cache_secret(
        cache_secret_file, cache_previous_secrets_file, file_values.get("cache_secret_file"),
        file_values.get("cache_previous_secrets_file"))
    for name, env_prefix in SECTIONS.items():
        section = getattr(settings, name)
        table = file_values.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"config file: {name!r} must be a table ([{name}])")
        _apply(section, table, source=f"config file [{name}]")
        _apply(section, _from_environment(section, env_prefix), source="environment")
        _apply(section, {k: v for k, v in (flags or {}).get(name, {}).items() if v is not None}, source="command line")
        section.validate()
    _tiers_follow_prefix_caching(settings)
    return settings


def _tiers_follow_prefix_caching(settings: Settings) -> None:
    """Prefix caching off (``--no-prefix-caching``) turns the SSD and remote tiers off,
    whatever their own settings say: with no prefix reused there is nothing to store below
    the RAM tier or to look up there. The flag's help and the README say so."""
    if not settings.engine.prefix_caching:
        settings.disk.policy = "off"
        settings.remote.url = ""


def _read_config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    path = path or os.environ.get("KVCELLAR_CONFIG")
    if not path:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"config file {path}: {exc}") from exc


@dataclass(frozen=True)
class _Key:
    """One key users set: the ``field`` of a section it fills, that field's type, and the
    ``unit`` the field counts the given value in (GiB given, bytes kept)."""

    field: str
    type: Any
    unit: float


def _keys(section: Any) -> dict[str, _Key]:
    """The keys of ``section`` (a section dataclass), by the name users give them."""
    hints = get_type_hints(type(section))
    keys = {}
    for f in dataclasses.fields(section):
        key = f.metadata.get("key", f.name)
        if key is not None:
            keys[key] = _Key(f.name, hints[f.name], f.metadata.get("unit", 1))
    return keys


def _coerce(value: Any, key: _Key) -> Any:
    """``value`` as given (a TOML value, an environment string, a parsed flag) in the type of
    ``key``'s field. A string is parsed by that type; a ``Literal``'s by its choices' type, so
    ``"8"`` is the 8 of ``Literal[16, 8, 4]`` (whether it is a choice is ``validate``'s to say)."""
    to = key.type
    if get_origin(to) in (Union, types.UnionType):  # X | None: no string means None
        to = next(arm for arm in get_args(to) if arm is not type(None))
    if get_origin(to) is Literal:
        to = type(get_args(to)[0])
    if key.unit != 1:  # given in units (GiB, days), kept in the field's (bytes, seconds)
        return to(_parse(value, float) * key.unit)
    return _parse(value, to)


def _parse(value: Any, to: type) -> Any:
    if not isinstance(value, str):
        return value
    if to is bool:
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    if to in (int, float):
        return to(value)
    return value


def _apply(section: Any, values: Mapping[str, Any], *, source: str) -> None:
    """Set fields of ``section`` from ``values`` by key; unknown keys are an error."""
    keys = _keys(section)
    for given, value in values.items():
        name = given.replace("-", "_")
        if name not in keys:
            raise ValueError(f"{source}: unknown setting {given!r}")
        if value is None:
            continue
        try:
            setattr(section, keys[name].field, _coerce(value, keys[name]))
        except ValueError as exc:
            raise ValueError(f"{source}: bad value for {given!r}: {exc}") from exc


def _from_environment(section: Any, prefix: str) -> dict[str, str]:
    """Environment values for the keys of ``section``: ``KVCELLAR_BLOCK_SIZE=32``."""
    out = {}
    for key in _keys(section):
        raw = os.environ.get(prefix + key.upper())
        if raw is not None:
            out[key] = raw
    return out
