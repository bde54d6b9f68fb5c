"""Real models for tests, loaded once per test process and shared by every test module.

The embedded SmolLM2 is the real product model; the small random-weight configs exercise
other architectures (qk-norm, sliding windows, GQA ratios) through the same engine.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import kvcellar  # noqa: F401  (OMP wait policy before torch)
from kvcellar.engine import Engine, SamplingParams, assemble_engine, native
from kvcellar.engine.attention import ATTENTION_NAME
from kvcellar.engine.config import EngineConfig
from kvcellar.engine.loader import LoadedModel, wrap_model
from kvcellar.engine.tokenization import encode_chat
from kvcellar.runtime import prepare_and_load


@functools.cache
def without_native_kernels(monkeypatch: Any) -> None:
    """This test's process as one where kvcellar's own CPU kernels cannot be built
    (``engine/native``): quantized linears run torch's kernels, or their dequantized weights."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    fresh = functools.cache(native.lib.library.__wrapped__)  # reads the switch; put back after
    monkeypatch.setattr(native.lib, "library", fresh)
    monkeypatch.setattr(native, "library", fresh)


def shared_models_dir() -> Path:
    """One prepared-model artifact folder for the whole test session: in-process loads and
    every server subprocess use it, so the embedded GGUF is prepared once per session
    (``KVCELLAR_TEST_MODELS_DIR`` keeps it across sessions)."""
    keep = os.environ.get("KVCELLAR_TEST_MODELS_DIR")
    if keep:
        return Path(keep)
    path = Path(tempfile.mkdtemp(prefix="kvcellar-test-models-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["KVCELLAR_TEST_MODELS_DIR"] = str(path)
    return path


# The engine tests' device: ``KVCELLAR_TEST_DEVICE=cuda`` runs them on a GPU (server tests
# follow ``--device auto``).
TEST_DEVICE = os.environ.get("KVCELLAR_TEST_DEVICE", "cpu")
# Tests of what kvcellar's CPU kernels compute (bit-identical hits, fused experts).
needs_native = pytest.mark.skipif(not native.available() or TEST_DEVICE != "cpu",
                                  reason="kvcellar's CPU kernels: not built here, or the tests run on a GPU")


@functools.cache
def embedded(dtype: str = "float32", weights: str = "full") -> LoadedModel:
    from kvcellar.artifacts.store import ArtifactCache

    return prepare_and_load(None, dtype=dtype, device=TEST_DEVICE, weights=weights,
                            artifacts=ArtifactCache(shared_models_dir()))


def make_engine(loaded: LoadedModel, **overrides: Any) -> Engine:
    # max_prefill_step_tokens 0: a test's max_step_tokens is its chunk size, decoding or not
    cfg = {"kv_cache_gb": 0.1, "block_size": 16, "max_step_tokens": 512, "max_prefill_step_tokens": 0,
           "max_num_seqs": 16}
    cfg.update(overrides)
    return assemble_engine(loaded, EngineConfig(**cfg))


def chat_ids(loaded: LoadedModel, user: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return encode_chat(loaded.tokenizer, messages)


@contextlib.contextmanager
def reference_attention(model: Any) -> Iterator[None]:
    """Temporarily run the model with transformers' own SDPA attention (eager where the
    family has no SDPA path: gpt-oss's sinks)."""
    model.set_attn_implementation("sdpa" if getattr(model, "_supports_sdpa", True) else "eager")
    try:
        yield
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


@torch.inference_mode()
def reference_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and per-step log-probabilities from transformers' own ``generate``."""
    with reference_attention(model):
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=0)[:, 0].float(), dim=-1)
    return tokens, logprobs


def assert_generates_like_reference(reference: Any, loaded: LoadedModel, prompt: Sequence[int],
                                    params: SamplingParams, atol: float = 2e-4, chunk: int = 512) -> None:
    """``loaded`` served by an engine (prefill chunks of ``chunk`` tokens) gives transformers' own
    greedy tokens of ``reference`` and their logprobs within ``atol``."""
    tokens, logprobs = reference_greedy(reference, prompt, params.max_tokens)
    engine = make_engine(loaded, max_step_tokens=chunk)
    result = engine.generate([list(prompt)], params)[0]
    assert result.token_ids == tokens
    want = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(result.logprobs), want, rtol=0, atol=atol)
    engine.shutdown(10)


