"""Assembling a running kvcellar from its settings: model, engine, and the tiers below it.

The one place that knows how the parts fit: a model source goes through the
artifact cache (``prepare_and_load``) to the loader, the engine is built around the result,
and the tiers go under it. The server, ``kvcellar generate`` and the benchmarks all build
through ``build_engine`` or ``prepare_and_load``.
"""

from __future__ import annotations

import logging
import time

from kvcellar.artifacts import ArtifactCache, ArtifactStoreError
from kvcellar.artifacts.prepare import prepare_gguf, prepare_quantized_gguf, read_quantized
from kvcellar.engine import Engine, assemble_engine
from kvcellar.engine.loader import LoadedModel, load_model, resolve_device, resolve_serving
from kvcellar.engine.memory import GIB, MemoryPlan, check_fits, plan_memory
from kvcellar.errors import ModelLoadError
from kvcellar.identity import file_sha256, weights_identity
from kvcellar.model_source import resolve_source
from kvcellar.settings import Settings

log = logging.getLogger(__name__)


def attach_disk_tier(engine: Engine, settings: Settings) -> None:
    """Put the SSD tier under ``engine`` unless the policy is ``off``. Blocks live in
    ``<cache_dir>/kv/<fingerprint>-v<format>/``: another model, dtype or block size is
    another directory, never a wrong hit."""
    disk = settings.disk
    if disk.policy == "off":
        return
    from kvcellar.storage.disk.tier import DiskTier

    tier = DiskTier(settings.kv_root, engine.fingerprint, engine.block_spec, disk, descriptor=engine.descriptor)
    engine.attach_tier(tier, disk.policy)


def attach_remote_tier(engine: Engine, settings: Settings) -> None:
    """Put the shared remote tier (Redis/Valkey) under the SSD tier when a URL is given.
    Keys carry the same fingerprint as the disk directory, so only replicas of the same
    model, dtype and block size share blocks. A server that is down is not an error here:
    the tier starts degraded and connects when it can."""
    remote = settings.remote
    if not remote.url:
        return
    from kvcellar.storage.remote.tier import RemoteTier

    tier = RemoteTier(remote.url, engine.fingerprint, engine.block_spec, remote)
    engine.attach_tier(tier, remote.policy)
    log.info("remote tier %r attached (%s)", tier, remote.policy)


def open_artifacts(settings: Settings) -> ArtifactCache | None:
    """The model artifact cache under the cache root, opened with the ``[artifacts]``
    settings; None when they turn it off or the directory is unusable (a GGUF is then
    dequantized in memory at every start, with a warning)."""
    if not settings.artifacts.enabled:
        log.info("model artifact cache off ([artifacts] enabled = false)")
        return None
    try:
        return ArtifactCache.open(settings.cache_dir, settings.artifacts)
    except ArtifactStoreError as exc:
        log.warning("model artifact cache disabled for this run: %s", exc)
        return None


def prepare_and_load(model: str | None, *, dtype: str = "auto", device: str = "auto", weights: str = "auto",
                     artifacts: ArtifactCache | None = None, progress: bool | None = None) -> LoadedModel:
    """Resolve ``model`` and load it. A GGUF source goes through ``artifacts`` when given:
    prepared once into it and loaded from its entry from then on, which the result holds
    (``LoadedModel.artifact``) while served; source digests are memoized there too. With
    ``weights`` int8/int4 its quantized linears have an entry of their own
    (``LoadedModel.quantized_artifact``). Both ways give the same identities and outputs, hit
    or not. ``progress``: show preparation progress bars (None: when stderr is a terminal)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    source = resolve_source(model)
    dev = resolve_device(device)
    precision = resolve_serving(dtype, weights, source, dev)
    torch_dtype, weights = precision.dtype, precision.weights
    timings["resolve"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    weights_id = weights_identity(source, artifacts.file_digest if artifacts is not None else file_sha256)
    timings["source_identity"] = time.perf_counter() - t0

    lease = qlease = None
    for attempt in (1, 2):
        if source.kind == "gguf" and artifacts is not None:
            t0 = time.perf_counter()
            # Quantized weights: the dense entry holds all but the linears, which the
            # quantized entry holds (a 7B Q4 model: ~1 GB instead of 15 GB written and read).
            lease = prepare_gguf(artifacts, source, weights_id, torch_dtype, progress=progress,
                                 linears_apart=weights != "full")
            if weights != "full":
                qlease = prepare_quantized_gguf(artifacts, source, weights_id, weights, progress=progress)
            timings["artifact"] = timings.get("artifact", 0.0) + time.perf_counter() - t0
        try:
            given = read_quantized(qlease) if qlease is not None else None
            apart = lease is not None and bool(lease.manifest.info.get("linears_apart"))
            loaded = load_model(source, dtype=dtype, device=device, weights=weights, weights_id=weights_id,
                                folder=lease.path if lease is not None else None, quantized=given,
                                linears_apart=apart)
            break
        except ModelLoadError as exc:
            if (lease is None and qlease is None) or attempt == 2:
                raise
            # An entry validated but doesn't load: drop it and prepare it again, once.
            for held in (lease, qlease):
                if held is not None:
                    held.invalidate(f"failed to load: {exc}")
    loaded.load_seconds.update(timings)
    if lease is not None:
        source_tok = lease.manifest.info.get("source_tokenizer_id")
        if source_tok and source_tok != loaded.tokenizer_id:
            log.warning("the tokenizer of %s saved in the artifact cache differs from the GGUF's own; KV blocks "
                        "cached by a run without the artifact cache won't be reused", source.name)
        loaded.artifact = lease
    loaded.quantized_artifact = qlease
    return loaded


def memory_plan(settings: Settings) -> MemoryPlan:
    """What serving ``settings.model`` will take (engine/memory.py), from headers alone."""
    cfg = settings.engine
    source = resolve_source(settings.model)
    dev = resolve_device(cfg.device)
    precision = resolve_serving(cfg.dtype, cfg.weights, source, dev)
    kv_bytes = int(cfg.kv_cache_gb * GIB) if not cfg.kv_cache_blocks else 0
    return plan_memory(source, precision.weights, precision.dtype, kv_bytes,
                       state_slots=2 * cfg.max_num_seqs + cfg.state_snapshots)


def check_memory(settings: Settings) -> None:
    """Refuse, with the figures, a model that will not fit (before anything heavy loads)."""
    try:
        plan = memory_plan(settings)
    except ModelLoadError:  # not a model we serve: said as it is
        raise
    except Exception as exc:  # a plan we cannot make must not keep a model from loading
        log.warning("could not plan the memory of %s: %s", settings.model, exc)
        return
    log.info("memory plan: %s", plan.describe())
    check_fits(plan, settings.engine.max_memory_gb)


def build_engine(settings: Settings, loaded: LoadedModel | None = None) -> Engine:
    """Load the model (through the artifact cache under the cache root) unless given, build
    the engine and attach the SSD and remote tiers. The caller starts it and owns ``shutdown``."""
    if loaded is None:
        cfg = settings.engine
        check_memory(settings)
        loaded = prepare_and_load(settings.model, dtype=cfg.dtype, device=cfg.device, weights=cfg.weights,
                                  artifacts=open_artifacts(settings))
    engine = assemble_engine(loaded, settings.engine)
    try:
        attach_disk_tier(engine, settings)
        attach_remote_tier(engine, settings)
    except Exception:
        engine.shutdown(timeout=0)
        raise
    return engine
