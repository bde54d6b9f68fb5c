"""Speculative decoding gives the output decoding without drafts gives.

The embedded model as ``--weights auto`` serves it, kvcellar's kernels on: greedy tokens and
logprobs to the bit against an engine without speculation, for text that repeats (a file to
rewrite, a JSON document, a list) and text that does not, batched together, with stop strings
and ``max_tokens`` inside accepted drafts, grammars, 8-bit KV, and seeded sampling; a
chi-square test of the sampled distribution at a drafted position; no block leaked or
published with a rejected token's KV (a later hit on the output gives the uncached bits). Most
cases run ``Eager``, the real drafter with its cost test left out (every candidate draft is
verified whole), so that drafts, rejections and rollbacks happen at every step that has a
match; one case runs the drafter as served. A hybrid model (Qwen3.5) too: its recurrent state
rewound where drafts are rejected, its snapshots the plain decoding's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.engine import SamplingParams, native
from kvcellar.engine.config import STEP_HYBRID_VERIFIES
from kvcellar.engine.speculation import (
    EXPLORE_EVERY,
    Candidate,
    Drafter,
    NgramIndex,
    RecentOutputs,
    RowCost,
    SharedOutputs,
)
from kvcellar.engine.tokenization import encode_chat
from kvcellar.server.generation import Generation, Inflight, Timeouts
from kvcellar.server.tools.grammar import forced_call_grammar
from tests._models import (
    assert_identical_output,
    assert_no_leaks,
    embedded,
    make_engine,
    needs_native,
    qwen35_gguf,
    served_file,
    tiered,
    uncached_runner,
)

CODE = "\n".join(f"def scale_{i}(values, factor={i}):\n    return [v * factor + {i * i} for v in values]\n"
                 for i in range(12))
DOCUMENT = json.dumps({"status": "draft", "rows": [{"id": i, "city": ["Lyon", "Porto", "Oslo"][i % 3],
                                                     "open": i % 2 == 0} for i in range(10)]}, indent=1)
PROMPTS = {
    "rewrite": f"Here is a file:\n```python\n{CODE}```\nRename scale to grow everywhere. Reply with the whole file.",
    "json": f"```json\n{DOCUMENT}\n```\nRepeat this JSON with status set to final.",
    "list": "Continue this list up to 30: 1. apple 2. pear 3. plum 4. apple 5. pear 6. plum 7. apple 8.",
    "natural": "Tell me about the history of tea in two paragraphs.",
}
GREEDY = SamplingParams(max_tokens=72, temperature=0.0, logprobs=True, top_logprobs=3)


class Eager(Drafter):
    """The drafter with its cost test left out: every candidate's whole draft is verified."""

    def choose(self, candidates: list[Candidate], rows: int, budget: int) -> None:
        for c in candidates:
            c.taken = min(len(c.draft), budget)
            budget -= c.taken


@pytest.fixture(scope="module")
def loaded() -> Any:
    return embedded("auto", "auto")


def chat(loaded: Any, text: str) -> list[int]:
    return encode_chat(loaded.tokenizer, [{"role": "user", "content": text}])


def speculative(loaded: Any, mode: str = "ngram", eager: bool = True, **overrides: Any) -> Any:
    engine = make_engine(loaded, speculative=mode, **overrides)
    if eager:
        engine.scheduler.drafter = _eager(engine, mode)
    return engine


def spec_counts(engine: Any) -> tuple[int, int, int]:
    s = engine.stats
    return s.spec_verifies, s.spec_drafted_tokens, s.spec_accepted_tokens


