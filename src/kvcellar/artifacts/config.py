"""Knobs of the model artifact cache: the ``[artifacts]`` section (``kvcellar.settings``).

Precedence as everywhere else: defaults < config file < environment
(``KVCELLAR_ARTIFACT_<FIELD>``, e.g. ``KVCELLAR_ARTIFACT_MAX_GB=20``) < CLI flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ENV_PREFIX = "KVCELLAR_ARTIFACT_"
VerifyLevel = Literal["fast", "full"]
VERIFY_LEVELS: tuple[VerifyLevel, ...] = get_args(VerifyLevel)


@dataclass
class ArtifactConfig:
    # Cache prepared models at all. Off: a GGUF is dequantized again at every start.
    enabled: bool = True
    # Size limit of <cache_dir>/models in GiB. Past it, least recently used entries that no
    # running process holds are evicted down to 80 % of it. 50 GiB holds three dequantized
    # 7-8B models in bf16 (~15 GB each) or dozens of small ones.
    max_gb: float = 50.0
    # Check of an entry before each use. "fast": sizes, sampled hashes, and a full sha256 of
    # any file whose size/mtime/ctime/inode changed since its last full check (milliseconds).
    # "full": sha256 of every file every time (a read of the whole entry).
    verify: VerifyLevel = "fast"

    @property
    def max_bytes(self) -> int:
        return int(self.max_gb * (1 << 30))

    def validate(self) -> None:
        if self.verify not in VERIFY_LEVELS:
            raise ValueError(f"artifacts.verify must be one of {VERIFY_LEVELS}, got {self.verify!r}")
        if self.max_gb <= 0:
            raise ValueError(f"artifacts.max_gb must be positive, got {self.max_gb}")

