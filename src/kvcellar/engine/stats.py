"""The engine's counters, in a module of their own: the bench and the metrics read them
without importing the engine (and with it transformers)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvcellar.stats import Stats, counter, gauge


@dataclasses.dataclass
class EngineStats(Stats):
    PREFIX: ClassVar[str] = "engine_"
    requests_total: int = counter()
    requests_finished: int = counter()
    requests_aborted: int = counter()
    requests_failed: int = counter()
    prompt_tokens: int = counter()
    cached_prompt_tokens: int = counter()
    computed_tokens: int = counter()
    generated_tokens: int = counter()
    steps: int = counter()
    step_seconds: float = counter(0.0)
    warmup_steps: int = counter()  # steps ``warm_up`` ran before serving
    warmup_seconds: float = counter(0.0)
    warmup_left_out: int = counter()  # warm-up waves (or the decode thread measurement) its time budget left out
    step_failures: int = counter()  # steps an exception ended (their sequences failed)
    step_failures_in_a_row: int = gauge()
    # The KV setting and what it costs (cache/kv_pool.py); group size 0 at 16 bits.
    kv_bits: int = gauge()
    kv_group_size: int = gauge()
    kv_bytes_per_token: int = gauge()
    kv_pool_tokens: int = gauge()
    # Speculative decoding (engine/speculation.py): steps that verified a sequence's draft, the
    # tokens drafted, and those the model agreed with (each also counts in generated_tokens).
    spec_verifies: int = counter()
    spec_drafted_tokens: int = counter()
    spec_accepted_tokens: int = counter()
