"""A sequence: one completion being generated, and the events it sends back."""

from __future__ import annotations

import asyncio
import enum
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcellar.cache.block_manager import Block
from kvcellar.cache.hashing import chain_digest
from kvcellar.engine.constraints import TokenConstraint
from kvcellar.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from kvcellar.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvcellar.cache.tiering import PendingLoad


class SeqState(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # blocks are being read from a lower tier
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenEvent:
    """What the engine reports for one sequence after a step.

    ``text`` is the newly releasable text (stop strings and incomplete characters held
    back), possibly empty. A final event has ``finish_reason`` set: ``stop`` (EOS, stop
    token or stop string), ``length``, ``abort`` (cancelled) or ``error``.
    """

    seq_id: int
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    is_eos: bool = False  # token_id ends generation and carries no text
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    stop_string: str | None = None  # the stop string that ended the output (final event)
    # Where the cached prompt tokens came from: {"ram": n, "ssd": n, "remote": n} (final event)
    cached_tokens_by_tier: dict[str, int] | None = None


class EventStream:
    """A sequence's events, produced on the engine thread, consumed sync or async.

    Built with an event loop, events cross into that loop (``call_soon_threadsafe``) and are
    read with ``await get()``; built without, they go to a thread-safe queue read with
    ``get_sync()``. Every stream ends with an event whose ``finish_reason`` is set.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._async_q: asyncio.Queue[TokenEvent] | None = asyncio.Queue() if loop is not None else None
        self._sync_q: queue.SimpleQueue[TokenEvent] | None = queue.SimpleQueue() if loop is None else None

    def put(self, event: TokenEvent) -> None:
        if self._loop is not None:
            assert self._async_q is not None
            try:
                self._loop.call_soon_threadsafe(self._async_q.put_nowait, event)
            except RuntimeError:
                pass  # the consumer's loop is closed: nobody is listening any more
        else:
            assert self._sync_q is not None
            self._sync_q.put(event)

    async def get(self, timeout: float | None = None) -> TokenEvent:
        """The next event; ``asyncio.TimeoutError`` if none arrives within ``timeout``."""
        assert self._async_q is not None, "stream was built without an event loop"
        if not self._async_q.empty():  # an expired timeout would give up without looking
            return self._async_q.get_nowait()
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that lands as the
        # event arrives, and a cancelled stream writer would run on until the generation ends.
        async with asyncio.timeout(timeout):
            return await self._async_q.get()

    def get_nowait(self) -> TokenEvent | None:
        """The next event if one has arrived, else None (asyncio)."""
        assert self._async_q is not None, "stream was built without an event loop"
        return None if self._async_q.empty() else self._async_q.get_nowait()

    def get_sync(self, timeout: float | None = None) -> TokenEvent:
        assert self._sync_q is not None, "stream was built for asyncio"
        return self._sync_q.get(timeout=timeout)


@dataclass
class RequestHandle:
    """What ``Engine.submit`` returns: the sequence's id, its event stream, and a way to cancel it."""

    seq_id: int
    stream: EventStream
    num_prompt_tokens: int
    _cancel: Callable[[int], None] = field(repr=False)

    def cancel(self) -> None:
        self._cancel(self.seq_id)


@dataclass(eq=False)
class Sequence:
    """One completion: its tokens, sampling state, and what it holds of the KV cache.

    The cache counters (written only by ``cache/prefix_cache.py``) keep these invariants,
    with ``bs`` the block size and ``n = num_tokens``:

    * ``blocks`` is the block table: block ``i`` holds the KV of tokens
      ``[i*bs, (i+1)*bs)``. Waiting: empty. Admitted (running or loading):
      ``len(blocks) == ceil(n / bs)`` after each schedule (decode adds one block when a
      token crosses a boundary).
    * ``0 <= num_computed <= n``: tokens whose KV is in the pool. Running sequences are in
      prefill while ``num_computed < n - 1``; a decode computes token ``n - 1``. Never more
      than ``n - 1`` before the forward that samples: the last token is always computed.
    * ``num_registered <= num_computed // bs``: the leading blocks published to the prefix
      cache (reusable by others, never written again). Blocks after them are private.
    * ``num_cached_tokens``: None until the first admission, then the prompt tokens reused
      then (RAM hits plus lower-tier loads), fixed for the rest of the request: a resumption
      after preemption reuses the sequence's own blocks, which is not a cache hit to report.
      ``cached_tokens_by_tier`` splits it by tier and sums to it.
    * While loading (``pending_load`` set), blocks
      ``[num_registered, num_registered + pending_load.plan.num_blocks)`` are being written
      by a lower tier: nothing else reads or frees them until the load is over, even if
      the sequence is cancelled.
    * Released (finished, cancelled, preempted): ``blocks == []``, ``num_computed == 0``,
      ``num_registered == 0``.
    """

    seq_id: int
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    root: bytes  # root of the digest chain (model fingerprint + cache_salt)
    emit: Callable[[TokenEvent], None]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    constraint: TokenConstraint | None = None  # grammar state (structured outputs)
    arrival: float = field(default_factory=time.monotonic)
    tenant: str | None = None  # the API key's name: admission takes tenants in turn
    state: SeqState = SeqState.WAITING
    blocks: list[Block] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    num_registered: int = 0  # leading blocks published to the prefix cache
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission
    # Where the blocks reused at admission came from: "ram", or the lower tier that a
    # prefetch read them from (the blocks a LOADING admission reads come after these).
    hit_tiers: list[str] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # set at first admission
    finish_reason: str | None = None
    pending_load: PendingLoad | None = None  # lower-tier load in flight
    prefetch_checked: bool = False  # looked up for a prefetch during this wait (cache/prefetch.py)
    # Hybrid models, while admitted (cache/state_pool.py): its live recurrent-state slot, and the
    # slot holding the state after its first ``checkpoint_tokens`` tokens (a block boundary; 0: none).
    state_slot: int | None = None
    checkpoint_slot: int | None = None
    checkpoint_tokens: int = 0
    # A chat prompt's tokens before its generation prompt (None: not known): the next turn of the
    # conversation repeats them and may render what follows differently (templates drop a
    # reply's reasoning, or an empty one), so a hybrid model also snapshots its state at the last
    # block boundary within them, in ``history_slot`` (``history_taken``: the step crossed it).
    history_tokens: int | None = None
    history_slot: int | None = None
    history_taken: bool = False
    prefetched: dict[bytes, str] = field(default_factory=dict)  # digest -> tier, blocks prefetched for it
    _digests: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    def digests(self, n: int, block_size: int) -> list[bytes]:
        """Digests of the first ``n`` full blocks (computed once, extended as tokens arrive)."""
        d = self._digests
        while len(d) < n:
            i = len(d)
            parent = d[-1] if d else self.root
            d.append(chain_digest(parent, self.token_ids[i * block_size : (i + 1) * block_size]))
        return d[:n]

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]
