"""The link between the RAM tier and a tier below it (the SSD today, a remote store later).

The scheduler and block manager talk to ``LowerTierLink`` in their own vocabulary
(digests, pool blocks); it speaks ``storage.base.KVTier`` (keys, tensors) to the tier. It
never sees requests; the tier never sees blocks of the pool.

Writes:
* ``write_through``: every block registered in RAM (computed from a prompt or from
  generated tokens) is copied out and stored; copies are batched per engine step.
* ``evict_only``: a block is stored when the RAM tier drops it.
A write the tier dropped (queue full, fault) is not lost while the block is in RAM: when
the RAM tier evicts it, or at shutdown, the link offers it again if the tier ``wants`` it.
Blocks that came from the tier are never stored back.

Reads: ``lookup`` says how many of the next blocks to try; ``start_load`` reads them
straight into the pool blocks the scheduler reserved (a staging copy on accelerators) while
the engine keeps stepping other sequences; ``finish_load`` polls. A block counts only once
the tier has verified its digest, token ids and checksum.

Threading: every method is called from the engine thread, except the wake-up callback
the tier's future runs on its own thread.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvcellar.cache.block_manager import Block
from kvcellar.engine.kv_pool import KVPool
from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest

POLICIES = ("write_through", "evict_only")


@dataclass
class PendingLoad:
    blocks: list[Block]
    digests: list[bytes]
    token_blocks: list[tuple[int, ...]]
    future: concurrent.futures.Future[int]
    staging: list[torch.Tensor] = field(default_factory=list)  # CPU buffers when the pool is not on CPU


class LowerTierLink:
    def __init__(
        self,
        tier: KVTier,
        pool: KVPool,
        key_of: Callable[[bytes], bytes],
        *,
        policy: str = "write_through",
        wake: Callable[[], None] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown tier policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.tier = tier
        self.pool = pool
        self.key_of = key_of
        self.policy = policy
        self._wake = wake
        self._on_cpu = pool.device.type == "cpu"
        self._batch: list[StoreRequest] = []
        # Counters carry the tier's name (ssd_link_*), so they are reported with that tier.
        self._p = f"{tier.name}_link_"
        self.stats = {self._p + k: 0 for k in
                      ("lookups", "queried_blocks", "lookup_blocks", "loaded_blocks", "load_failed_blocks",
                       "stored_blocks")}

    @staticmethod
    def block_spec(pool: KVPool) -> BlockSpec:
        layout = pool.layout
        return BlockSpec(dtype=layout.dtype, shape=layout.block_shape, block_size=layout.block_size)

    # ---- reads ----------------------------------------------------------------------------

    def lookup(self, digests: Sequence[bytes]) -> int:
        """How many of the leading ``digests`` to try loading: all of them if the tier holds
        the first, else none. Only the first is checked here (one stat on the engine
        thread): the load itself opens the rest in parallel and reports the verified run,
        where checking them one by one first would cost a serial stat chain, slow on a
        cold directory cache, before any byte is read."""
        if not digests:
            return 0
        self.stats[self._p + "lookups"] += 1
        self.stats[self._p + "queried_blocks"] += len(digests)
        if self.tier.lookup([self.key_of(digests[0])]) == 0:
            return 0
        self.stats[self._p + "lookup_blocks"] += len(digests)
        return len(digests)

    def start_load(self, blocks: list[Block], digests: list[bytes], token_blocks: list[tuple[int, ...]]) -> PendingLoad:
        staging: list[torch.Tensor] = []
        requests = []
        for block, digest, tokens in zip(blocks, digests, token_blocks, strict=True):
            if self._on_cpu:
                dest = self.pool.block(block.block_id)
            else:
                dest = torch.empty(self.pool.layout.block_shape, dtype=self.pool.layout.dtype, pin_memory=True)
                staging.append(dest)
            requests.append(LoadRequest(self.key_of(digest), digest, tokens, dest))
        future = self.tier.load(requests)
        if self._wake is not None:
            future.add_done_callback(lambda _f: self._wake())  # type: ignore[misc]
        return PendingLoad(blocks, digests, token_blocks, future, staging)

    def finish_load(self, pending: PendingLoad) -> int | None:
        """Number of leading blocks now valid in the pool, or None while still reading."""
        if not pending.future.done():
            return None
        try:
            n = int(pending.future.result())
        except Exception:  # the contract says this does not happen; a miss is the safe answer
            n = 0
        for i in range(n):
            block = pending.blocks[i]
            if not self._on_cpu:
                self.pool.block(block.block_id).copy_(pending.staging[i], non_blocking=True)
            block.from_lower_tier = True
        self.stats[self._p + "loaded_blocks"] += n
        self.stats[self._p + "load_failed_blocks"] += len(pending.blocks) - n
        return n

    def touch(self, digests: Sequence[bytes]) -> None:
        """RAM hits: keep the tier's copies recently used, so hot blocks do not age out there."""
        if digests and self.policy == "write_through":
            self.tier.touch([self.key_of(d) for d in digests])

    # ---- writes ---------------------------------------------------------------------------

    def published(self, block: Block) -> None:
        """A block was registered in RAM (called by the scheduler after it is computed)."""
        if self.policy == "write_through" and not block.from_lower_tier:
            self._batch.append(self._store_request(block))

    def evicted(self, block: Block) -> None:
        """The RAM tier is about to reuse ``block`` (its data is still intact)."""
        if block.from_lower_tier or block.digest is None:
            return
        if self.policy == "evict_only" or self.tier.wants(self.key_of(block.digest)):
            self.stats[self._p + "stored_blocks"] += 1
            self.tier.store([self._store_request(block)])

    def flush(self) -> None:
        """Hand this step's write-through copies to the tier (bounded time)."""
        if self._batch:
            batch, self._batch = self._batch, []
            self.stats[self._p + "stored_blocks"] += len(batch)
            self.tier.store(batch)

    def _store_request(self, block: Block) -> StoreRequest:
        assert block.digest is not None and block.token_ids is not None
        data = self.pool.block(block.block_id)
        data = data.clone() if self._on_cpu else data.to("cpu")
        parent = self.key_of(block.parent) if block.parent is not None else None
        return StoreRequest(self.key_of(block.digest), block.digest, block.token_ids, data, parent)

    # ---- reporting and shutdown -------------------------------------------------------------

    def snapshot(self) -> dict[str, float]:
        return {**self.stats, **self.tier.stats()}

    def close(self, timeout: float, cached: Iterable[Block] = ()) -> bool:
        """Flush, offer the ``cached`` RAM blocks whose write-through store was dropped
        (no step waits on the tier any more, so wait for its queue to drain if it is full),
        then close the tier, all within ``timeout``."""
        deadline = time.monotonic() + timeout
        self.flush()
        if self.policy == "write_through":
            for block in cached:
                if block.from_lower_tier or block.digest is None:
                    continue
                key = self.key_of(block.digest)
                if not self.tier.wants(key):
                    continue
                request = self._store_request(block)
                self.stats[self._p + "stored_blocks"] += 1
                self.tier.store([request])
                if self.tier.wants(key) and self.tier.wait_idle(max(0.0, deadline - time.monotonic())):
                    self.tier.store([request])
        return self.tier.close(max(0.0, deadline - time.monotonic()))
