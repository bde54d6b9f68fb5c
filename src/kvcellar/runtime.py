"""Assembling a running kvcellar from its settings: model, engine, and the tiers below it.

The one place that knows how the parts fit: a model source goes through the
artifact cache (``prepare_and_load``) to the loader, the engine is built around the result,
and the tiers go under it. The server, ``kvcellar generate`` and the benchmarks all build
through ``build_engine`` or ``prepare_and_load``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from kvcellar.artifacts import ArtifactCache, ArtifactStoreError
from kvcellar.artifacts.prepare import prepare_gguf, prepare_quantized_gguf, read_quantized
from kvcellar.engine import Engine, assemble_engine
from kvcellar.engine.linears import panel_layout
from kvcellar.engine.loader import LoadedModel, load_model, resolve_device, resolve_serving
from kvcellar.engine.memory import GIB, MemoryPlan, check_fits, plan_memory
from kvcellar.engine.speculation import RecentOutputs
from kvcellar.engine.torch_math import settle as settle_torch_math
from kvcellar.errors import ModelLoadError
from kvcellar.identity import file_sha256, weights_identity
from kvcellar.model_source import resolve_source
from kvcellar.paths import draft_outputs_path
from kvcellar.settings import Settings
from kvcellar.storage.base import BlockSpec, KVTier
from kvcellar.storage.block_format import CacheSecret
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.remote.config import RemoteConfig

log = logging.getLogger(__name__)


def attach_disk_tier(engine: Engine, settings: Settings) -> None:
    """Put the SSD tier under ``engine`` unless the policy is ``off``. Blocks live in
    ``<cache_dir>/kv/<fingerprint>-v<format>/``: another model, dtype or block size is
    another directory, never a wrong hit."""
    if settings.disk.policy != "off":
        open_disk_tier(engine, settings.kv_root, settings.disk, secret=settings.cache_secret)


def open_disk_tier(engine: Engine, root: Path, disk: DiskConfig, policy: str | None = None,
                   secret: bytes | CacheSecret | None = None) -> None:
    """The SSD tier at ``root`` under ``engine`` (``policy``: the config's unless given). A
    hybrid model's snapshots go beside its blocks, in the namespace ``<fingerprint>.snapshots``,
    with a share of the capacity (``snapshot_share``) and a queue of a few snapshots; a block
    evicted takes the snapshot at its end with it. ``secret``: blocks and snapshots are sealed
    with it, and unsealed ones are misses (``block_format.BlockSeal``)."""
    from kvcellar.storage.disk.tier import DiskTier

    spec = engine.snapshot_spec
    share = int(disk.capacity_bytes * snapshot_share(engine, spec.nbytes)) if spec is not None else 0
    blocks = replace(disk, capacity_bytes=disk.capacity_bytes - share)
    tier = DiskTier(root, engine.fingerprint, engine.block_spec, blocks, descriptor=engine.descriptor,
                    secret=secret)

    def snapshots(spec: BlockSpec) -> KVTier:
        config = replace(disk, capacity_bytes=share, io_threads=2,
                         queue_blocks=snapshot_queue(disk.queue_blocks, spec.nbytes))
        kept = DiskTier(root, engine.fingerprint + SNAPSHOT_NAMESPACE, spec, config,
                        descriptor={**engine.descriptor, "snapshots": True}, secret=secret)
        tier.drops_with_its_blocks(kept)
        return kept

    _attach_with_snapshots(engine, tier, policy or disk.policy, snapshots)


def attach_remote_tier(engine: Engine, settings: Settings) -> None:
    """Put the shared remote tier (Redis/Valkey) under the SSD tier when a URL is given.
    Keys carry the same fingerprint as the disk directory, so only replicas of the same
    model, dtype and block size share blocks. A server that is down is not an error here:
    the tier starts degraded and connects when it can."""
    if settings.remote.url:
        open_remote_tier(engine, settings.remote, secret=settings.cache_secret)


def open_remote_tier(engine: Engine, remote: RemoteConfig, policy: str | None = None,
                     secret: bytes | CacheSecret | None = None) -> None:
    """The remote tier at ``remote.url`` under ``engine``; a hybrid model's snapshots under
    keys of their own namespace (``<fingerprint>.snapshots``), a few at a time in its queue.
    ``secret``: as for ``open_disk_tier``; without one a shared store can be poisoned, which
    start-up and ``/health`` say."""
    from kvcellar.storage.remote.tier import UNSEALED_WARNING, RemoteTier

    tier = RemoteTier(remote.url, engine.fingerprint, engine.block_spec, remote, secret)

    def snapshots(spec: BlockSpec) -> KVTier:
        config = replace(remote, queue_blocks=snapshot_queue(remote.queue_blocks, spec.nbytes))
        return RemoteTier(remote.url, engine.fingerprint + SNAPSHOT_NAMESPACE, spec, config, secret)

    _attach_with_snapshots(engine, tier, policy or remote.policy, snapshots)
    log.info("remote tier %r attached (%s)", tier, policy or remote.policy)
    if secret is None:
        log.warning("remote tier %r: %s", tier, UNSEALED_WARNING)


def _attach_with_snapshots(engine: Engine, tier: KVTier, policy: str,
                           snapshots: Callable[[BlockSpec], KVTier]) -> None:
    """Attach ``tier``, and beside it the snapshot tier ``snapshots`` opens for a hybrid model
    (``Engine.snapshot_spec``); a tier opened here that does not end up attached is closed (its
    threads would outlive it)."""
    opened = [tier]
    try:
        spec = engine.snapshot_spec
        extra = snapshots(spec) if spec is not None else None
        if extra is not None:
            opened.append(extra)
        engine.attach_tier(tier, policy, extra)
    except BaseException:
        for t in opened:
            t.close(1.0)
        raise


SNAPSHOT_NAMESPACE = ".snapshots"
SNAPSHOT_QUEUE_BYTES = 512 * 2**20  # what snapshots queued for one tier's writer may hold


def snapshot_share(engine: Engine, snapshot_bytes: int) -> float:
    """The part of a tier's capacity for a hybrid model's snapshots: what one snapshot is of
    one snapshot and the blocks it is kept for (``snapshot_every_blocks``), within 10-90 %."""
    blocks = engine.config.snapshot_every_blocks * engine.block_spec.nbytes
    return min(0.9, max(0.1, snapshot_bytes / (snapshot_bytes + blocks)))


def snapshot_queue(queue_blocks: int, snapshot_bytes: int) -> int:
    """A snapshot tier's writer queue, in snapshots: ``queue_blocks`` of them at most, within
    ``SNAPSHOT_QUEUE_BYTES``, never under 2."""
    return max(2, min(queue_blocks, SNAPSHOT_QUEUE_BYTES // snapshot_bytes))


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
    (``LoadedModel.quantized_artifact``), those kvcellar's kernels keep as panels packed in this
    CPU's layout (``artifacts/panels.py``). Both ways
    give the same identities and outputs, hit or not. ``progress``: show preparation progress
    bars (None: when stderr is a terminal)."""
    settle_torch_math()  # before a model's own numbers (transformers' init, the first step's RoPE)
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
    layout = panel_layout() if precision.kernel_dtype == torch.int8 and dev.type == "cpu" else None
    for attempt in (1, 2):
        if source.kind == "gguf" and artifacts is not None:
            t0 = time.perf_counter()
            # Quantized weights: the dense entry holds all but the linears, which the
            # quantized entry holds (a 7B Q4 model: ~1 GB instead of 15 GB written and read).
            lease = prepare_gguf(artifacts, source, weights_id, torch_dtype, progress=progress,
                                 linears_apart=weights != "full")
            if weights != "full":
                qlease = prepare_quantized_gguf(artifacts, source, weights_id, weights, progress=progress,
                                                layout=layout)
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
    # The MLX engine's ``auto`` is full weights.
    weights = "full" if cfg.engine == "mlx" and cfg.weights == "auto" else cfg.weights
    precision = resolve_serving(cfg.dtype, weights, source, dev)
    kv_bytes = int(cfg.kv_cache_gb * GIB) if not cfg.kv_cache_blocks else 0
    # a hybrid's verifications keep the state before them (``auto`` drafts where rows are exact)
    draft_slots = cfg.verify_state_slots if cfg.speculative != "off" else 0
    # the artifact cache stores int4 linears as panels where prepare_and_load gives it a layout
    stored_panels = settings.artifacts.enabled and precision.kernel_dtype == torch.int8 and dev.type == "cpu"
    return plan_memory(source, precision.weights, precision.dtype, kv_bytes,
                       state_slots=2 * cfg.max_num_seqs + cfg.state_snapshots + draft_slots,
                       stored_panels=stored_panels)


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


def keep_outputs(engine: Engine, cache_dir: Path) -> None:
    """``--speculative suffix`` (``auto``'s on a CPU): the outputs it drafts from, kept in
    ``cache_dir/spec/`` across restarts (a file per KV namespace: the token ids are this model's)."""
    drafter = engine.scheduler.drafter
    if drafter is not None and drafter.mode == "suffix":
        drafter.outputs = RecentOutputs(draft_outputs_path(Path(cache_dir), engine.fingerprint))


def build_engine(settings: Settings, loaded: LoadedModel | None = None) -> Engine:
    """Load the model (through the artifact cache under the cache root) unless given, build
    the engine and attach the SSD and remote tiers. The caller starts it and owns ``shutdown``."""
    if loaded is None:
        cfg = settings.engine
        check_memory(settings)
        if cfg.engine == "mlx":
            from kvcellar.engine.mlx.loader import load_mlx

            loaded = load_mlx(settings.model, dtype=cfg.dtype, weights=cfg.weights, artifacts=open_artifacts(settings))
        else:
            loaded = prepare_and_load(settings.model, dtype=cfg.dtype, device=cfg.device, weights=cfg.weights,
                                      artifacts=open_artifacts(settings))
    engine = assemble_engine(loaded, settings.engine)
    if settings.disk.policy != "off":  # without the SSD tier nothing generated is kept on disk either
        keep_outputs(engine, settings.cache_dir)
    try:
        attach_disk_tier(engine, settings)
        attach_remote_tier(engine, settings)
    except Exception:
        engine.shutdown(timeout=0)
        raise
    return engine
