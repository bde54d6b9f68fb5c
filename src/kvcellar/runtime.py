"""Assembling a running kvcellar from its settings: model, engine, and the tiers below it.

The one place that knows how the parts fit (SPEC §2); the server, ``kvcellar generate`` and
the benchmarks all build through ``build_engine``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvcellar.config import Settings
from kvcellar.engine import Engine
from kvcellar.engine.loader import LoadedModel, load_model

if TYPE_CHECKING:
    from kvcellar.artifacts import ArtifactCache

log = logging.getLogger(__name__)


def attach_disk_tier(engine: Engine, settings: Settings) -> None:
    """Put the SSD tier under ``engine`` unless the policy is ``off``. Blocks live in
    ``<cache_dir>/kv/<fingerprint>-v<format>/``: another model, dtype or block size is
    another directory, never a wrong hit."""
    disk = settings.disk
    disk.validate()
    if disk.ssd_policy == "off":
        return
    from kvcellar.storage.disk.tier import DiskTier

    tier = DiskTier(settings.kv_root, engine.fingerprint, engine.block_spec, disk.to_tier_config(),
                    descriptor=engine.descriptor)
    engine.attach_tier(tier, disk.ssd_policy)


def attach_remote_tier(engine: Engine, settings: Settings) -> None:
    """Put the shared remote tier (Redis/Valkey) under the SSD tier when a URL is given.
    Keys carry the same fingerprint as the disk directory, so only replicas of the same
    model, dtype and block size share blocks. A server that is down is not an error here:
    the tier starts degraded and connects when it can."""
    remote = settings.remote
    remote.validate()
    if not remote.remote_url:
        return
    from kvcellar.storage.remote.tier import RemoteTier

    tier = RemoteTier(remote.remote_url, engine.fingerprint, engine.block_spec, remote.to_tier_config())
    engine.attach_tier(tier, remote.remote_policy)
    log.info("remote tier %r attached (%s)", tier, remote.remote_policy)


def open_artifacts(settings: Settings) -> ArtifactCache | None:
    """The model artifact cache under the cache root, opened with the ``[artifacts]``
    settings; None when they turn it off or the directory is unusable (the loader then
    prepares a GGUF in memory, with a warning)."""
    from kvcellar.artifacts import ArtifactCache, ArtifactStoreError

    if not settings.artifacts.enabled:
        log.info("model artifact cache off ([artifacts] enabled = false)")
        return None
    try:
        return ArtifactCache.open(settings.cache_dir, settings.artifacts)
    except ArtifactStoreError as exc:
        log.warning("model artifact cache disabled for this run: %s", exc)
        return None


def build_engine(settings: Settings, loaded: LoadedModel | None = None) -> Engine:
    """Load the model (through the artifact cache under the cache root) unless given, build
    the engine and attach the SSD and remote tiers. The caller starts it and owns ``shutdown``."""
    if loaded is None:
        cfg = settings.engine
        loaded = load_model(settings.model, dtype=cfg.dtype, device=cfg.device, artifacts=open_artifacts(settings),
                            weights=cfg.weights)
    engine = Engine(loaded, settings.engine)
    try:
        attach_disk_tier(engine, settings)
        attach_remote_tier(engine, settings)
    except Exception:
        engine.shutdown(timeout=0)
        raise
    return engine
