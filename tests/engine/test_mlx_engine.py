"""The MLX engine (``--engine mlx``, engine/mlx/) in process, on MLX's CPU backend: mlx-lm's
own greedy output and the torch engine's logits on the embedded model, and every prefix-cache
path cached == uncached (full and partial hits, chunked prefill, preemption, the SSD tier after
a restart, 8- and 4-bit KV) on the stand-in saved as a folder (MLX's reference BLAS here runs
the embedded model at a few tokens a second)."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
import torch
from mlx_lm.generate import generate_step

from kvcellar.engine import SamplingParams
from kvcellar.engine.mlx.runner import span_groups
from kvcellar.errors import ModelLoadError
from tests._models import (
    assert_no_leaks,
    assert_same_output,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    mlx_embedded,
    mlx_stand_in,
    mlx_stand_in_folder,
    tiered,
    tiny_model,
    uncached_runner,
)
from tests.engine.test_speculative import speculative

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
SYSTEM = "You answer questions about the storage runbook in one short sentence, citing the step. " * 4


@pytest.fixture(scope="module")
def model():
    return mlx_stand_in()


def test_greedy_output_is_mlx_lm_generate_and_the_torch_engine_agrees():
    loaded = mlx_embedded()
    prompt = loaded.tokenizer("The capital of France is Paris. The capital of Germany is")["input_ids"]
    engine = make_engine(loaded)
    ours = engine.generate([prompt], GREEDY)[0]
    theirs = [int(t) for t, _ in generate_step(mx.array(prompt), loaded.model.module, max_tokens=8,
                                               sampler=lambda x: mx.argmax(x, axis=-1))]
    assert ours.token_ids == theirs
    assert engine.descriptor["engine"] == "mlx"
    assert_no_leaks(engine)
    engine.shutdown(10)

    torch_engine = make_engine(embedded("float32"))  # the same weights on the torch engine
    reference = torch_engine.generate([prompt], GREEDY)[0]
    torch_engine.shutdown(10)
    assert reference.token_ids == ours.token_ids
    torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=2e-3)
    assert torch_engine.fingerprint != engine.fingerprint  # other arithmetic, other namespace


@pytest.mark.parametrize(("kv_bits", "kv_group_size"), [(16, 64), (8, 64), (4, 32)])
def test_prefix_hits_chunks_and_preemption_equal_uncached(model, kv_bits, kv_group_size):
    kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
    uncached = uncached_runner(model, GREEDY, **kv)
    prompts = [chat_ids(model, q, SYSTEM) for q in ("Disk is full on db-3.", "Replica lag is 40 MB.",
                                                     "Renew the certificate?")]
    # chunks of 24 tokens: prefill spans across block boundaries, decodes beside them
    engine = make_engine(model, max_step_tokens=24, **kv)
    first = engine.generate(prompts[:1], GREEDY)[0]
    assert_same_output(first, uncached(prompts[0]))
    rest = engine.generate(prompts, GREEDY)  # a full hit and two partial ones, batched
    for prompt, result in zip(prompts, rest, strict=True):
        assert_same_output(result, uncached(prompt))
        assert result.num_cached_tokens == expected_cached(len(prompt), len(prompts[0]) if prompt == prompts[0]
                                                           else _common(prompt, prompts[0]))
    assert_no_leaks(engine)
    engine.shutdown(10)
    uncached.engine.shutdown(10)
    if kv_bits != 16:  # preemption frees and refills blocks as at 16 bits: the pool's code, not MLX's
        return

    # a pool too small for three growing sequences: some are preempted and resumed
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
    alone = uncached_runner(model, long, block_size=8, **kv)
    short = [model.tokenizer(f"Step {i}: check the disk, then the replicas, then the certificates.")["input_ids"]
             for i in range(3)]
    tight = make_engine(model, block_size=8, kv_cache_blocks=12, **kv)
    results = tight.generate(short, long)
    assert tight.scheduler.stats.preemptions > 0
    for prompt, result in zip(short, results, strict=True):
        assert_same_output(result, alone(prompt))
    assert_no_leaks(tight)
    tight.shutdown(10)
    alone.engine.shutdown(10)


def test_padded_prefill_batches_and_drafts_equal_uncached(model):
    """Prompts of different lengths prefilled as one padded call, and drafts verified
    (``--speculative ngram``): each output is its uncached single run's."""
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True)
    uncached = uncached_runner(model, params, speculative="off")
    base = "List the steps: disk, replicas, certificates, backups, alerts. "
    prompts = [model.tokenizer(base * n + "Again: disk, replicas, certificates,")["input_ids"] for n in (3, 3, 4)]
    prompts[1] = prompts[1][:-2]  # two tokens shorter: padded
    engine = speculative(model, max_step_tokens=512)  # every draft verified
    results = engine.generate(prompts, params)
    assert engine.stats.spec_verifies > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert_same_output(result, uncached(prompt))
    assert_no_leaks(engine)
    engine.shutdown(10)
    uncached.engine.shutdown(10)


