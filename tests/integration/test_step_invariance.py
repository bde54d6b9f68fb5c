"""A token's numbers do not depend on the step it runs in, under the settings users run.

The embedded model served as ``--weights auto`` picks (int4 from its Q4_1 GGUF), int4 and
int8, with kvcellar's kernels on: a cold prompt prefilled in chunks of 13 or 64 tokens, a
RAM hit (the whole prompt cached but its last token, or a shared prefix with another tail),
a batch beside another request, and an SSD hit after a restart all give the cache-disabled
engine's greedy tokens and logprobs to the bit. Each int4 kernel path this CPU has is forced
in turn (the AVX2 panels also on a CPU with AVX-512 VNNI), and torch's kernels (kvcellar's not
built) agree to float rounding: their attention is SDPA, whose sums depend on the step.
Before, steps of up to a calibrated row count ran the kernels on 8-bit activations and larger
ones the dequantized weights, and a hit's last tokens got other numbers than a cold prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcellar.engine import SamplingParams, native
from tests._models import (
    TEST_DEVICE,
    assert_equivalent_output,
    assert_identical_output,
    assert_no_leaks,
    chat_ids,
    embedded,
    expected_cached,
    make_engine,
    needs_native,
    tiered,
    uncached_runner,
    without_native_kernels,
)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=5)
SYSTEM = ("You answer questions about a city library's opening hours, loans and rooms in one short sentence. "
          "Atlases are on the second floor; the quiet room opens at nine; DVDs go out for a week. ") * 8
# bf16 logprobs of runs rounded differently (as tests/engine/test_quantization.py)
BF16_LOGPROB_TOL = 0.3
QUESTIONS = ("Where are the atlases?", "Is there a quiet room?", "How long can I keep a DVD?")


def kernel_paths() -> list[str]:
    """The int4 panels this CPU runs: the AVX2 ones always, the 16-row ones with AVX-512 VNNI."""
    return ["avx2", "wide"] if native.available() and native.cpu_flags() >= native.WIDE_FLAGS else ["avx2"]


def force(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "avx2":
        monkeypatch.setattr(native.matmul, "wide_panels", lambda: False)


@needs_native
@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("weights", ["auto", "int4", "int8"])
def test_every_step_shape_and_ram_hit_gives_the_uncached_bits(weights, path, monkeypatch):
    force(path, monkeypatch)
    if weights == "int4" and embedded("auto", "auto").weights == "int4":
        pytest.skip("--weights auto serves int4 here: its case ran these steps")
    loaded = embedded("auto", weights)
    assert loaded.weights in ("int4", "int8")
    uncached = uncached_runner(loaded, PARAMS)  # whole prompts in one step of up to 512 tokens
    prompts = [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS]
    assert all(len(p) > 300 for p in prompts)  # past the attention kernel's chunk of 256
    for chunk in (13, 64):  # and the reference's one step of 512
        engine = make_engine(loaded, max_step_tokens=chunk)
        cold = engine.generate([prompts[0]], PARAMS)[0]
        assert_identical_output(cold, uncached(prompts[0]))
        full = engine.generate([prompts[0]], PARAMS)[0]  # every block cached: the last token alone
        assert full.num_cached_tokens == expected_cached(len(prompts[0]), len(prompts[0]))
        assert_identical_output(full, uncached(prompts[0]))
        for got, prompt in zip(engine.generate(prompts[1:], PARAMS), prompts[1:], strict=True):  # partial, batched
            assert got.num_cached_tokens > 0
            assert_identical_output(got, uncached(prompt))
        assert_no_leaks(engine)
        engine.shutdown(10)


@needs_native
def test_a_restart_serves_from_ssd_the_uncached_bits(tmp_path: Path):
    loaded = embedded("auto", "auto")
    uncached = uncached_runner(loaded, PARAMS)
    prompts = [chat_ids(loaded, q, SYSTEM) for q in QUESTIONS[:2]]

    first = tiered(loaded, tmp_path, max_step_tokens=64)
    first.generate([prompts[0]], PARAMS)
    assert first.shutdown(30)
    second = tiered(loaded, tmp_path, max_step_tokens=64)  # empty RAM, the same directory
    got = second.generate([prompts[0]], PARAMS)[0]  # all but the last token from the SSD
    assert got.cached_tokens_by_tier.get("ssd", 0) == expected_cached(len(prompts[0]), len(prompts[0]))
    assert_identical_output(got, uncached(prompts[0]))
    got = second.generate([prompts[1]], PARAMS)[0]  # a shared prefix, now in RAM, and another tail
    assert got.num_cached_tokens > 0
    assert_identical_output(got, uncached(prompts[1]))
    assert second.shutdown(30)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="torch's CPU kernels")
def test_with_torchs_kernels_every_step_agrees_to_float_rounding(monkeypatch):
    """kvcellar's kernels not built: the quantized linears of a bf16 model run torch's kernels
    (also for every step: their rows' numbers do not depend on the row count either, tested
    in test_quantization), and attention is SDPA's, which rounds by the step's shape."""
    without_native_kernels(monkeypatch)
    loaded = embedded.__wrapped__("bfloat16", "int4")
    uncached = uncached_runner(loaded, PARAMS)
    prompt = chat_ids(loaded, QUESTIONS[0], SYSTEM)
    engine = make_engine(loaded, max_step_tokens=13)
    assert not engine.runner.pool.attends
    assert engine.runner.linears.quantized and all(not m.native for m in engine.runner.linears.quantized)
    for _ in range(2):  # cold in chunks of 13, then a full hit
        assert_equivalent_output(engine.generate([prompt], PARAMS)[0], uncached(prompt), BF16_LOGPROB_TOL)
    engine.shutdown(10)
