"""The ``[engine]`` section of the configuration: knobs of the paged-KV engine and its RAM
prefix cache, passed whole to the parts that read them (``build.assemble_engine``, the
``Scheduler``, the ``Engine``).

Filled like every section (``kvcellar.settings.load_settings``): defaults < config file
``[engine]`` table < ``KVCELLAR_<FIELD>`` environment variables < flags. Importing this module
imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from kvcellar.cache.hashing import DIGEST_SIZE

# ``dtype`` values; the short names are the loader's aliases (engine/loader.py resolve_dtype).
DType = Literal["auto", "bfloat16", "float32", "float16", "bf16", "fp32", "fp16"]
# ``weights`` values (kvcellar/quantization.py quantizes; engine/loader.py resolves ``auto``).
WeightMode = Literal["auto", "full", "int8", "int4"]
WEIGHT_MODES: tuple[WeightMode, ...] = get_args(WeightMode)
KVBits = Literal[16, 8, 4]
# ``speculative`` values (engine/speculation.py drafts).
SpeculativeMode = Literal["auto", "off", "ngram", "suffix"]
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = get_args(SpeculativeMode)
# ``thread_spin`` values (engine/native/threads.py).
ThreadSpin = Literal["auto", "on", "off"]
THREAD_SPINS: tuple[ThreadSpin, ...] = get_args(ThreadSpin)
# ``engine`` values: the framework computing the model (engine/mlx/ for mlx).
EngineKind = Literal["torch", "mlx"]
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
# Draft tokens one step verifies in all (and so the longest draft): beyond it a step of many
# sequences grows past what a decode step of them costs.
STEP_DRAFT_TOKENS = 16
# A hybrid model's verifications in one step (each keeps the state before it in a state slot of
# its own: a Qwen3.5-9B's is 53 MB).
STEP_HYBRID_VERIFIES = 4


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
    kv_bits: KVBits = 16
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
    # Hybrid models (Qwen3.5/3.6's linear attention, cache/state_pool.py): snapshots of a
    # sequence's recurrent state kept in RAM (each the size /health reports as
    # state_snapshot_bytes, float32), taken where a prompt's prefill ends, where a generation
    # ends and every snapshot_every_blocks blocks; a cached prefix resumes from the last one.
    state_snapshots: int = 32
    snapshot_every_blocks: int = 16
    # Bytes of the chained digest used as a block's key, 1 to the digest's 32: no setting
    # (no file key, flag or environment variable). Tests shrink it to force collisions in the
    # RAM table, where a hit still compares the full digest and the token ids; the lower
    # tiers name blocks by this key, so two chains sharing one would delete each other's
    # files, and an engine takes a tier only with the whole digest (``Engine.attach_tier``).
    key_bytes: int = field(default=DIGEST_SIZE, metadata={"key": None})
    # Prefetch (cache/prefetch.py): a queued request's next blocks in a lower tier are read
    # while it waits, into free or least recently used cached blocks: at most this fraction
    # of the pool read into or held for waiting requests (0 turns prefetch off), by at most
    # prefetch_max_reads reads in flight.
    prefetch_pool_fraction: float = 0.25
    prefetch_max_reads: int = 4
    dtype: DType = "auto"
    # auto, cpu, cuda or cuda:N: any torch device, so not a closed list.
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
    # Whether the CPU kernels' threads spin between a decode step's loops instead of sleeping
    # (engine/native/threads.py): auto spins while the machine has a CPU for every thread that
    # wants one; on / off always / never.
    thread_spin: ThreadSpin = "auto"
    # full: weights in ``dtype``; int8 / int4: weight-only quantized linears
    # (kvcellar/quantization.py, engine/linears.py): a half / a quarter of the bytes a decode
    # step reads; prefill runs their dequantized weights. auto: int4 for a GGUF whose linears
    # are 4-bit where torch's int4 kernel runs (bf16 on a CPU with native bf16), else full.
    weights: WeightMode = "auto"
    # Steps failing in a row (a broken model or kernel, not one bad request) before /health
    # turns 503 so a load balancer takes the replica out; a step that succeeds resets it.
    unhealthy_after_failed_steps: int = 3
    # Speculative decoding (engine/speculation.py): draft tokens from the request's own text
    # (ngram) or also from recent outputs of every request (suffix), verified in one step; the
    # output is the one decoding without drafts gives. auto: suffix where a step's rows get the
    # numbers a decode step gives them (kvcellar's attention kernel on a CPU, with int4/int8 or
    # bf16 linears), else off (GPUs, float32 dense weights: their matmuls round by a step's row
    # count). speculative_max_tokens: the longest draft.
    speculative: SpeculativeMode = "auto"
    speculative_max_tokens: int = 8
    # The framework computing the model: torch (kernels of its own, every architecture), or mlx
    # (mlx-lm's models, the dense families; the extra ``kvcellar[mlx]``; engine/mlx/). The
    # scheduler, prefix cache and tiers are the same; their blocks are another namespace.
    engine: EngineKind = "torch"
    # Refuse to load a model whose planned memory (engine/memory.py: weights + KV pool +
    # overhead) is above this many GiB; 0: only the memory available is checked.
    max_memory_gb: float = 0.0

    @property
    def verify_state_slots(self) -> int:
        """State slots a hybrid model keeps for its verifications where drafting is on (the
        state before each; at most ``STEP_HYBRID_VERIFIES`` sequences verify in a step)."""
        return min(self.max_num_seqs, STEP_HYBRID_VERIFIES)

    def validate(self) -> None:
        if min(self.block_size, self.max_num_seqs, self.max_step_tokens, self.unhealthy_after_failed_steps,
               self.snapshot_every_blocks) < 1:
            raise ValueError("block_size, max_num_seqs, max_step_tokens, unhealthy_after_failed_steps and "
                             "snapshot_every_blocks must be >= 1")
        if self.state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, not {self.state_snapshots}")
        if not 0 <= self.prefetch_pool_fraction <= 1:
            raise ValueError(f"prefetch_pool_fraction must be between 0 and 1, not {self.prefetch_pool_fraction}")
        if self.dtype not in get_args(DType):
            raise ValueError(f"unknown dtype {self.dtype!r}; use auto, bfloat16, float32 or float16")
        if self.kv_bits not in get_args(KVBits):
            raise ValueError(f"kv_bits must be 16, 8 or 4, not {self.kv_bits}")
        if not 2 <= self.kv_group_size < 4096:
            raise ValueError(f"kv_group_size must be between 2 and 4095, not {self.kv_group_size}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, not {self.weights!r}")
        if self.thread_spin not in THREAD_SPINS:
            raise ValueError(f"thread_spin must be one of {', '.join(THREAD_SPINS)}, not {self.thread_spin!r}")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_KINDS)}, not {self.engine!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, not {self.speculative!r}")
        if not 1 <= self.speculative_max_tokens <= STEP_DRAFT_TOKENS:
            raise ValueError(f"speculative_max_tokens must be between 1 and {STEP_DRAFT_TOKENS}, "
                             f"not {self.speculative_max_tokens}")
        if not 1 <= self.key_bytes <= DIGEST_SIZE:
            raise ValueError(f"key_bytes must be between 1 and {DIGEST_SIZE}, not {self.key_bytes}")