def test_verifications_of_any_size_spin_the_kernels_threads_and_prefill_does_not(loaded):
    """A step of decodes and verifications alone (no prefill chunk) spins the kernels' workers
    between its loops whatever its rows, as a decode step does (``thread_spin`` on): a worker that
    slept would be woken at every loop; a prefill chunk's step does not spin."""
    from kvcellar.engine.model_runner import SMALL_STEP_TOKENS
    from kvcellar.engine.native import threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a test worker runs on one thread; spinning needs a second
    try:
        engine = speculative(loaded, thread_spin="on", decode_threads=2)
        seen: list[tuple[int, bool]] = []
        forward = engine.runner.forward

        def spy(*args: Any) -> Any:
            seen.append((int(args[0].shape[1]), threads.spinning()))
            return forward(*args)

        engine.runner.forward = spy
        engine.generate([chat(loaded, PROMPTS["list"])], GREEDY)
    finally:
        torch.set_num_threads(before)
    assert seen[0][0] > SMALL_STEP_TOKENS and not seen[0][1]  # the prompt
    large = [spins for rows, spins in seen[1:] if rows > SMALL_STEP_TOKENS]
    assert large and all(large), seen  # verifications of 9 rows
    assert all(spins for _, spins in seen[1:])


def test_greedy_output_is_the_plain_decoding_in_a_mixed_batch(loaded):
    prompts = [chat(loaded, p) for p in PROMPTS.values()]
    prompts.append(prompts[0])  # n > 1: two sequences of one prompt
    reference = uncached_runner(loaded, GREEDY, speculative="off").many(prompts)
    engine = speculative(loaded)
    results = engine.generate(prompts, GREEDY)
    for result, ref in zip(results, reference, strict=True):
        assert_identical_output(result, ref)
        assert result.finish_reason == ref.finish_reason
    verifies, drafted, accepted = spec_counts(engine)
    assert verifies > 0 and 0 < accepted < drafted  # drafts taken and drafts rolled back
    assert engine.stats.steps < GREEDY.max_tokens + 8  # fewer steps than tokens: drafts were taken
    assert_no_leaks(engine)


def test_the_drafter_as_served_speeds_up_a_copy_and_keeps_its_output(loaded):
    prompt = chat(loaded, PROMPTS["rewrite"])
    params = SamplingParams(max_tokens=100, temperature=0.0)
    [ref] = uncached_runner(loaded, params, speculative="off").many([prompt])
    engine = speculative(loaded, eager=False)
    [result] = engine.generate([prompt], params)
    assert result.token_ids == ref.token_ids and result.text == ref.text
    assert spec_counts(engine)[2] > 25 and engine.stats.steps < 80  # 100 tokens
    assert_no_leaks(engine)


def test_events_that_arrived_together_reach_the_server_as_one(loaded):
    """The server's stream of a request (server/generation.py) joins the events of a sequence
    that arrived together (a verified draft's tokens): the same text and totals in fewer events;
    with logprobs asked for, an event a token, each with its logprob. The engine is stepped
    before the events are read, so that every event has arrived: one event then."""

    async def stream(engine: Any, prompt: list[int], params: SamplingParams) -> list[Any]:
        gen = Generation(engine, Inflight(), Timeouts(first_token=600.0, inter_token=600.0))
        gen.submit([prompt], [params], cache_salt=None)
        try:
            while engine.step():  # the events wait in the loop's queue
                pass
            return [event async for _, event in gen.events()]
        finally:
            gen.close()

    prompt = chat(loaded, PROMPTS["rewrite"])
    engine = speculative(loaded)
    for logprobs in (False, True):
        params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=logprobs)
        [ref] = uncached_runner(loaded, params, speculative="off").many([prompt])
        events = asyncio.run(stream(engine, prompt, params))
        assert "".join(e.text for e in events) == ref.text
        assert events[-1].finish_reason == ref.finish_reason
        assert events[-1].num_output_tokens == len(ref.token_ids)
        if logprobs:
            assert [e.token_id for e in events] == ref.token_ids
            assert all(e.logprob is not None for e in events)
        else:
            assert len(events) == 1
    assert spec_counts(engine)[2] > 20