def test_spans_of_similar_length_share_a_call():
    assert span_groups([40, 38, 12, 11, 40, 9]) == [[0, 4, 1, 2], [3, 5]]  # 17.5 % and 9 % padding
    assert span_groups([100, 50]) == [[0], [1]]  # 33 % padding: apart
    assert span_groups([]) == []


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_ssd_tier_after_a_restart(model, tmp_path):
    uncached = uncached_runner(model, GREEDY)
    prompt = chat_ids(model, "Fail over with lag?", SYSTEM)
    first = tiered(model, tmp_path)
    a = first.generate([prompt], GREEDY)[0]
    assert first.shutdown(30)
    second = tiered(model, tmp_path)  # empty RAM, the same directory
    b = second.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert second.scheduler.cache.stats.lower_tier_hit_tokens == b.num_cached_tokens
    assert_same_output(a, uncached(prompt))
    assert_same_output(b, uncached(prompt))
    assert second.shutdown(30)
    uncached.engine.shutdown(10)


@pytest.mark.parametrize(("arch", "config"), [
    # Llama 3.x's RoPE scaling, as transformers 5 writes it (rope_parameters)
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    # six layers: five of them sliding (a 16-token window), the last global
    ("gemma3_text", {"num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 16}),
])
def test_each_family_gives_the_torch_engines_tokens(arch, config, tmp_path):
    """A small random model of each family mlx-lm and kvcellar both serve, saved as a folder:
    the MLX engine's greedy tokens and logprobs are the torch engine's on the same weights,
    over a prompt longer than a sliding window, and again from the cache."""
    from kvcellar.engine.mlx.loader import load_mlx

    torch_model = tiny_model(arch, mlx_stand_in().tokenizer, **config)
    torch_model.model.save_pretrained(tmp_path / arch)
    torch_model.tokenizer.save_pretrained(tmp_path / arch)
    ours = load_mlx(str(tmp_path / arch), dtype="float32")
    prompt = ours.tokenizer("Check the disk, then the replicas, then the certificates. " * 5)["input_ids"]
    reference = make_engine(torch_model).generate([prompt], GREEDY)[0]
    engine = make_engine(ours, max_step_tokens=32)
    for result in engine.generate([prompt], GREEDY) + engine.generate([prompt], GREEDY):
        assert result.token_ids == reference.token_ids
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(reference.logprobs),
                                   rtol=0, atol=2e-3)
    assert result.num_cached_tokens > 0
    engine.shutdown(10)


def test_mlx_quantized_weights_are_other_weights_and_their_hits_equal_uncached(model):
    """``--weights int4`` under MLX (``mlx.nn.quantize``): another weights identity, so another
    cache, and its hits give what recomputing with those weights gives."""
    from kvcellar.engine.mlx.loader import load_mlx

    int4 = load_mlx(str(mlx_stand_in_folder()), dtype="float32", weights="int4")
    assert int4.weights == "int4" and int4.weights_id != model.weights_id
    assert "QuantizedLinear" in {type(m).__name__ for _, m in int4.model.module.named_modules()}
    uncached = uncached_runner(int4, GREEDY)
    prompt = chat_ids(int4, "Where is the runbook?", SYSTEM)
    engine = make_engine(int4)
    first, again = engine.generate([prompt], GREEDY) + engine.generate([prompt], GREEDY)
    assert again.num_cached_tokens == expected_cached(len(prompt), len(prompt))
    assert_same_output(first, uncached(prompt))
    assert_same_output(again, uncached(prompt))
    full = make_engine(model)
    assert full.generate([prompt], GREEDY)[0].logprobs != first.logprobs  # they are other weights
    assert full.fingerprint != engine.fingerprint
    for e in (engine, full, uncached.engine):
        e.shutdown(10)


def test_without_the_extra_the_error_names_it(monkeypatch):
    from kvcellar.engine.mlx import require_mlx

    monkeypatch.setitem(sys.modules, "mlx.core", None)  # what an environment without MLX imports
    with pytest.raises(ModelLoadError, match=r"pip install 'kvcellar\[mlx\]'"):
        require_mlx()


def test_architectures_mlx_lm_and_kvcellar_do_not_share_are_refused(tmp_path):
    from kvcellar.engine.mlx.loader import load_mlx

    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    with pytest.raises(ModelLoadError, match=r"--engine mlx does not serve the 'qwen3_moe'.*--engine torch"):
        load_mlx(str(folder))
