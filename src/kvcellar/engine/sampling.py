"""Sampling parameters and the per-step sampler.

Logprobs are those of the model's raw next-token distribution (log-softmax of the logits,
before penalties and temperature), as OpenAI reports them. Penalties follow OpenAI's
definition over the tokens generated so far:
``logit -= presence_penalty * [count > 0] + frequency_penalty * count``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcellar.engine.native.logits import argmax_rows, topk_row

if TYPE_CHECKING:
    from kvcellar.engine.constraints import Grammar, TokenConstraint

MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5  # lower temperatures sample greedily


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    # Text options (applied by the detokenizer)
    skip_special_tokens: bool = True
    # Output must match this grammar (structured outputs, forced tool calls); each sequence
    # gets its own matcher state from it.
    grammar: Grammar | None = None

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for impossible values."""
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        # Below MIN_TEMPERATURE sampling is greedy in effect, and dividing float32 logits by
        # it would overflow to inf (a 5e-324 temperature from a fuzzer gave NaN probabilities).
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        return gen


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


def apply_penalties(logits: torch.Tensor, output_ids: list[int], params: SamplingParams) -> torch.Tensor:
    if not output_ids or (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0):
        return logits
    ids = torch.tensor(output_ids, device=logits.device)
    counts = torch.zeros_like(logits).scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
    return logits - params.presence_penalty * (counts > 0).to(logits.dtype) - params.frequency_penalty * counts


def plain_greedy(params: SamplingParams, constraint: TokenConstraint | None) -> bool:
    """Whether the next token is the argmax of the raw logits and nothing else is asked of
    them (no grammar, no penalty, no logprobs): ``greedy_tokens`` picks those a batch at once."""
    return (params.greedy and constraint is None and not params.logprobs
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)


def greedy_tokens(logits: torch.Tensor, plain: list[bool]) -> list[int | None]:
    """Per row of ``logits`` ``[rows, vocab]``: its argmax where ``plain`` says so (one call,
    so one device sync on an accelerator instead of one per row), else None."""
    rows = [i for i, p in enumerate(plain) if p]
    out: list[int | None] = [None] * len(plain)
    if rows:
        with _one_thread(logits):
            picked = logits if len(rows) == len(plain) else logits[rows]
            found = argmax_rows(picked)
        for i, token in zip(rows, found, strict=True):
            out[i] = int(token)
    return out


def sample_row(
    logits: torch.Tensor, params: SamplingParams, output_ids: list[int], generator: torch.Generator | None,
    constraint: TokenConstraint | None = None,
) -> SampleResult:
    """Pick the next token from one row of float32 logits ``[vocab]``. With a
    ``constraint``, tokens its grammar forbids are never picked, and near ``max_tokens``
    neither are tokens after which it could not end in time (logprobs stay those of the
    model's own distribution). On a CPU its operations run on the calling thread: each over a
    vocabulary would wake torch's sleeping threads for a few microseconds of work."""
    with _one_thread(logits):
        return _sample_row(logits, params, output_ids, generator, constraint)


@contextlib.contextmanager
def _one_thread(x: torch.Tensor) -> Iterator[None]:
    before = torch.get_num_threads()
    if x.is_cuda or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index of ``weights`` (1-D, >= 0, not all 0) drawn in proportion to them: one uniform
    draw of ``generator`` against their running sum (float64), never an index of weight 0.
    ``torch.multinomial`` took ~1 ms over a vocabulary."""
    cdf = torch.cumsum(weights.double(), 0)
    total = float(cdf[-1]) if cdf.numel() else 0.0
    if not 0.0 < total < float("inf"):
        raise ValueError(f"no token can be sampled: the probabilities sum to {total}")
    u = torch.rand((), generator=generator, device=weights.device, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, u * total, right=True))
    if index >= weights.numel():  # u * total rounded up to the total: the last weight that is not 0
        index = int(torch.nonzero(weights).max())
    return index


# Tokens the nucleus is first looked for among (then four times as many, until it is found).
NUCLEUS_FIRST = 64
# The largest top-k the kernels' one-pass selection takes (a heap of k: past a few hundred,
# torch's is as fast).
TOPK_ROW_MOST = 256


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` greatest of ``x``, greatest first: the kernels' one pass up to ``TOPK_ROW_MOST``."""
    if k <= TOPK_ROW_MOST:
        return topk_row(x, k)
    found: tuple[torch.Tensor, torch.Tensor] = torch.topk(x, k)
    return found


def _nucleus(probs: torch.Tensor, top_p: float, generator: torch.Generator | None) -> int:
    """A token of the smallest set of likeliest tokens whose probability reaches ``top_p`` (the
    likeliest always in it), drawn in proportion to ``probs``: from the likeliest ``k`` tokens
    (``_topk``) while they hold the whole set, not a sort of the vocabulary (~2.6 ms)."""
    k, vocab = NUCLEUS_FIRST, probs.numel()
    while True:
        values, ids = _topk(probs, min(k, vocab))
        cumulative = torch.cumsum(values, 0)
        keep = int((cumulative - values < top_p).sum())  # a prefix: the sum before each token grows
        if keep < values.numel() or k >= vocab:
            break
        k *= 4
    return int(ids[_draw(values[:keep], generator)])


def _sample_row(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                generator: torch.Generator | None, constraint: TokenConstraint | None) -> SampleResult:
    raw = logits
    if constraint is not None:
        logits = constraint.mask(logits)
    logits = apply_penalties(logits, output_ids, params)
    if params.greedy:
        token = argmax_rows(logits.reshape(1, -1))[0]
    else:
        logits = logits / params.temperature
        if params.top_k > 0 and params.top_k < logits.numel():
            kth = _topk(logits, params.top_k)[0][-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        token = _nucleus(probs, params.top_p, generator) if params.top_p < 1.0 else _draw(probs, generator)
    if constraint is not None:  # near max_tokens: a token after which the output can still end
        token = constraint.choose(token, logits)
    if not params.logprobs:
        return SampleResult(token, None, None)
    logp = torch.log_softmax(raw, dim=-1)
    top = None
    if params.top_logprobs > 0:
        values, ids = _topk(logp, params.top_logprobs)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return SampleResult(token, float(logp[token]), top)
