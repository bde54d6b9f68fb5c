"""Warm-up: the requests an engine runs on itself before it serves.

The first run of each code path pays one-off costs (oneDNN/SDPA kernel selection, lazy
imports and caches inside transformers, allocator growth): measured on main, a 10-token
prompt took 0.24 s (bf16) / 0.91 s (fp32) as the first request after a start against tens
of ms later. A restart is exactly when users look at time to first token, so the server
runs these before ``/health`` turns 200 (``Engine.warm_up``).

The plan covers every attention path of ``engine.attention`` (fresh causal prefill, a long
chunk over a cached prefix, a short folded tail, a masked chunk over a short prefix, masked
and unmasked decode, batched decode beside a prefill) and both samplers (greedy; temperature
with top-k/top-p, penalties and logprobs). Its prompts carry their own cache salt, so no
client request can match them, and the engine drops their blocks afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcellar.engine.attention import FOLD_GQA_MAX_QUERIES, SPLIT_MIN_PAST
from kvcellar.engine.sampling import SamplingParams

WARMUP_SALT = "kvcellar-warmup"
# Long enough that a chunk on top of it takes the split path (SPLIT_MIN_PAST).
LONG_PREFIX = SPLIT_MIN_PAST + 64
# A chunk too long to fold (> FOLD_GQA_MAX_QUERIES queries).
UNFOLDED_CHUNK = FOLD_GQA_MAX_QUERIES + 8


@dataclass(frozen=True)
class WarmupRequest:
    prompt: list[int]
    params: SamplingParams


def warmup_waves(filler: list[int], block_size: int, max_tokens_total: int) -> list[list[WarmupRequest]]:
    """Waves of requests, each wave submitted together (so a wave batches its decodes).

    ``filler``: real token ids to build prompts from (any text); ``max_tokens_total``: the
    most tokens one request may hold (context and pool limits). Prompts shrink to fit; the
    split path is skipped when they can't reach ``LONG_PREFIX``."""
    budget = max(block_size + 4, max_tokens_total - 8)
    long = min(LONG_PREFIX, budget - UNFOLDED_CHUNK) // block_size * block_size
    text = (filler * (1 + (long + UNFOLDED_CHUNK + block_size) // max(1, len(filler))))
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    sampled = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=40, seed=0, presence_penalty=0.1,
                             frequency_penalty=0.1, logprobs=True, top_logprobs=5)
    waves: list[list[WarmupRequest]] = [
        # fresh causal prefill, then masked decode
        [WarmupRequest(text[:long] if long > 0 else text[: block_size + 3], greedy)],
        # on top of the cached prefix: a long chunk (split path) and a short tail (folded);
        # their decodes batch
        [WarmupRequest(text[: max(long, block_size)] + text[-UNFOLDED_CHUNK:], sampled),
         WarmupRequest(text[: max(long, block_size)] + text[:5], greedy)],
        # one token short of a block: the first decode fills it exactly (no mask)
        [WarmupRequest(text[1:block_size], SamplingParams(max_tokens=2, temperature=0.0))],
        # a chunk over a short cached prefix (masked, unfolded)
        [WarmupRequest(text[:block_size] + text[-UNFOLDED_CHUNK:], sampled)],
    ]
    return waves