def tiny_model(arch: str, tokenizer: Any, name: str | None = None, dtype: torch.dtype = torch.float32,
               **config: Any) -> LoadedModel:
    """A small random-weight model of a transformers architecture, with ``tokenizer``, its
    weights drawn in float32 and then cast to ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    base.update(config)
    cfg = AutoConfig.for_model(arch, **base)
    torch.manual_seed(1234)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError:  # a family without an SDPA path (gpt-oss's sinks): its eager attention
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    # Random weights produce near-uniform logits; sharpen them so greedy paths are stable.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.to(dtype)
    model.generation_config.eos_token_id = None
    return wrap_model(model, tokenizer, name=name or f"tiny-{arch}")


@functools.cache
def stand_in() -> LoadedModel:
    """A small random-weight Llama with the embedded model's tokenizer, for the tests of what
    the cache does with KV (tiers, prefetch, prefix reuse): a decode step reads 15M weights
    against the embedded model's 135M, and a cached run still has to equal an uncached one to
    the last logprob.
    Head dim 64 as the embedded model's (KV quantization groups of 64)."""
    return tiny_model("llama", embedded("float32").tokenizer, name="stand-in", **STAND_IN)


STAND_IN = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192}


SERVER_STAND_IN = "stand-in"  # the model name a server of ``server_stand_in()`` answers to


@functools.cache
def server_stand_in() -> Path:
    """A narrow random-weight Llama saved as a model folder for ``kvcellar serve --model``
    (``stand_in_args()``), with the embedded model's tokenizer and KV geometry (30 layers, 3 KV
    heads of 64: 46,080 bytes a token in float32), for the tests of what servers do with KV
    blocks (SSD, Redis, faults, restarts): their block arithmetic is the embedded model's, a
    prefill costs a tenth of it. Weights drawn 5x wider than transformers' default, so that
    attention is peaked and greedy replies differ with the prompt (at the default every
    prompt gets one token repeated, which a wrong block would not change). Written once per
    test process, removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="kvcellar-test-stand-in-")) / SERVER_STAND_IN
    atexit.register(shutil.rmtree, folder.parent, ignore_errors=True)
    loaded = tiny_model("llama", embedded("float32").tokenizer, name=SERVER_STAND_IN, hidden_size=192,
                        intermediate_size=384, num_hidden_layers=30, num_attention_heads=3, num_key_value_heads=3,
                        head_dim=64, max_position_embeddings=8192, initializer_range=0.1)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


def stand_in_args() -> tuple[str, ...]:
    """``kvcellar serve`` arguments that serve ``server_stand_in()``."""
    return ("--model", str(server_stand_in()))


@functools.cache
def served_stand_in() -> LoadedModel:
    """``server_stand_in()`` loaded in process the way a server loads it: the reference its
    servers' replies must equal."""
    return prepare_and_load(str(server_stand_in()), dtype="float32", device=TEST_DEVICE)


def moe_q4_k_m_types(name: str) -> str:
    """A Qwen3-30B-A3B Q4_K_M-like mix: experts Q4_K but layer 0's down projections (Q6_K, as
    llama.cpp gives every other layer's), attention Q4_K, the router and norms F32, the output
    matrix Q6_K."""
    role = name.split(".")[-2]
    if role == "ffn_gate_inp":
        return "F32"
    if name == "output.weight" or name.startswith("blk.0.ffn_down_exps"):
        return "Q6_K"
    return "Q4_K"


