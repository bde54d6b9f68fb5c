"""Assembling an engine from a loaded model and its config.

``assemble_engine`` sizes the KV pool, makes the block manager, the link to the lower tiers
(none yet: ``Engine.attach_tier`` adds them), the scheduler and the model runner, wires
the block manager's evictions to the link, and names the cache (descriptor and
fingerprint: another model, dtype, block size or KV setting is another cache). ``Engine``
only runs what it is given.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvcellar.cache.block_manager import BlockManager
from kvcellar.cache.kv_pool import KVLayout, KVPool
from kvcellar.cache.namespace import kv_descriptor, kv_fingerprint
from kvcellar.cache.state_pool import StateLayout, StatePool
from kvcellar.cache.tiering import LowerTierLink
from kvcellar.engine import native
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.engine import Engine, EngineParts
from kvcellar.engine.experts import runs_moe_kernels
from kvcellar.engine.loader import LoadedModel
from kvcellar.engine.model_runner import ModelRunner, StepRunner
from kvcellar.engine.scheduler import Scheduler
from kvcellar.engine.speculation import Drafter
from kvcellar.engine.torch_math import settle as settle_torch_math

log = logging.getLogger(__name__)


def assemble_engine(loaded: LoadedModel, config: EngineConfig | None = None) -> Engine:
    """An engine serving ``loaded`` (which hands it its quantized weights) under ``config``."""
    config = config or EngineConfig()
    settle_torch_math()  # a model loaded without prepare_and_load: still before the first step
    return Engine(loaded, config, assemble_parts(loaded, config))


def assemble_parts(loaded: LoadedModel, cfg: EngineConfig) -> EngineParts:
    layout = KVLayout.from_model_config(loaded.model.config, cfg.block_size, loaded.dtype, cfg.kv_bits,
                                        cfg.kv_group_size)
    max_model_len = cfg.max_model_len or loaded.max_context
    if max_model_len > loaded.max_context:
        # Allowed, as llama.cpp allows a larger -c: agents' prompts outgrow small models'
        # contexts, and RoPE is computed from positions; quality past training is the user's call.
        log.warning("max_model_len %d is above the model's trained context of %d tokens",
                    max_model_len, loaded.max_context)
    num_blocks = _pool_blocks(layout, cfg, max_model_len)
    mlx = loaded.engine == "mlx"
    fast = native.gathers_kv(layout, loaded.device)
    attends = native.attends_kv(layout, loaded.device) and not mlx  # MLX attends in its own kernel
    pool = KVPool(layout, num_blocks, loaded.device, gather_quantized=native.gather_kv if fast else None,
                  attend_direct=native.attend_kv if attends else None,
                  write_quantized=native.write_kv if fast else None)
    blocks = BlockManager(num_blocks, cfg.block_size, key_bytes=cfg.key_bytes)
    wake = threading.Event()
    lower = LowerTierLink(pool, blocks.key, wake=wake.set)
    # evict_only tiers store every evicted block; write_through ones those whose store was dropped.
    blocks.on_evict = lower.evicted
    state_layout = StateLayout.from_model_config(loaded.model.config)
    quantized = loaded.take_quantized()
    # A step's rows get a decode step's numbers where kvcellar's kernels compute them: the
    # attention kernel (no soft-cap), and linears by the int4/int8 kernels or in bf16 (float32
    # dense matmuls sum 1-7 rows otherwise than 8 or more: docs/performance.md).
    # MLX: not measured, so not assumed.
    exact = (pool.attends and bool(quantized or loaded.dtype == torch.bfloat16)
             and not getattr(loaded.model.config.get_text_config(), "attn_logit_softcapping", None))
    drafter = _drafter(cfg, exact=exact)
    # a hybrid's verification keeps the state before it
    draft_slots = cfg.verify_state_slots if drafter is not None else 0
    states = (StatePool(state_layout, 2 * cfg.max_num_seqs, loaded.device, max_snapshots=cfg.state_snapshots,
                        draft_slots=draft_slots)
              if state_layout is not None else None)
    runner: StepRunner
    if mlx:
        from kvcellar.engine.mlx.runner import MLXRunner

        runner = MLXRunner(loaded.model.module, pool)
    else:
        runner = ModelRunner(loaded.model, pool, lean=cfg.lean_forward, quantized=quantized,
                             kernel_dtype=loaded.kernel_dtype, states=states, thread_spin=cfg.thread_spin)
    scheduler = Scheduler(blocks, lower, cfg, copy_block=pool.copy_block, states=states, drafter=drafter)
    if cfg.decode_threads > 0:
        runner.set_decode_threads(cfg.decode_threads)
    kernel_norms = bool(getattr(runner, "kernel_norms", False))
    descriptor = kv_descriptor(
        weights_id=loaded.weights_id,
        tokenizer_id=loaded.tokenizer_id,
        dtype=loaded.dtype,
        kv_dtype=layout.dtype,
        block_size=cfg.block_size,
        model_name=loaded.name,
        kv_bits=layout.kv_bits,
        kv_group_size=layout.kv_group_size,
        arithmetic=native.ARITHMETIC if pool.attends or loaded.kernel_dtype == torch.int8 or kernel_norms else "",
        recurrence=native.RECURRENCE if state_layout is not None and native.runs_gated_delta(
            loaded.device, state_layout.value_dim) else "",
        experts=native.MOE_ARITHMETIC if runs_moe_kernels(loaded.model) else "",
        engine="mlx" if mlx else "torch",
    )
    return EngineParts(layout, pool, blocks, lower, scheduler, runner, descriptor, kv_fingerprint(descriptor),
                       max_model_len, wake)


def _drafter(cfg: EngineConfig, *, exact: bool) -> Drafter | None:
    """The drafter ``cfg.speculative`` asks for; ``exact``: a step's rows get the numbers a decode
    step gives them, which ``auto`` needs (elsewhere drafts change outputs by float rounding, as
    batching does there). ``auto`` drafts as ``suffix``: ahead of ``ngram`` on every kind of work
    ``kvcellar bench spec`` measures (docs/performance.md)."""
    mode = cfg.speculative
    if mode == "auto":
        mode = "suffix" if exact else "off"
    if mode == "off":
        return None
    return Drafter(mode, cfg.speculative_max_tokens)


def _pool_blocks(layout: KVLayout, cfg: EngineConfig, max_model_len: int) -> int:
    num_blocks = cfg.kv_cache_blocks or KVPool.blocks_for_budget(layout, int(cfg.kv_cache_gb * (1 << 30)))
    # An explicit --max-model-len is a promise that one such request fits: the pool grows to it.
    if cfg.max_model_len and not cfg.kv_cache_blocks and (num_blocks - 1) * cfg.block_size < max_model_len:
        needed = -(-max_model_len // cfg.block_size) + 1
        log.warning("kv_cache_gb holds %d tokens, less than max_model_len %d: the pool is sized for one "
                    "full-length sequence (%d blocks)", (num_blocks - 1) * cfg.block_size, max_model_len, needed)
        num_blocks = needed
    return num_blocks