def test_stop_strings_and_max_tokens_inside_accepted_drafts(loaded):
    prompt = chat(loaded, PROMPTS["json"])
    [full] = uncached_runner(loaded, GREEDY, speculative="off").many([prompt])
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 6]  # a stop string in the copied middle
    assert stop.strip() and stop in text
    cases = [SamplingParams(max_tokens=72, temperature=0.0, stop=(stop,)),
             SamplingParams(max_tokens=37, temperature=0.0, logprobs=True),
             SamplingParams(max_tokens=1, temperature=0.0)]
    reference = make_engine(loaded, prefix_caching=False, speculative="off").generate([prompt] * len(cases), cases)
    engine = speculative(loaded)
    for result, ref in zip(engine.generate([prompt] * len(cases), cases), reference, strict=True):
        assert result.token_ids == ref.token_ids and result.text == ref.text
        assert result.finish_reason == ref.finish_reason and result.logprobs == ref.logprobs
    assert [r.finish_reason for r in reference] == ["stop", "length", "length"]
    assert spec_counts(engine)[2] > 0
    assert_no_leaks(engine)


def test_grammars_json_schema_and_forced_tool_calls(loaded):
    schema = {"type": "object", "properties": {"status": {"type": "string"}, "rows": {
        "type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                    "city": {"type": "string"}}}}},
              "required": ["status", "rows"]}
    engine = speculative(loaded)
    plain = make_engine(loaded, speculative="off")
    tool = {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}}
    cases = [(PROMPTS["json"], lambda e: e.grammars.json_schema(schema, param="response_format")),
             (PROMPTS["rewrite"], lambda e: forced_call_grammar(e.grammars, "hermes", [tool], parallel=False))]
    for text, grammar in cases:
        prompt = chat(loaded, text)
        ours = SamplingParams(max_tokens=64, temperature=0.0, logprobs=True, grammar=grammar(engine))
        theirs = SamplingParams(max_tokens=64, temperature=0.0, logprobs=True, grammar=grammar(plain))
        [result] = engine.generate([prompt], ours)
        [ref] = plain.generate([prompt], theirs)
        assert result.token_ids == ref.token_ids and result.logprobs == ref.logprobs
        assert result.finish_reason == ref.finish_reason
    assert spec_counts(engine)[2] > 0
    assert_no_leaks(engine)


def test_quantized_kv(loaded):
    prompts = [chat(loaded, PROMPTS["rewrite"]), chat(loaded, PROMPTS["list"])]
    reference = uncached_runner(loaded, GREEDY, kv_bits=8, speculative="off").many(prompts)
    engine = speculative(loaded, kv_bits=8)
    for result, ref in zip(engine.generate(prompts, GREEDY), reference, strict=True):
        assert_identical_output(result, ref)
    assert spec_counts(engine)[2] > 0
    assert_no_leaks(engine)


def test_seeded_sampling_gives_the_same_tokens(loaded):
    prompts = [chat(loaded, PROMPTS["json"]), chat(loaded, PROMPTS["list"])]
    params = [SamplingParams(max_tokens=64, temperature=0.7, top_p=0.95, seed=s) for s in (1, 2)]
    plain = make_engine(loaded, speculative="off").generate(prompts, params)
    engine = speculative(loaded)
    for result, ref in zip(engine.generate(prompts, params), plain, strict=True):
        assert result.token_ids == ref.token_ids
    assert spec_counts(engine)[2] > 0


def test_sampled_tokens_at_a_drafted_position_follow_the_model(loaded):
    """The second token is sampled at a verification row whose draft the prompt suggests; its
    frequencies, given the most common first token, against the sampling distribution (top 20
    at temperature 0.6, from a run without drafts with the top 20 logprobs), by a chi-square
    test."""
    text = "red green blue red green blue red green blue red green blue red green"
    prompt = loaded.tokenizer(text)["input_ids"]
    n = 240
    engine = speculative(loaded, max_num_seqs=16)  # 16: every decode of a step gets its draft
    # max_tokens 3: the second token is picked at a verification (nothing is drafted to be the last)
    params = [SamplingParams(max_tokens=3, temperature=0.6, top_k=20, seed=1000 + i) for i in range(n)]
    pairs = [tuple(r.token_ids[:2]) for r in engine.generate([prompt] * n, params)]
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    seconds = [p[1] for p in pairs if p[0] == first]
    assert len(seconds) > 100
    assert spec_counts(engine)[0] >= len(seconds)  # after the likeliest first token, the prompt drafts
    plain = make_engine(loaded, speculative="off")
    [probe] = plain.generate([[*prompt, first]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=True,
                                                                top_logprobs=20))
    top = dict(probe.top_logprobs[0])
    weights = torch.softmax(torch.tensor(list(top.values()), dtype=torch.float64) / 0.6, dim=0)
    probs = dict(zip(top, weights.tolist(), strict=True))
    observed: dict[int, int] = {}
    for t in seconds:
        observed[t] = observed.get(t, 0) + 1
    cells = [t for t, p in probs.items() if p * len(seconds) >= 5]
    stat, rest_obs, rest_exp = 0.0, len(seconds), len(seconds)
    for t in cells:
        expected = probs[t] * len(seconds)
        stat += (observed.get(t, 0) - expected) ** 2 / expected
        rest_obs -= observed.get(t, 0)
        rest_exp -= expected
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        dof = len(cells)
    else:
        dof = len(cells) - 1
    assert dof >= 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, (stat, dof, observed, probs)


def test_rejected_tokens_are_never_published(loaded, tmp_path: Path):
    """Blocks written through to the SSD while drafts were rolled back hold the KV of the tokens
    kept: a restarted engine's hit on the whole output gives the uncached bits."""
    prompt = chat(loaded, PROMPTS["rewrite"])
    params = SamplingParams(max_tokens=80, temperature=0.0)
    engine = tiered(loaded, tmp_path / "kv", speculative="ngram")
    engine.scheduler.drafter = _eager(engine, "ngram")
    [result] = engine.generate([prompt], params)
    assert 0 < spec_counts(engine)[2] < spec_counts(engine)[1]
    assert_no_leaks(engine)
    assert engine.shutdown()
    follow = prompt + result.token_ids[:-1]
    probe = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    [ref] = uncached_runner(loaded, probe, speculative="off").many([follow])
    restarted = tiered(loaded, tmp_path / "kv", speculative="off")
    [hit] = restarted.generate([follow], probe)
    assert hit.num_cached_tokens >= (len(follow) // 16 - 1) * 16
    assert_identical_output(hit, ref)
    restarted.shutdown()


def test_the_drafter_is_the_one_the_settings_ask_for():
    from kvcellar.engine.build import _drafter
    from kvcellar.engine.config import EngineConfig

    assert _drafter(EngineConfig(), exact=False) is None  # auto: not where rows round apart
    assert getattr(_drafter(EngineConfig(), exact=True), "mode", None) == "suffix"
    assert _drafter(EngineConfig(speculative="off"), exact=True) is None
    assert isinstance(_drafter(EngineConfig(speculative="suffix"), exact=False), Drafter)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="eagle").validate()
    with pytest.raises(ValueError, match="speculative_max_tokens"):
        EngineConfig(speculative_max_tokens=0).validate()


# ---- the drafter's parts -----------------------------------------------------------------------


def test_ngram_index_finds_the_latest_longest_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    index = NgramIndex()
    index.extend(tokens, len(tokens) - 1)
    pos, n = index.match(tokens)
    assert (pos, n) == (3, 3)  # "1 2 3" occurred at 0..2: its continuation starts at 3, not after "2 3" at 5
    index.extend([*tokens, 7], len(tokens))
    assert index.match([8, 8]) == (-1, 0)


def test_ngram_index_takes_the_occurrence_in_the_same_surroundings():
    # "1 2 3 4" occurs twice, after "60 61 62" and after "70 71 72"; the list ends "60 61 62 1 2 3 4":
    # the first occurrence agrees 7 tokens back, the latest 4, so the draft is what followed the first
    tokens = [60, 61, 62, 1, 2, 3, 4, 100, 70, 71, 72, 1, 2, 3, 4, 200, 60, 61, 62, 1, 2, 3, 4]
    index = NgramIndex()
    index.extend(tokens, len(tokens) - 1)
    assert index.match(tokens) == (7, 7)
    assert Drafter("ngram", 8).candidate(0, tokens, 2).draft == [100, 70]
    # equal agreement: the latest occurrence
    assert index.match([*tokens[:16], 1, 2, 3, 4]) == (15, 4)
    # only the KEEP latest occurrences are kept
    many = [*tokens[:8]] + [5, 1, 2, 3, 4, 6] * NgramIndex.KEEP + [60, 61, 62, 1, 2, 3, 4]
    index = NgramIndex()
    index.extend(many, len(many) - 1)
    assert index.match(many)[1] == 4  # the first occurrence, the one that agreed further back, is gone


def test_suffix_prefers_other_outputs_over_a_bare_bigram_of_its_own(tmp_path: Path):
    outputs = RecentOutputs(tmp_path / "outputs")
    outputs.add(b"root", [40, 41, 1, 2, 3, 4, 5, 6])
    drafter = Drafter("suffix", 8, outputs)
    # its own tokens have "1 2" once, after 7 (not 41): agreement 2; the shared outputs continue "41 1 2"
    own = [7, 1, 2, 9, 9, 9, 41, 1, 2]
    assert drafter.candidate(1, own, 4, b"root").draft == [3, 4, 5, 6]
    # an own match agreeing 3 tokens back (SHARED_OVER_AGREEMENT) keeps its own continuation
    own = [41, 1, 2, 9, 9, 9, 41, 1, 2]
    assert drafter.candidate(2, own, 4, b"root").draft == [9, 9, 9, 41]
    assert Drafter("ngram", 8).candidate(3, [7, 1, 2, 9, 9, 9, 41, 1, 2], 4).draft == [9, 9, 9, 41]
    outputs.close()


def test_shared_outputs_draft_while_continuations_agree_and_forget_old_ones():
    shared = SharedOutputs(capacity=40)
    shared.add([1, 2, 3, 4, 5, 6])
    shared.add([1, 2, 3, 4, 5, 6])
    assert shared.draft([9, 1, 2], 8) == [3, 4, 5, 6]
    shared.add([1, 2, 7, 7, 7, 7])
    shared.add([1, 2, 7, 7, 7, 7])
    shared.add([1, 2, 8, 8, 8, 8])
    assert shared.draft([9, 1, 2], 8) == []  # what follows "1 2" agrees in 2 of 5 outputs only
    for _ in range(10):
        shared.add([5, 5, 5, 5, 5])
    assert shared.tokens <= 40 and shared.draft([1, 2], 4) == []  # the old outputs are gone


def test_row_costs_interpolate_and_extrapolate():
    costs = RowCost()
    assert costs.seconds(3) is None
    costs.observe(1, 0.030)
    assert costs.seconds(2) == pytest.approx(0.030 + RowCost.PRIOR_SLOPE * 0.030)
    costs.observe(5, 0.070)
    assert costs.seconds(3) == pytest.approx(0.050)
    assert costs.seconds(9) == pytest.approx(0.110)


def test_a_step_the_host_stalled_does_not_price_its_row_count_out():
    """A step of a row count that a page fault, a first call or another process held up leaves its
    cost where its other steps put it (drafts of that length stay chosen, and measured), even
    where it came first; a lasting change moves it once it is most of the recent steps."""
    costs = RowCost()
    costs.observe(4, 0.100)
    for _ in range(5):
        costs.observe(1, 0.004)
        costs.observe(4, 0.006)
    costs.observe(4, 0.100)
    assert costs.seconds(4) == pytest.approx(0.006)
    drafter = Drafter("ngram", 8)
    drafter.costs = costs
    drafter.choose([sure := Candidate(1, [5] * 3, 0.95)], 1, 8)
    assert sure.taken == 3
    for _ in range(RowCost.WINDOW):
        costs.observe(4, 0.009)
    assert costs.seconds(4) == pytest.approx(0.009)


def test_drafts_are_chosen_by_what_they_pay():
    memory_bound = Drafter("ngram", 8)  # a big model's step: rows nearly free up to the panels' width
    for rows, seconds in ((1, 0.300), (2, 0.310), (9, 0.350)):
        memory_bound.observe(rows, seconds)
    sure, unsure = Candidate(1, [5] * 8, 0.9), Candidate(2, [6] * 8, 0.2)
    memory_bound.choose([sure, unsure], 1, 16)
    assert sure.taken == 8 and unsure.taken <= 1
    compute_bound = Drafter("ngram", 8)  # every row costs its share of the step
    for rows, seconds in ((8, 0.090), (16, 0.180)):
        compute_bound.observe(rows, seconds)
    many = [Candidate(i, [5] * 8, 0.6) for i in range(8)]
    compute_bound.choose(many, 8, 16)
    assert all(c.taken == 0 for c in many)
    declined = [Candidate(i, [5] * 8, 0.6) for i in range(8)]
    for _ in range(EXPLORE_EVERY - 2):  # the step above was the first declined
        compute_bound.choose(declined, 8, 16)
        assert all(c.taken == 0 for c in declined)
    compute_bound.choose(declined, 8, 16)  # now and then one token anyway, to measure again
    assert sum(c.taken for c in declined) == 1
    uneven = Drafter("ngram", 8)  # odd row counts cost as the next even one: 3 rows cost more than 4
    for rows, seconds in ((1, 0.010), (2, 0.011), (3, 0.020), (4, 0.012)):
        uneven.observe(rows, seconds)
    uneven.choose([four := Candidate(1, [5] * 8, 0.9)], 1, 3)
    assert four.taken == 3
    unknown = Drafter("ngram", 8)  # no step seen yet: nothing is drafted
    unknown.choose([sure := Candidate(1, [5] * 4, 0.99)], 1, 16)
    assert sure.taken == 0


def test_suffix_drafts_from_earlier_outputs_and_keeps_them_across_a_restart(loaded, tmp_path: Path):
    """A second request that writes what an earlier one wrote drafts from it (suffix), with the
    same output; the outputs survive a restart in the cache dir."""
    from kvcellar.runtime import keep_outputs

    prompts = [chat(loaded, "Write a haiku about the sea."), chat(loaded, "Write a haiku about the sea, please.")]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    reference = make_engine(loaded, speculative="off").generate(prompts, params)
    engine = make_engine(loaded, speculative="suffix")
    keep_outputs(engine, tmp_path)
    engine.scheduler.drafter = drafter = _eager(engine, "suffix")
    [first] = engine.generate(prompts[:1], params)
    before = spec_counts(engine)[2]
    [second] = engine.generate(prompts[1:], params)
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in reference]
    common = next(i for i, (a, b) in enumerate(zip(*[r.token_ids for r in reference], strict=False)) if a != b)
    assert common < 4 or spec_counts(engine)[2] - before >= common - 4  # the shared opening was drafted
    engine.shutdown()
    files = list((tmp_path / "spec").iterdir())
    assert len(files) == 1 and files[0].stat().st_mode & 0o077 == 0
    restarted = make_engine(loaded, speculative="suffix")
    keep_outputs(restarted, tmp_path)
    assert restarted.scheduler.drafter.outputs.tokens == drafter.outputs.tokens > 0
    restarted.shutdown()


