"""Configuration: one object, filled from defaults, a TOML file, the environment and CLI flags.

Precedence, lowest to highest: dataclass defaults < config file (``--config`` or
``KVCELLAR_CONFIG``) < environment (``KVCELLAR_<FIELD>``, upper-case) < CLI flags.
Each section is a dataclass owned by the module that uses it; this file only holds
the engine's knobs and the merging logic.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcellar.storage.remote.config import RemoteSettings

if TYPE_CHECKING:
    from kvcellar.artifacts.config import ArtifactConfig

DEFAULT_CACHE_DIR = Path("~/.cache/kvcellar")


def resolve_cache_dir(arg: str | os.PathLike[str] | None = None) -> Path:
    """``--cache-dir``, else ``KVCELLAR_CACHE_DIR``, else ``~/.cache/kvcellar``."""
    raw = arg or os.environ.get("KVCELLAR_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(raw).expanduser().resolve()


@dataclass
class EngineConfig:
    """Knobs of the paged-KV engine and its RAM prefix cache."""

    # Tokens per KV block. Chosen by the block-size sweep in benchmarks/bench_prefix_cache.py.
    block_size: int = 16
    # Memory for the RAM tier's KV block pool, in GiB. The pool is allocated up front.
    kv_cache_gb: float = 2.0
    # Exact pool size in blocks; overrides kv_cache_gb when > 0.
    kv_cache_blocks: int = 0
    # Upper bound on sequences in the running batch.
    max_num_seqs: int = 32
    # Per-step token budget: decodes first, then prefill chunks fill what is left, so a long
    # prompt never stalls running decodes for more than one budget's worth of compute.
    max_step_tokens: int = 512
    # Budget of a step in which no sequence is decoding: nobody waits between tokens, so a
    # long prompt goes in fewer, larger chunks. Measured (bf16, 2 cores, benchmarks/
    # bench_engine.py): prefill vs one transformers forward at 2048/4096 tokens went from
    # 0.87x/0.97x (512-token chunks) to 1.04x/1.00x. The price: a request arriving meanwhile
    # waits for that larger step (2.7 s for 2048 tokens here) before its own first one. 0: max_step_tokens.
    max_prefill_step_tokens: int = 2048
    # Largest prompt + completion accepted; 0 means the model's own context length.
    max_model_len: int = 0
    # Reuse of cached prefix blocks; off only for comparisons and tests.
    prefix_caching: bool = True
    # Bytes of the chained digest used as the hash-table key. Tests shrink it to force
    # collisions; a hit always compares the full digest and the token ids.
    key_bytes: int = 32
    # Prefetch (engine/prefetch.py): a queued request's next blocks in a lower tier are read
    # while it waits, into free or least recently used cached blocks: at most this fraction
    # of the pool read into or held for waiting requests (0 turns prefetch off), by at most
    # prefetch_max_reads reads in flight.
    prefetch_pool_fraction: float = 0.25
    prefetch_max_reads: int = 4
    dtype: str = "auto"
    device: str = "auto"
    # The server runs every code path once before /health turns 200 (engine/warmup.py), so
    # the first request after a start pays no one-off costs.
    warmup: bool = True
    # full: weights in ``dtype``; int8: weight-only int8 linears (engine/quantization.py),
    # half the bytes a decode step reads.
    weights: str = "full"


SSD_POLICIES = ("write_through", "evict_only", "off")


@dataclass
class DiskSettings:
    """Knobs of the SSD tier (SPEC §5), as users set them; ``to_tier_config`` maps them
    onto ``storage.disk.DiskTierConfig``. Environment: ``KVCELLAR_SSD_POLICY=evict_only``."""

    # write_through: every new full block goes to disk; evict_only: blocks go to disk when
    # the RAM tier drops them; off: RAM only.
    ssd_policy: str = "write_through"
    # best_effort: one try, no fsync; persistent: fsync before a block counts, bounded retries.
    ssd_durability: str = "best_effort"
    ssd_async: bool = True
    ssd_queue_blocks: int = 256
    ssd_flush_interval_s: float = 1.0
    disk_cache_gb: float = 20.0
    # Free space the tier always leaves on the filesystem. None (default): min(1 GiB, 5 % of
    # the filesystem), so a small cache filesystem still gets a cache.
    disk_min_free_gb: float | None = None
    ssd_ttl_days: float = 7.0
    ssd_prune_interval_s: float = 600.0
    ssd_io_threads: int = 8

    def validate(self) -> None:
        if self.ssd_policy not in SSD_POLICIES:
            raise ValueError(f"ssd_policy must be one of {', '.join(SSD_POLICIES)}, not {self.ssd_policy!r}")
        if self.ssd_durability not in ("best_effort", "persistent"):
            raise ValueError(f"ssd_durability must be best_effort or persistent, not {self.ssd_durability!r}")
        if self.disk_cache_gb < 0 or (self.disk_min_free_gb or 0) < 0 or self.ssd_ttl_days <= 0:
            raise ValueError("disk_cache_gb and disk_min_free_gb must be >= 0, ssd_ttl_days > 0")

    def to_tier_config(self) -> Any:
        from kvcellar.storage.disk.config import DiskTierConfig

        self.validate()
        return DiskTierConfig(
            durability=self.ssd_durability,  # type: ignore[arg-type]
            async_writes=self.ssd_async,
            queue_blocks=self.ssd_queue_blocks,
            flush_interval_s=self.ssd_flush_interval_s,
            capacity_bytes=int(self.disk_cache_gb * (1 << 30)),
            min_free_bytes=None if self.disk_min_free_gb is None else int(self.disk_min_free_gb * (1 << 30)),
            ttl_s=self.ssd_ttl_days * 86400.0,
            prune_interval_s=self.ssd_prune_interval_s,
            io_threads=self.ssd_io_threads,
        )


def _default_artifacts() -> ArtifactConfig:
    from kvcellar.artifacts.config import ArtifactConfig  # artifacts.config builds on this module

    return ArtifactConfig()


@dataclass
class Settings:
    """Everything a running kvcellar needs, merged from defaults, file, env and flags."""

    model: str | None = None
    cache_dir: Path = field(default_factory=resolve_cache_dir)
    engine: EngineConfig = field(default_factory=EngineConfig)
    disk: DiskSettings = field(default_factory=DiskSettings)
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    artifacts: ArtifactConfig = field(default_factory=_default_artifacts)
    sections: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_root(self) -> Path:
        return self.cache_dir / "kv"


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


def apply_overrides(obj: Any, values: dict[str, Any], *, source: str) -> None:
    """Set dataclass fields of ``obj`` from ``values``; unknown keys are an error."""
    known = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"{source}: unknown setting {key!r}")
        if value is None:
            continue
        try:
            setattr(obj, name, _coerce(value, known[name].type))
        except ValueError as exc:
            raise ValueError(f"{source}: bad value for {key!r}: {exc}") from exc


def env_overrides(obj: Any, prefix: str = "KVCELLAR_") -> dict[str, str]:
    """Environment values for the fields of ``obj``: ``KVCELLAR_BLOCK_SIZE=32``."""
    out = {}
    for f in dataclasses.fields(obj):
        raw = os.environ.get(prefix + f.name.upper())
        if raw is not None:
            out[f.name] = raw
    return out


def read_config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """A TOML file with optional tables ``[engine]``, ``[disk]``, ``[remote]``, ``[server]``,
    ``[artifacts]``."""
    if path is None:
        path = os.environ.get("KVCELLAR_CONFIG")
    if not path:
        return {}
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def build_section(cls: type, file_values: dict[str, Any], cli_values: dict[str, Any]) -> Any:
    """A section dataclass from defaults < file < environment < CLI."""
    obj = cls()
    apply_overrides(obj, file_values, source="config file")
    apply_overrides(obj, env_overrides(obj), source="environment")
    apply_overrides(obj, {k: v for k, v in cli_values.items() if v is not None}, source="command line")
    return obj