@functools.cache
def moe_gguf() -> Path:
    """A small random-weight qwen3moe GGUF (the architecture of Qwen3-30B-A3B and
    Qwen3-Coder-30B-A3B: 8 experts of 256, 2 routed a token, q/k norms; ``moe_q4_k_m_types``;
    Qwen3-Coder's tool markup in its chat template), written once per test process with the
    ``gguf`` package, removed at exit."""
    from tests.artifacts.gguf_files import QWEN3_CODER_TEMPLATE, write_gguf

    folder = Path(tempfile.mkdtemp(prefix="kvcellar-test-moe-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return write_gguf(folder / "tiny-qwen3moe.gguf", arch="qwen3moe", seed=7, hidden=256, layers=3, heads=4,
                      kv_heads=2, experts=8, experts_used=2, expert_ffn=256, types=moe_q4_k_m_types, context=4096,
                      head_scale=0.5, chat_template=QWEN3_CODER_TEMPLATE)


@functools.cache
def gpt_oss_gguf() -> Path:
    """A small random-weight gpt-oss GGUF as llama.cpp writes gpt-oss-20b (``gpt_oss_types``:
    MXFP4 experts with biases, Q8_0 attention with biases and sinks, 16-token windows every
    other layer, YaRN rope), written once per test process, removed at exit."""
    from tests.artifacts.gguf_files import gpt_oss_types, write_gguf

    folder = Path(tempfile.mkdtemp(prefix="kvcellar-test-gpt-oss-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return write_gguf(folder / "tiny-gpt-oss.gguf", arch="gpt-oss", seed=5, hidden=256, layers=2, heads=4,
                      kv_heads=2, experts=8, experts_used=2, expert_ffn=128, types=gpt_oss_types, context=4096,
                      head_scale=0.5)


# A small Qwen3.5 (the hybrid, ``qwen3_5_text``): four layers, linear, linear, linear, full
# attention (transformers' interval of 4); ``QWEN35_MOE``: its MoE variant's experts.
QWEN35 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
QWEN35_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)


def qwen35_source(family: str = "dense") -> Any:
    """A small transformers Qwen3.5 model (``family`` dense or moe) over ``write_gguf``'s
    264-token vocabulary, for writing GGUFs of: its norms off their initial values (so that a
    missed offset shows) and sharp logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = "qwen3_5_moe_text" if family == "moe" else "qwen3_5_text"
    config = AutoConfig.for_model(model_type, **QWEN35, **(QWEN35_MOE if family == "moe" else {}), vocab_size=264,
                                  tie_word_embeddings=False)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    return model


@functools.cache
def qwen35_gguf() -> Path:
    """``qwen35_source()`` as llama.cpp writes a Qwen3.5 GGUF (Q8_0 matrices) with a chat template
    of Qwen3.5's rules (``QWEN35_TEMPLATE``: XML calls, reasoning), written once per test process,
    removed at exit."""
    from tests.artifacts.gguf_files import QWEN35_TEMPLATE, write_qwen35_gguf

    folder = Path(tempfile.mkdtemp(prefix="kvcellar-test-qwen35-gguf-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return write_qwen35_gguf(folder / "tiny-qwen35.gguf", qwen35_source(), quantized=True,
                             chat_template=QWEN35_TEMPLATE)


@functools.cache
def served_moe(weights: str = "auto") -> LoadedModel:
    """``moe_gguf()`` loaded as a server loads it (through the artifact cache), in float32."""
    from kvcellar.artifacts.store import ArtifactCache

    return prepare_and_load(str(moe_gguf()), dtype="float32", device=TEST_DEVICE, weights=weights,
                            artifacts=ArtifactCache(shared_models_dir()))


@functools.cache
def served_gpt_oss(weights: str = "auto") -> LoadedModel:
    """``gpt_oss_gguf()`` loaded as a server loads it (through the artifact cache), in float32."""
    from kvcellar.artifacts.store import ArtifactCache

    return prepare_and_load(str(gpt_oss_gguf()), dtype="float32", device=TEST_DEVICE, weights=weights,
                            artifacts=ArtifactCache(shared_models_dir()))


def served_file(path: Path, weights: str, dtype: str = "float32") -> LoadedModel:
    """The model at ``path`` (a folder or a GGUF) loaded as a server loads it, in ``dtype``, through
    an artifact cache of its own beside it (one per weights mode)."""
    from kvcellar.artifacts.store import ArtifactCache

    return prepare_and_load(str(path), dtype=dtype, device=TEST_DEVICE, weights=weights,
                            artifacts=ArtifactCache(path.parent / f"artifacts-{weights}"))


def tiered(model: LoadedModel, root: Path, policy: str = "write_through", tier_config: Any = None,
           **overrides: Any) -> Engine:
    """An engine (``make_engine``) over an SSD tier at ``root`` (no free-space floor unless
    ``tier_config`` says otherwise): another one over the same ``root`` is a restart."""
    from kvcellar.runtime import open_disk_tier
    from kvcellar.storage.disk.config import DiskConfig

    engine = make_engine(model, **overrides)
    open_disk_tier(engine, root, tier_config or DiskConfig(min_free_bytes=0), policy)
    return engine


def expected_cached(prompt_len: int, common: int, computed: int | None = None, block_size: int = 16) -> int:
    """Prompt tokens a prefix hit reuses: the whole blocks of the shared prefix (``common``
    tokens, of which ``computed`` hold KV), except that the last prompt token is always
    recomputed: a fully cached, block-aligned prompt reuses all but that one token."""
    limit = min(common, prompt_len, computed if computed is not None else common)
    full = (limit // block_size) * block_size
    return prompt_len - 1 if full == prompt_len else full


LOGPROB_TOL = 2e-4  # fp32: cached and uncached runs differ by ~1e-5


class UncachedRuns:
    """Cache-disabled results per prompt (memoised): the reference cached runs must equal.
    ``runs(prompt)`` computes one prompt alone; ``runs.many(prompts)`` computes the missing
    ones in one batch (cache disabled all the same; batching changes logprobs by far less
    than ``LOGPROB_TOL``), which is much cheaper for many long decodes."""

    def __init__(self, loaded: LoadedModel, params: Any, **overrides: Any) -> None:
        self.engine = make_engine(loaded, prefix_caching=False, **overrides)
        self.params = params
        self.memo: dict[tuple[int, ...], Any] = {}

    def __call__(self, prompt: Sequence[int]) -> Any:
        return self.many([prompt])[0]

    def many(self, prompts: Sequence[Sequence[int]]) -> list[Any]:
        missing = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in self.memo))
        if missing:
            for key, result in zip(missing, self.engine.generate([list(k) for k in missing], self.params),
                                   strict=True):
                self.memo[key] = result
        return [self.memo[tuple(p)] for p in prompts]


def uncached_runner(loaded: LoadedModel, params: Any, **overrides: Any) -> UncachedRuns:
    """``overrides``: engine settings the reference shares with the cached runs (e.g. ``kv_bits``)."""
    return UncachedRuns(loaded, params, **overrides)


def assert_same_output(result: Any, reference: Any, tol: float = LOGPROB_TOL) -> None:
    """Greedy tokens identical, text identical, logprobs within ``tol``."""
    assert result.token_ids == reference.token_ids
    assert result.text == reference.text
    assert torch.allclose(torch.tensor(result.logprobs), torch.tensor(reference.logprobs), atol=tol)


def assert_identical_output(result: Any, reference: Any) -> None:
    """Greedy tokens, text and every logprob (top ones too) identical to the bit: what a cache
    hit must give where a token's numbers do not depend on the step it runs in."""
    assert result.token_ids == reference.token_ids
    assert result.text == reference.text
    assert result.logprobs == reference.logprobs
    assert result.top_logprobs == reference.top_logprobs


def assert_equivalent_output(result: Any, reference: Any, tol: float, tie_margin: float = 0.3) -> None:
    """For bf16, where a step's rounding depends on how many rows its matmuls have (a prompt
    prefilled in other chunks, a last token recomputed alone after a hit): logprobs within
    ``tol`` up to the first token that differs, and that token a near-tie in the reference
    (among its ``top_logprobs``, within ``tie_margin`` of the reference's pick). A wrong
    block would move logprobs far more, from its first use on."""
    n = min(len(result.token_ids), len(reference.token_ids))
    first = next((i for i in range(n) if result.token_ids[i] != reference.token_ids[i]), n)
    assert torch.allclose(torch.tensor(result.logprobs[:first]), torch.tensor(reference.logprobs[:first]), atol=tol)
    if first < n:
        alternatives = dict(reference.top_logprobs[first])
        picked = result.token_ids[first]
        assert picked in alternatives, f"token {first}: {picked} is not among the reference's top choices"
        assert alternatives[picked] >= reference.logprobs[first] - tie_margin, f"token {first} is not a near-tie"
    else:
        assert len(result.token_ids) == len(reference.token_ids)


def assert_no_leaks(engine: Engine) -> None:
    """Every sequence gone, every block back: free or cached, none referenced."""
    bm = engine.blocks
    assert engine.num_active() == 0
    assert bm.num_used == 0
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free + bm.num_evictable == bm.num_blocks - 1
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert not sched.cache.busy()  # no load, prefetch or cancelled load still reading
    assert not sched.cache._computing
    states = sched.cache.states  # a hybrid model's recurrent-state slots: none held by a sequence
    assert states is None or states.num_held == 0


@functools.cache
def mlx_embedded() -> LoadedModel:
    """The embedded model on the MLX engine (``--engine mlx``), from the same prepared entry."""
    from kvcellar.artifacts.store import ArtifactCache
    from kvcellar.engine.mlx.loader import load_mlx

    return load_mlx(None, dtype="float32", artifacts=ArtifactCache(shared_models_dir()))


@functools.cache
def mlx_stand_in_folder() -> Path:
    """``stand_in()``'s weights saved as a folder (MLX's reference BLAS on Linux runs the embedded
    model at ~3 tokens/s; this one at ~10x that)."""
    folder = Path(tempfile.mkdtemp(prefix="kvcellar-test-mlx-")) / "mlx-stand-in"
    atexit.register(shutil.rmtree, folder.parent, ignore_errors=True)
    # a model of its own: an engine prepares the linears of the model it serves (stand_in()'s)
    loaded = tiny_model("llama", embedded("float32").tokenizer, name="mlx-stand-in", **STAND_IN)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@functools.cache
def mlx_stand_in() -> LoadedModel:
    """``mlx_stand_in_folder()`` on the MLX engine."""
    from kvcellar.engine.mlx.loader import load_mlx

    return load_mlx(str(mlx_stand_in_folder()), dtype="float32")
