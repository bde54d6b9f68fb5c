"""The RAM tier: which pool block holds what, who uses it, and what to evict.

Every block of the pool is in exactly one of three states:

* free: holds nothing reusable (never registered, or its content was dropped);
* in use: ``ref_count > 0``, part of one or more running sequences' block tables;
* evictable: ``ref_count == 0`` but registered in the table, so a later request can reuse
  it; these form an LRU list and are reclaimed, least recently used first, when the free
  list runs dry.

A block is *registered* only once its KV is fully computed (or loaded and verified), under
the key derived from its chained digest (``cache/hashing.py``). A hit requires the stored
digest and token ids to equal the request's: a key collision is a miss, never wrong KV.

Block 0 is reserved as the null block: always zero, used to pad block tables, never
allocated.

Threading: not thread-safe. Only the engine thread calls in.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvcellar.cache.hashing import DIGEST_SIZE
from kvcellar.stats import Stats, counter, gauge

NULL_BLOCK = 0


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    digest: bytes | None = None  # set while registered
    token_ids: tuple[int, ...] | None = None  # set while registered
    # 1 + index of the lower tier this content was loaded from (it is stored back only into
    # faster tiers); 0: computed here.
    loaded_from: int = 0
    parent: bytes | None = None  # digest of the previous block of its chain while registered (None: first)

    @property
    def registered(self) -> bool:
        return self.digest is not None


class OutOfBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than free + evictable (a caller bug)."""


@dataclass
class BlockStats(Stats):
    PREFIX: ClassVar[str] = "kv_"
    lookup_hits: int = counter()
    lookup_misses: int = counter()
    hit_tokens: int = counter()
    evictions: int = counter()
    collisions: int = counter()
    registered: int = counter()


@dataclass
class BlockLevels(Stats):
    PREFIX: ClassVar[str] = "kv_"
    blocks_total: int = gauge()
    blocks_free: int = gauge()
    blocks_cached: int = gauge()  # registered, reusable by prefix
    blocks_evictable: int = gauge()  # of those, referenced by no sequence
    blocks_used: int = gauge()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        key_bytes: int = 32,
        on_evict: Callable[[Block], None] | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("the block pool needs at least 2 blocks (one is the null block)")
        if not 1 <= key_bytes <= DIGEST_SIZE:  # 0 would key every block b"", which no tier can store
            raise ValueError(f"key_bytes must be between 1 and {DIGEST_SIZE}, not {key_bytes}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.key_bytes = key_bytes
        # Called with a registered block just before its content is dropped (evict_only
        # write-back to a lower tier); the block's data is still intact during the call.
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[Block] = deque(self.blocks[1:])
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # first = least recently used
        self._table: dict[bytes, Block] = {}
        self.stats = BlockStats()

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free) - len(self._evictable)

    def available(self, reusing: Sequence[Block] = ()) -> int:
        """Blocks ``allocate`` could hand out if the blocks in ``reusing`` were acquired first."""
        taken = sum(1 for b in reusing if b.ref_count == 0)
        return len(self._free) + len(self._evictable) - taken

    def free_front(self, n: int) -> list[Block]:
        """The free blocks ``allocate`` hands out next (``n`` at most), in that order."""
        return list(itertools.islice(self._free, n))

    # ---- lookup ---------------------------------------------------------------------------

    def key(self, digest: bytes) -> bytes:
        return digest[: self.key_bytes]

    def match(self, digests: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[Block]:
        """The longest run of leading blocks cached here; takes no references."""
        out: list[Block] = []
        for digest, tokens in zip(digests, token_blocks, strict=False):
            block = self._table.get(self.key(digest))
            if block is None:
                break
            if block.digest != digest or block.token_ids != tuple(tokens):
                self.stats.collisions += 1
                break
            out.append(block)
        return out

    def record_lookup(self, hit_tokens: int, total_blocks: int) -> None:
        """A request reused ``hit_tokens`` prompt tokens from RAM (its blocks, the last maybe in
        part: a whole prompt's last token is computed again) of ``total_blocks`` full blocks."""
        hit_blocks = -(-hit_tokens // self.block_size)
        self.stats.lookup_hits += hit_blocks
        self.stats.lookup_misses += total_blocks - hit_blocks
        self.stats.hit_tokens += hit_tokens

    # ---- ownership ------------------------------------------------------------------------

    def acquire(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block]:
        """``n`` empty blocks with ``ref_count == 1``, evicting LRU cached blocks as needed."""
        if n > self.available():
            raise OutOfBlocksError(f"asked for {n} blocks, {self.available()} available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                _, block = self._evictable.popitem(last=False)
                self._drop(block)
                self.stats.evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block. Walks the list backwards so that, among
        blocks freed together, a sequence's tail is evicted before its head."""
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} released more often than acquired")
            if block.ref_count == 0:
                if block.registered:
                    self._evictable[block.block_id] = block
                else:  # taken again first: its memory is warm (a fresh block's first touch faults its pages in)
                    block.loaded_from = 0
                    self._free.appendleft(block)

    def register(self, block: Block, digest: bytes, token_ids: Sequence[int], parent: bytes | None = None) -> bool:
        """Publish a computed block for reuse. Returns False when another block already
        holds this key (same content computed twice, or a key collision): this one then
        stays private and returns to the free list when released. ``parent``: the digest
        of the block before it in its chain (lower tiers evict chains from the tail)."""
        if block.registered:
            return block.digest == digest
        key = self.key(digest)
        if key in self._table:
            if self._table[key].digest != digest:
                self.stats.collisions += 1
            return False
        block.digest = digest
        block.token_ids = tuple(token_ids)
        block.parent = parent
        self._table[key] = block
        self.stats.registered += 1
        return True

    def cached_blocks(self) -> list[Block]:
        """Every registered block (used at shutdown to hand unsaved ones to a lower tier)."""
        return list(self._table.values())

    def evict_all(self) -> int:
        """Drop every unreferenced cached block (tests; ``cache clear`` of the RAM tier)."""
        n = 0
        while self._evictable:
            _, block = self._evictable.popitem(last=False)
            self._drop(block)
            self._free.append(block)
            n += 1
        self.stats.evictions += n
        return n

    def _drop(self, block: Block) -> None:
        if self.on_evict is not None:
            self.on_evict(block)
        assert block.digest is not None
        del self._table[self.key(block.digest)]
        block.digest = None
        block.token_ids = None
        block.parent = None
        block.loaded_from = 0

    # ---- reporting ------------------------------------------------------------------------

    def levels(self) -> BlockLevels:
        return BlockLevels(blocks_total=self.num_blocks - 1, blocks_free=self.num_free, blocks_cached=len(self._table),
                           blocks_evictable=self.num_evictable, blocks_used=self.num_used)

    def snapshot(self) -> dict[str, float]:
        return {**self.stats.as_dict(), **self.levels().as_dict()}