@pytest.mark.parametrize("ssd", ["write_through", "off"])
def test_a_server_keeps_the_outputs_suffix_drafts_from_only_where_it_keeps_blocks(loaded, tmp_path: Path, ssd: str):
    """The default drafts (``auto``: suffix on a CPU) keep their outputs in the cache dir as the
    SSD tier keeps blocks; with the tier off nothing generated is written there."""
    from kvcellar.runtime import build_engine
    from kvcellar.settings import load_settings

    settings = load_settings(cache_dir=tmp_path, flags={"engine": {"kv_cache_gb": 0.05, "warmup": False},
                                                        "disk": {"ssd_policy": ssd}})
    engine = build_engine(settings, loaded)
    assert engine.scheduler.drafter.mode == "suffix"
    engine.generate([chat(loaded, "Count from one to ten.")], SamplingParams(max_tokens=12, temperature=0.0))
    engine.shutdown()
    kept = list((tmp_path / "spec").glob("*.outputs")) if (tmp_path / "spec").exists() else []
    assert len(kept) == (1 if ssd != "off" else 0)


def _eager(engine: Any, mode: str) -> Eager:
    drafter = Eager(mode, engine.config.speculative_max_tokens, engine.scheduler.drafter.outputs)
    return drafter


def test_recent_outputs_are_kept_per_root_and_a_damaged_file_is_rebuilt(tmp_path: Path):
    path = tmp_path / "spec" / "x.outputs"
    outputs = RecentOutputs(path)
    outputs.add(b"tenant-a", [1, 2, 3, 4, 5, 6])
    drafter = Drafter("suffix", 8, outputs)
    for rows, seconds in ((1, 0.030), (9, 0.031)):
        drafter.observe(rows, seconds)
    assert drafter.candidate(1, [9, 1, 2], 8, b"tenant-a").draft == [3, 4, 5, 6]
    assert drafter.candidate(2, [9, 1, 2], 8, b"tenant-b") is None  # another tenant's outputs never draft
    outputs.close()
    again = RecentOutputs(path)
    assert again.load_error is None and again.get(b"tenant-a").draft([1, 2], 8) == [3, 4, 5, 6]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = RecentOutputs(path)
    assert damaged.load_error is not None and damaged.tokens == 0
    damaged.add(b"tenant-a", [7, 8, 9, 10])
    damaged.close()
    assert RecentOutputs(path).get(b"tenant-a").draft([7, 8], 4) == [9, 10]
    path.write_bytes(path.read_bytes()[:-5])  # cut short
    assert RecentOutputs(path).load_error is not None


