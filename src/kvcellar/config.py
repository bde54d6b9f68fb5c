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
from kvcellar.paths import resolve_cache_dir
from kvcellar.server.config import ServerConfig
from kvcellar.storage.disk.config import DiskSettings
from kvcellar.storage.remote.config import RemoteSettings

ENV_PREFIX = "KVCELLAR_"


# ``weights`` values (kvcellar/quantization.py quantizes; engine/loader.py resolves ``auto``).
WEIGHT_MODES = ("auto", "full", "int8", "int4")


@dataclass
class EngineConfig:
    """Knobs of the paged-KV engine and its RAM prefix cache."""

    # Tokens per KV block. Chosen by the block-size sweep in benchmarks/bench_prefix_cache.py.
    block_size: int = 16
    # Memory for the RAM tier's KV block pool, in GiB. The pool is allocated up front.
    kv_cache_gb: float = 2.0
    # Exact pool size in blocks; overrides kv_cache_gb when > 0.
    kv_cache_blocks: int = 0
    # KV stored at 16 bits (the model's dtype), or quantized to 8 or 4 bits in groups of
    # kv_group_size along the head dimension (cache/kv_pool.py): about 2x / 3.5x the tokens
    # in the same memory, SSD space and Redis, at a small cost in accuracy (README). A
    # different setting is a different cache (namespace), never a wrong one.
    kv_bits: int = 16
    kv_group_size: int = 64
    # Upper bound on sequences in the running batch.
    max_num_seqs: int = 32
    # Per-step token budget: decodes first, then prefill chunks fill what is left, so a long
    # prompt never stalls running decodes for more than one budget's worth of compute.
    max_step_tokens: int = 512
    # Budget of a step in which no sequence is decoding: nobody waits between tokens, so a
    # long prompt goes in fewer, larger chunks (faster prefill; docs/performance.md). The
    # price: a request arriving meanwhile waits for that larger step before its own first
    # one. 0: max_step_tokens.
    max_prefill_step_tokens: int = 2048
    # Largest prompt + completion accepted; 0 means the model's own context length.
    max_model_len: int = 0
    # Most tokens one completion may generate (larger max_tokens are clamped to it, as are
    # requests that set none); 0: whatever room the context leaves.
    max_completion_tokens: int = 0
    # Reuse of cached prefix blocks; off only for comparisons and tests.
    prefix_caching: bool = True
    # Bytes of the chained digest used as the hash-table key. Tests shrink it to force
    # collisions; a hit always compares the full digest and the token ids.
    key_bytes: int = 32
    # Prefetch (cache/prefetch.py): a queued request's next blocks in a lower tier are read
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
    # Supported architectures (Llama, Qwen2) run through kvcellar's own walk over the model's
    # layers (engine/lean_forward.py): bitwise the same logits as transformers' modules, with
    # less Python per step (docs/performance.md). Off: the modules.
    lean_forward: bool = True
    # torch threads for steps of at most 8 tokens (decodes; engine/model_runner.py): 0 = the
    # faster of one and all, measured at warm-up (all without warm-up); N = N.
    decode_threads: int = 0
    # full: weights in ``dtype``; int8 / int4: weight-only quantized linears
    # (kvcellar/quantization.py, engine/linears.py): a half / a quarter of the bytes a decode
    # step reads; prefill runs their dequantized weights. auto: int4 for a GGUF whose linears
    # are 4-bit where torch's int4 kernel runs (bf16 on a CPU with native bf16), else full.
    weights: str = "auto"
    # Steps failing in a row (a broken model or kernel, not one bad request) before /health
    # turns 503 so a load balancer takes the replica out; a step that succeeds resets it.
    unhealthy_after_failed_steps: int = 3
    # Refuse to load a model whose planned memory (engine/memory.py: weights + KV pool +
    # overhead) is above this many GiB; 0: only the memory available is checked.
    max_memory_gb: float = 0.0

    def validate(self) -> None:
        if min(self.block_size, self.max_num_seqs, self.max_step_tokens, self.unhealthy_after_failed_steps) < 1:
            raise ValueError("block_size, max_num_seqs, max_step_tokens and unhealthy_after_failed_steps "
                             "must be >= 1")
        if not 0 <= self.prefetch_pool_fraction <= 1:
            raise ValueError(f"prefetch_pool_fraction must be between 0 and 1, not {self.prefetch_pool_fraction}")
        if self.kv_bits not in (16, 8, 4):
            raise ValueError(f"kv_bits must be 16, 8 or 4, not {self.kv_bits}")
        if not 2 <= self.kv_group_size < 4096:
            raise ValueError(f"kv_group_size must be between 2 and 4095, not {self.kv_group_size}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, not {self.weights!r}")


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
