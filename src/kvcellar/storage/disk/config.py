"""Knobs of the disk tier: ``DiskSettings`` as users set them (flags, ``[disk]`` in
the TOML file, ``KVCELLAR_SSD_*``), ``DiskTierConfig`` as the tier takes them; defaults are the
production ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GIB = 1 << 30

Durability = Literal["best_effort", "persistent"]


@dataclass(frozen=True)
class DiskTierConfig:
    # best_effort: one attempt, no fsync (a crash may lose recent blocks, never
    # serve a torn one: the checksum catches it). persistent: fsync the file
    # and its directory before the block counts as stored; bounded retries.
    durability: Durability = "best_effort"
    persistent_retries: int = 3
    # False: store() writes in the caller's thread (tests, tools, debugging).
    async_writes: bool = True
    # Writer queue bound, in blocks (each holds its tensor until written:
    # 256 x 368 KiB = 92 MiB for the default model at block size 16).
    queue_blocks: int = 256
    # Total time one store() call may wait for queue space before dropping the
    # rest of its blocks. Waiting only buys what the writer frees meanwhile
    # (~1 block per ms here): benchmarks/bench_disk_io.py, section "tier".
    enqueue_timeout_s: float = 0.001
    # How long the writer defers a write while reads are in flight (reads first).
    write_defer_max_s: float = 0.05
    # There is no index to flush; last-access times (file atimes, for LRU and
    # TTL across restarts) are written back in batches at this interval and
    # at close, keeping utime() off the read path.
    flush_interval_s: float = 1.0
    capacity_bytes: int = 20 * GIB
    # Free space always left on the filesystem. None: min(1 GiB, 5 % of the
    # filesystem's size), so a small cache filesystem is not switched off by a
    # floor larger than itself. An explicit value is kept as given;
    # if it leaves no room, start-up warns and health says "no_space".
    min_free_bytes: int | None = None
    ttl_s: float = 7 * 24 * 3600.0
    # TTL pruning and the rescan that adopts other processes' files run on
    # this timer, independent of writes.
    prune_interval_s: float = 600.0
    # Reader threads; several requests in flight are what per-block files need
    # to approach the device's bandwidth (4-8 measured best here).
    io_threads: int = 8
    # After lookup() reports a key present, this process will not evict it for
    # this long (or until it is loaded), so lookup -> load does not race eviction.
    lookup_lease_s: float = 10.0
    # Fault back-off: writes are dropped while backing off; it doubles per failed real
    # write up to the cap. Probes (a 4 KiB write) run every probe_interval_s during an
    # episode whatever the back-off, and a successful one ends it: recovery after the
    # fault clears takes at most about one probe interval (failed probes do not double
    # the back-off).
    fault_backoff_initial_s: float = 1.0
    fault_backoff_max_s: float = 2.0
    probe_interval_s: float = 1.0
    # If close() was never called, how long the writer keeps draining after the
    # main thread has exited before giving up (the process then exits).
    exit_drain_s: float = 5.0

    def __post_init__(self) -> None:
        if self.durability not in ("best_effort", "persistent"):
            raise ValueError(f"durability must be best_effort or persistent, got {self.durability!r}")
        if self.queue_blocks < 1 or self.io_threads < 1:
            raise ValueError("queue_blocks and io_threads must be >= 1")
        if self.persistent_retries < 0:
            raise ValueError(f"persistent_retries must be >= 0, got {self.persistent_retries}")
        for name in ("enqueue_timeout_s", "write_defer_max_s", "flush_interval_s", "prune_interval_s",
                     "lookup_lease_s",
                     "fault_backoff_initial_s", "fault_backoff_max_s", "probe_interval_s", "exit_drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.capacity_bytes < 0 or (self.min_free_bytes or 0) < 0 or self.ttl_s <= 0:
            raise ValueError("capacity_bytes and min_free_bytes must be >= 0, ttl_s > 0")


SSD_POLICIES = ("write_through", "evict_only", "off")


@dataclass
class DiskSettings:
    """The ``[disk]`` section. Environment: ``KVCELLAR_SSD_POLICY=evict_only``."""

    # write_through: every new full block goes to disk; evict_only: blocks go to disk when
    # the RAM tier drops them; off: RAM only.
    ssd_policy: str = "write_through"
    # best_effort: one try, no fsync; persistent: fsync before a block counts, bounded retries.
    ssd_durability: str = "best_effort"
    # With persistent durability: how often a failed write is tried again before the block is dropped.
    ssd_persistent_retries: int = 3
    ssd_async: bool = True
    ssd_queue_blocks: int = 256
    ssd_flush_interval_s: float = 1.0
    disk_cache_gb: float = 20.0
    # Free space the tier always leaves on the filesystem. None (default): min(1 GiB, 5 % of
    # the filesystem), so a small cache filesystem still gets a cache.
    disk_min_free_gb: float | None = None
    ssd_ttl_days: float = 7.0
    ssd_prune_interval_s: float = 600.0
    ssd_io_threads: int = 8

    def validate(self) -> None:
        if self.ssd_policy not in SSD_POLICIES:
            raise ValueError(f"ssd_policy must be one of {', '.join(SSD_POLICIES)}, not {self.ssd_policy!r}")
        if self.ssd_durability not in ("best_effort", "persistent"):
            raise ValueError(f"ssd_durability must be best_effort or persistent, not {self.ssd_durability!r}")
        if self.disk_cache_gb < 0 or (self.disk_min_free_gb or 0) < 0 or self.ssd_ttl_days <= 0:
            raise ValueError("disk_cache_gb and disk_min_free_gb must be >= 0, ssd_ttl_days > 0")
        if self.ssd_persistent_retries < 0:
            raise ValueError(f"ssd_persistent_retries must be >= 0, not {self.ssd_persistent_retries}")

    def to_tier_config(self) -> DiskTierConfig:
        self.validate()
        return DiskTierConfig(
            durability=self.ssd_durability,  # type: ignore[arg-type]  # a Durability: validate() checked it
            persistent_retries=self.ssd_persistent_retries,
            async_writes=self.ssd_async,
            queue_blocks=self.ssd_queue_blocks,
            flush_interval_s=self.ssd_flush_interval_s,
            capacity_bytes=int(self.disk_cache_gb * GIB),
            min_free_bytes=None if self.disk_min_free_gb is None else int(self.disk_min_free_gb * GIB),
            ttl_s=self.ssd_ttl_days * 86400.0,
            prune_interval_s=self.ssd_prune_interval_s,
            io_threads=self.ssd_io_threads,
        )
