"""The tier interface below the RAM block pool.

A tier stores fixed-size KV blocks under opaque keys. The disk tier
(``storage/disk``) and the shared remote tier (``storage/remote``, Redis/Valkey)
implement it; a datacenter store (Mooncake, LMCache server) would implement the
same verbs. The engine talks to tiers only through this module (via
``cache/tiering.py``, which chains RAM -> [tier, tier, ...]): it never sees
files, sockets or threads. Every tier stores the same verified block bytes
(``storage/block_format.py``).

Contract every implementation keeps:

- ``lookup`` never reads payloads and never raises; it answers how many
  *leading* keys are present.
- ``load`` and ``store`` never raise for I/O faults. A fault is a miss (load)
  or a dropped write (store), counted in ``stats()`` and reported by
  ``health()``. ``ValueError`` is raised only for contract violations by the
  caller (wrong dtype/shape, non-contiguous tensors, wrong number of token ids).
- A block is served only after its identity (``digest`` and ``token_ids``) and
  integrity were verified; a block that fails is deleted and counted.
- ``store`` is called from the engine's step loop and is bounded in time;
  ``wants`` lets the caller skip copying a block off the pool when the store
  would be dropped anyway (a full queue included). When the caller is about to
  drop its own copy (RAM evicts the block, or shuts down), it asks ``wants``
  with a wait: a full queue is then waited on for that long, bounded by the
  tier (``evict_wait_s``), before the block is given up.
- A key ``lookup`` answered present is leased until the following ``load`` has
  resolved (a load-scoped lease: ``load`` pins its keys while it reads), so
  this process's own eviction never removes it in between. ``pin``/``unpin``
  take the same lease explicitly. Other processes (another replica, Redis'
  own eviction) may still remove it: the load then misses, never fails.
- ``close`` is the only shutdown path that guarantees a drained writer.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockSpec:
    """Geometry of every block of one namespace.

    ``shape`` is ``(num_layers, 2, block_size, num_kv_heads, head_dim)``, where
    2 is (K, V). All blocks of one namespace share one spec. Quantized KV
    (``kv_bits`` 8 or 4, groups of ``kv_group_size``; ``cache/kv_pool.py``) is bytes:
    ``dtype`` uint8, ``shape`` ``(num_layers, 2, bytes of one layer's K or V)``.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    block_size: int
    kv_bits: int = 16
    kv_group_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"BlockSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"BlockSpec.block_size must be positive, got {self.block_size}")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ValueError(f"BlockSpec.shape must be non-empty and positive, got {self.shape}")
        if self.kv_bits != 16 and (self.kv_bits not in (4, 8) or not 0 < self.kv_group_size < 4096):
            raise ValueError(f"BlockSpec: kv_bits {self.kv_bits} with group size {self.kv_group_size}")

    @property
    def flags(self) -> int:
        """The block format's ``flags``: 0 for KV in ``dtype``; quantized KV: bits 0-3 the
        KV bits, bits 4-15 the group size."""
        return 0 if self.kv_bits == 16 else self.kv_bits | self.kv_group_size << 4

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def check_tensor(self, t: torch.Tensor, what: str) -> None:
        """Raise ValueError unless ``t`` is a CPU, contiguous tensor of this spec."""
        if t.dtype != self.dtype or tuple(t.shape) != tuple(self.shape):
            raise ValueError(
                f"{what}: expected {self.dtype} {tuple(self.shape)}, got {t.dtype} {tuple(t.shape)}"
            )
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{what}: tensor must be on CPU and contiguous")


@dataclass(frozen=True)
class StoreRequest:
    """One block to persist.

    ``key`` names the block (the file path derives only from ``key.hex()``);
    ``digest`` (the chained prefix digest) and ``token_ids`` are written into
    the block and compared on every load. The tier takes ownership of
    ``data``: the caller must not modify it afterwards.
    """

    key: bytes
    digest: bytes
    token_ids: tuple[int, ...]
    data: torch.Tensor
    # Key of the previous block of the same chain (None for a chain's first block or when
    # unknown): lets a tier evict a chain from its tail, never leaving blocks unreachable.
    parent: bytes | None = None


@dataclass(frozen=True)
class LoadRequest:
    """One block to read into ``dest`` (CPU, contiguous, spec dtype/shape),
    in place, if its stored ``digest`` and ``token_ids`` match these."""

    key: bytes
    digest: bytes
    token_ids: tuple[int, ...]
    dest: torch.Tensor


class KVTier(ABC):
    """A storage tier for KV blocks. See the module docstring for the contract.

    Thread-safety: every method may be called from any thread, concurrently.
    """

    name: str
    # The keys of ``stats()`` that are levels (exported as gauges); the others are counts.
    gauges: frozenset[str] = frozenset()
    # Longest a verb may take on the caller's thread, and a load until its future resolves,
    # before the link (storage/guard.py) counts it as a fault of the tier. A load may also
    # take its bytes at ``load_bytes_per_s`` on top (0: none): a long prefix of a large
    # model (gigabytes) must not be cut at a bound sized for a short one, when computing
    # what was not loaded costs far more than the wait.
    call_timeout_s: float = 5.0
    load_timeout_s: float = 30.0
    load_bytes_per_s: float = 0.0
    # How long ``wants`` may wait for room in a full queue when RAM evicts the block (its
    # last chance to be stored here); 0: not at all. A ``wants`` call may take this on top
    # of ``call_timeout_s``.
    evict_wait_s: float = 0.0

    def load_timeout_for(self, nbytes: int) -> float:
        """How long a load of ``nbytes`` may take until its future resolves."""
        rate = self.load_bytes_per_s
        return self.load_timeout_s + (nbytes / rate if rate > 0 else 0.0)

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present. No payload reads.

        Correct right after a restart, with no warm-up. A present key is a
        promise made in good faith: the following ``load`` verifies the block,
        and a block removed in between (by another process) is a miss.
        """

    @abstractmethod
    def load(self, requests: Sequence[LoadRequest]) -> concurrent.futures.Future[int]:
        """Read blocks into their ``dest`` tensors, asynchronously, in a batch.

        Resolves to the number of leading requests read and verified (header,
        checksum, digest, token ids). The first failure ends the run; dests
        after it may hold anything. The future never carries an exception for
        I/O faults. Reads have priority over queued writes.
        """

    @abstractmethod
    def store(self, requests: Sequence[StoreRequest]) -> None:
        """Persist blocks (write-through). Returns within a bounded time.

        Duplicate keys in flight are written once; keys already stored are not
        rewritten. Blocks that cannot be admitted (queue full past the wait
        budget, fault back-off, no space) are dropped and counted.
        """

    @abstractmethod
    def wants(self, key: bytes, wait_s: float = 0.0) -> bool:
        """Whether a ``store`` of ``key`` now would write it: False when the tier
        already holds it or has it queued, is closing, is backing off after
        faults, or its queue is full (that store is dropped and counted here,
        before the caller copies anything). Cheap, without waiting on I/O,
        except that with ``wait_s`` a full queue is waited on for up to that
        long. The link asks before it copies a block off the pool, for every
        store, and asks again when RAM evicts a write-through block (waiting up
        to ``evict_wait_s``): a store that was dropped (queue full, fault) then
        gets its second chance, and a block already stored costs no copy.
        Advisory: ``store`` may still drop it."""

    def pin(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - optional verb, no-op by default
        """Keep ``keys`` from this process's eviction until ``unpin``. Tiers
        whose eviction this process does not control (a shared Redis) keep the
        no-op: a key evicted there is a miss on load, which is always safe."""

    def unpin(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - optional verb, no-op by default
        """Undo one ``pin`` of each of ``keys``."""

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (absent ones are ignored); returns how many were
        removed. Never raises for I/O faults (they are counted)."""

    def touch(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - optional verb, no-op by default
        """Mark ``keys`` as recently used (for LRU/TTL), e.g. for blocks hot in
        a faster tier that never need to be loaded from this one. Optional."""

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every admitted store has been written or dropped. Optional: tiers
        without a queue are always idle."""
        return True

    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """Counters and gauges, every name prefixed by the owning component."""

    @abstractmethod
    def health(self) -> dict[str, object]:
        """State for ``/health``, built by ``tier_health``: the generic keys
        every tier has, plus one sub-dict named after the tier for the rest."""

    @abstractmethod
    def close(self, timeout: float) -> bool:
        """Stop admitting work, drain pending writes within ``timeout`` seconds,
        record the shutdown. True if everything admitted was written or
        deliberately dropped before the deadline. Idempotent."""


def tier_health(
    name: str,
    *,
    degraded: bool,
    no_space: bool = False,
    last_error: str | None,
    last_error_time: float | None,
    writer_queue_depth: int,
    closed: bool,
    last_shutdown_clean: bool | None,
    detail: dict[str, object],
) -> dict[str, object]:
    """The one shape of ``KVTier.health()``: generic keys that callers may rely on
    for any tier, and ``detail`` under the tier's ``name``.

    ``state`` is "ok", "degraded" (faults in progress; the tier misses and drops
    instead of failing) or "no_space" (no fault, but its limits leave no room to
    store one block: it serves what it holds and stores nothing); a fault wins
    over no_space. ``last_shutdown_clean`` is None for tiers that keep no state
    of their own across restarts."""
    return {
        "state": "degraded" if degraded else "no_space" if no_space else "ok",
        "last_error": last_error,
        "last_error_time": last_error_time,
        "writer_queue_depth": writer_queue_depth,
        "closed": closed,
        "last_shutdown_clean": last_shutdown_clean,
        name: detail,
    }