@needs_native
@pytest.mark.parametrize("rule", ["kernel", "torch"])
def test_a_hybrid_models_drafts_give_the_plain_decoding_and_its_turns_resume_from_them(rule, monkeypatch):
    """Qwen3.5's linear-attention state is rewound to the last row the model agreed with (drafts
    verified whole, most of them partly rejected), a checkpoint at a block boundary crossed
    inside a verification is the state after that row: greedy tokens and logprobs are the plain
    decoding's, in a batch of more sequences than a step verifies, and the next turn (prompt +
    reply) resumes from the snapshot the speculative generation left, to the uncached bits. With
    kvcellar's recurrence kernel, and with torch's (CUDA's path)."""
    if rule == "torch":
        monkeypatch.setattr(native, "runs_gated_delta", lambda device, value_dim: False)
    loaded = served_file(qwen35_gguf(), "auto")
    assert loaded.weights in ("int4", "int8")
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True)
    cycle = list(range(40, 70))
    prompts = [cycle * 3 + cycle[:7], [5, 6, 7, 8] * 12, list(range(100, 160)), cycle[::-1] * 2,
               [9, 8, 7] * 15, cycle[5:] * 2]
    uncached = uncached_runner(loaded, params, speculative="off")
    engine = speculative(loaded)
    states = engine.scheduler.cache.states
    assert states is not None and states.draft_slots == STEP_HYBRID_VERIFIES
    results = engine.generate(prompts, params)
    for result, ref in zip(results, uncached.many(prompts), strict=True):
        assert_identical_output(result, ref)
    verifies, drafted, accepted = spec_counts(engine)
    assert verifies > 0 and 0 < accepted < drafted
    assert states.drafts_free == states.draft_slots
    turns = [p + r.token_ids + [9, 10, 11] for p, r in zip(prompts, results, strict=True)]
    for result, first, ref in zip(engine.generate(turns, params), prompts, uncached.many(turns), strict=True):
        assert result.num_cached_tokens > len(first)  # resumed past the first prompt
        assert_identical_output(result, ref)
    assert_no_leaks(engine)
    engine.shutdown(10)
