"""Warm-up: the requests an engine runs on itself before it serves.

The first run of each code path pays one-off costs (oneDNN/SDPA kernel selection, lazy
imports and caches inside transformers, allocator growth): measured on main, a 10-token
prompt took 0.24 s (bf16) / 0.91 s (fp32) as the first request after a start against tens
of ms later. A restart is exactly when users look at time to first token, so the server
runs these before ``/health`` turns 200 (``warm_up``).

The plan covers every attention path of ``engine.attention`` (SDPA's: fresh causal prefill,
a long chunk over a cached prefix, a short folded tail, a masked chunk over a short prefix,
masked and unmasked decode, batched decode beside a prefill; with kvcellar's CPU kernels the
prefills are one path, the decodes two) and both samplers (greedy; temperature
with top-k/top-p, penalties and logprobs). Its prompts carry their own cache salt, so no
client request can match them, and the engine drops their blocks afterwards.

What a path saves its first request is milliseconds, so the plan has a time budget: the
cheapest wave runs first and measures what a token costs, and a later wave (or the decode
thread measurement) whose estimate would take the warm-up past the budget is left out and
logged. The embedded model runs everything well within it; a 7B model on two CPU cores
would spend minutes on the long-prefix waves alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcellar.engine.attention import FOLD_GQA_MAX_QUERIES, SPLIT_MIN_PAST, attention_paths
from kvcellar.engine.linears import release_scratch
from kvcellar.engine.sampling import SamplingParams
from kvcellar.engine.tokenization import encode_chat, shared_prefix_len
from kvcellar.stats import Stats

if TYPE_CHECKING:
    from kvcellar.engine.engine import Engine
    from kvcellar.engine.loader import MachineFigures

log = logging.getLogger(__name__)

WARMUP_SALT = "kvcellar-warmup"
# Long enough that a chunk on top of it takes the split path (SPLIT_MIN_PAST).
LONG_PREFIX = SPLIT_MIN_PAST + 64
# A chunk too long to fold (> FOLD_GQA_MAX_QUERIES queries), and a short tail.
UNFOLDED_CHUNK = FOLD_GQA_MAX_QUERIES + 8
TAIL = 5
# Seconds the waves and the decode thread measurement may take together (see above).
BUDGET_S = 20.0
# Timed steps per thread count when measuring decode threads; with a step after each of the
# four switches (ModelRunner.calibrate_decode_threads), 4 * (1 + this) decode steps.
THREAD_STEPS = 4


@dataclass(frozen=True)
class WarmupRequest:
    prompt: list[int]
    params: SamplingParams


def warmup_waves(filler: list[int], block_size: int, max_tokens_total: int,
                 split: bool = True) -> list[list[WarmupRequest]]:
    """Waves of requests, each wave submitted together (so a wave batches its decodes).

    ``filler``: real token ids to build prompts from (any text); ``max_tokens_total``: the
    most tokens one request may hold (context and pool limits). Prompts shrink to fit; the
    split path is skipped when they can't reach ``LONG_PREFIX``. Where the engine has no
    split path (``split`` False: kvcellar's attention kernel takes every prefill, one path
    whatever the chunk) the cached prefix is two blocks, not ``LONG_PREFIX`` tokens, the
    chunks over it are short and there is no fourth wave: a 7B on two cores spends ~2 s on
    these where SDPA's waves took ~10, and a first request after them ran as fast as later
    ones (docs/performance.md)."""
    budget = max(block_size + 4, max_tokens_total - 8)
    chunk = UNFOLDED_CHUNK if split else TAIL
    long = min(LONG_PREFIX if split else 2 * block_size, budget - chunk) // block_size * block_size
    text = (filler * (1 + (long + UNFOLDED_CHUNK + block_size) // max(1, len(filler))))
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    sampled = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=40, seed=0, presence_penalty=0.1,
                             frequency_penalty=0.1, logprobs=True, top_logprobs=5)
    waves: list[list[WarmupRequest]] = [
        # the cheapest first: what it costs prices the others. One token short of a block:
        # the first decode fills it exactly (no mask)
        [WarmupRequest(text[1:block_size], SamplingParams(max_tokens=2, temperature=0.0))],
        # fresh causal prefill, then masked decode
        [WarmupRequest(text[:long] if long > 0 else text[: block_size + 3], greedy)],
        # on top of the cached prefix: a long chunk (split path, where there is one) and a short
        # tail (folded); their decodes batch
        [WarmupRequest(text[: max(long, block_size)] + text[-chunk:], sampled),
         WarmupRequest(text[: max(long, block_size)] + text[:TAIL], greedy)],
    ]
    if split:  # a chunk over a short cached prefix (masked, unfolded)
        waves.append([WarmupRequest(text[:block_size] + text[-UNFOLDED_CHUNK:], sampled)])
    return waves


class _Budget:
    """The time left to the waves, priced by what the tokens run so far cost."""

    def __init__(self, seconds: float, block_size: int) -> None:
        self.seconds = seconds
        self.block_size = block_size
        self.spent = 0.0
        self.tokens = 0
        self.prompts: list[list[int]] = []  # run so far: their whole blocks are cached

    def tokens_of(self, requests: list[WarmupRequest]) -> int:
        """Tokens a wave computes: its prompts but their cached prefix, and its outputs."""
        total = 0
        for r in requests:
            cached = max((shared_prefix_len(r.prompt, p) for p in self.prompts), default=0)
            total += len(r.prompt) - cached // self.block_size * self.block_size + r.params.max_tokens
        return total

    def allows(self, tokens: int) -> bool:
        return not self.tokens or self.spent + tokens * self.spent / self.tokens <= self.seconds

    def charge(self, seconds: float, tokens: int, prompts: list[list[int]]) -> None:
        self.spent += seconds
        self.tokens += tokens
        self.prompts += prompts


def warm_up(engine: Engine, budget_s: float = BUDGET_S, figures: MachineFigures | None = None) -> float:
    """Run every code path a first request needs on ``engine`` (idle, not started), so the
    first request after a start is not the one paying one-off costs, within ``budget_s``
    (see the module's docstring). ``figures``: where the decode threads measured on a quiet
    machine are kept for the model, and read back by later starts instead of measuring.
    Leaves no trace: its blocks are dropped, nothing reaches a lower tier, counters are
    restored (but ``engine_warmup_*``). Returns the seconds it took."""
    if engine.threaded or engine.num_active():
        raise RuntimeError("warm up an idle engine before starting it")
    t0 = time.perf_counter()
    cache = engine.scheduler.cache
    counters: tuple[Stats, ...] = (engine.stats, engine.scheduler.stats, cache.stats, cache.prefetch.stats,
                                   engine.blocks.stats, *((cache.states.stats,) if cache.states is not None else ()))
    saved = [c.copy() for c in counters]
    steps = skipped = 0
    with engine.lower.suspended():  # until its blocks are dropped too
        try:
            # llguidance's view of the tokenizer, which the first constrained request would
            # otherwise build (without warm-up it does)
            engine.grammars.prepare()
            # a chat prompt: rendering it compiles the chat template, slow the first time
            filler = encode_chat(engine.tokenizer,
                                 [{"role": "user", "content": "kvcellar warms up every path. " * 8}])
            limit = min(engine.max_model_len, engine.pool_tokens // 4)
            budget = _Budget(budget_s, engine.block_size)
            pool = engine.pool
            split = "prefill_split" in attention_paths(pool.device, pool.attends)
            for i, wave in enumerate(warmup_waves(filler, engine.block_size, limit, split)):
                tokens = budget.tokens_of(wave)
                if not budget.allows(tokens):
                    skipped += 1
                    log.info("warm-up: wave %d left out (%d tokens, over the %.0f s budget)", i, tokens, budget_s)
                    continue
                before, start = engine.stats.steps, time.perf_counter()
                engine.generate([r.prompt for r in wave], [r.params for r in wave], cache_salt=WARMUP_SALT)
                budget.charge(time.perf_counter() - start, tokens, [r.prompt for r in wave])
                steps += int(engine.stats.steps - before)
            runner = engine.runner
            if engine.config.decode_threads == 0 and runner.threads > 1:  # else no choice to make
                name = f"decode_threads|{engine.fingerprint}|{runner.threads}"
                kept = figures.get(name) if figures is not None else None
                # two blocks the waves cached: the measurement's decode steps, not a prefill
                prompt = filler[: max(1, min(len(filler), 2 * engine.block_size, engine.pool_tokens // 8))]
                if isinstance(kept, int) and 1 <= kept <= runner.threads:
                    runner.set_decode_threads(kept)
                    log.info("decode steps use %d of %d torch threads (measured by an earlier start)", kept,
                             runner.threads)
                elif budget.allows(len(prompt) + 4 * (1 + THREAD_STEPS)):
                    steps += _calibrate_decode_threads(engine, prompt)
                    if figures is not None and runner.measured_quiet:
                        figures.put(name, runner.decode_threads)
                else:
                    skipped += 1
                    log.info("warm-up: decode threads not measured (over the %.0f s budget): using all %d",
                             budget_s, runner.threads)
        finally:
            release_scratch()  # warm-up runs on the caller's thread; serving steps on the engine's
            engine.blocks.evict_all()
            if cache.states is not None:  # a hybrid's snapshots too, while no tier would take them
                cache.states.evict_all()
            for live, old in zip(counters, saved, strict=True):
                live.restore(old)
    engine.runner.stats.cold_paths = 0
    seconds = time.perf_counter() - t0
    engine.stats.warmup_steps = steps
    engine.stats.warmup_seconds = seconds
    engine.stats.warmup_left_out = skipped
    return seconds


def _calibrate_decode_threads(engine: Engine, prompt: list[int]) -> int:
    """Time batch-1 decode steps on one thread and on all (``ModelRunner``) after ``prompt``;
    returns the steps it ran. Drafting is suspended meanwhile: a step that verifies a draft (the
    prompt repeats itself) costs what its rows cost, not a decode's. A measurement whose steps
    did not each decode one token (one failed) is set aside: all threads, nothing kept."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    scheduler, runner, stats = engine.scheduler, engine.runner, engine.stats
    drafter, scheduler.drafter = scheduler.drafter, None
    try:
        handle = engine.submit(prompt, params, cache_salt=WARMUP_SALT)
        engine.step()
        while engine.in_prefill(handle.seq_id):  # prefill, then it decodes
            engine.step()
        steps, tokens, failures = stats.steps, stats.generated_tokens, stats.step_failures
        chosen = runner.calibrate_decode_threads(engine.step, THREAD_STEPS)
        ran = int(stats.steps - steps)
        if (stats.step_failures != failures or stats.generated_tokens - tokens != ran
                or engine.prompt_progress(handle.seq_id) is None):
            log.warning("decode threads: the measurement's steps did not each decode a token; all %d threads kept",
                        runner.threads)
            runner.set_decode_threads(runner.threads)
            runner.measured_quiet = False
            chosen = runner.threads
        engine.cancel(handle.seq_id)
        engine.run_until_idle()
    finally:
        scheduler.drafter = drafter
    log.info("decode steps use %d of %d torch threads (measured)", chosen, runner.threads)
    return ran
