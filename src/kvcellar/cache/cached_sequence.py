"""What the prefix cache reads and writes of a sequence.

``engine.sequence.Sequence`` is the one implementation (its docstring states the invariants
of these counters); naming the part the cache uses here keeps this package free of engine
imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvcellar.cache.block_manager import Block

if TYPE_CHECKING:
    from kvcellar.cache.tiering import PendingLoad


class CachedSequence(Protocol):
    blocks: list[Block]
    num_computed: int
    num_registered: int
    num_cached_tokens: int | None
    hit_tiers: list[str]
    cached_tokens_by_tier: dict[str, int]
    pending_load: PendingLoad | None
    prefetch_checked: bool
    prefetched: dict[bytes, str]
    state_slot: int | None
    checkpoint_slot: int | None
    checkpoint_tokens: int
    history_tokens: int | None
    history_slot: int | None
    history_taken: bool
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int: ...

    def digests(self, n: int, block_size: int) -> list[bytes]: ...

    def block_tokens(self, i: int, block_size: int) -> list[int]: ...
