"""The ``[disk]`` section: the disk tier's knobs, as users set them and as the tier reads them.

A field's ``key`` metadata is the name users give it (the ``[disk]`` key in the TOML file,
``KVCELLAR_<KEY>`` in the environment, ``--<key>`` on the command line), in ``unit``s of the
field (``disk_cache_gb`` is GiB, ``capacity_bytes`` bytes). ``key=None``: tuned here, not a
setting. Defaults are the production ones; ``validate`` runs once, where the settings are
assembled (``kvcellar.settings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, get_args

GIB = 1 << 30
DAY_S = 86400.0

# write_through: every new full block goes to disk; evict_only: blocks go to disk when the
# RAM tier drops them; off: RAM only.
SsdPolicy = Literal["write_through", "evict_only", "off"]
SSD_POLICIES: tuple[SsdPolicy, ...] = get_args(SsdPolicy)
# best_effort: one attempt, no fsync (a crash may lose recent blocks, never serve a torn one:
# the checksum catches it). persistent: fsync the file and its directory before the block
# counts as stored; bounded retries.
Durability = Literal["best_effort", "persistent"]
DURABILITIES: tuple[Durability, ...] = get_args(Durability)

# Metadata of the knobs that are no setting (no flag, file key or environment variable).
TUNED = {"key": None}


@dataclass
class DiskConfig:
    """The ``[disk]`` section. Environment: ``KVCELLAR_SSD_POLICY=evict_only``."""

    policy: SsdPolicy = field(default="write_through", metadata={"key": "ssd_policy"})
    durability: Durability = field(default="best_effort", metadata={"key": "ssd_durability"})
    # With persistent durability: how often a failed write is tried again before the block is dropped.
    persistent_retries: int = field(default=3, metadata={"key": "ssd_persistent_retries"})
    # False: store() writes in the caller's thread (tests, tools, debugging).
    async_writes: bool = field(default=True, metadata={"key": "ssd_async"})
    # Writer queue bound, in blocks (each holds its tensor until written:
    # 256 x 368 KiB = 92 MiB for the default model at block size 16).
    queue_blocks: int = field(default=256, metadata={"key": "ssd_queue_blocks"})
    # How long the engine waits for room in a full queue for a block RAM evicts that is not
    # on disk yet: its last chance, after which it is lost to the SSD (a new block, still in
    # RAM, is dropped at once and offered again then). A writer that freed nothing during a
    # whole wait is not waited on again until it frees a slot: a stalled disk costs one wait.
    evict_wait_s: float = field(default=0.05, metadata={"key": "ssd_evict_wait_s"})
    # There is no index to flush; last-access times (file atimes, for LRU and
    # TTL across restarts) are written back in batches at this interval and
    # at close, keeping utime() off the read path.
    flush_interval_s: float = field(default=1.0, metadata={"key": "ssd_flush_interval_s"})
    capacity_bytes: int = field(default=20 * GIB, metadata={"key": "disk_cache_gb", "unit": GIB})
    # Free space always left on the filesystem. None: min(1 GiB, 5 % of the
    # filesystem's size), so a small cache filesystem is not switched off by a
    # floor larger than itself. An explicit value is kept as given;
    # if it leaves no room, start-up warns and health says "no_space".
    min_free_bytes: int | None = field(default=None, metadata={"key": "disk_min_free_gb", "unit": GIB})
    ttl_s: float = field(default=7 * DAY_S, metadata={"key": "ssd_ttl_days", "unit": DAY_S})
    # TTL pruning and the rescan that adopts other processes' files run on
    # this timer, independent of writes.
    prune_interval_s: float = field(default=600.0, metadata={"key": "ssd_prune_interval_s"})
    # Reader threads; several requests in flight are what per-block files need
    # to approach the device's bandwidth (docs/performance.md, "Measurements behind defaults").
    io_threads: int = field(default=8, metadata={"key": "ssd_io_threads"})

    # Total time one store() call may wait for queue space before dropping the
    # rest of its blocks. Waiting only buys what the writer frees meanwhile:
    # benchmarks/bench_disk_io.py, section "tier".
    enqueue_timeout_s: float = field(default=0.001, metadata=TUNED)
    # How long the writer defers a write while reads are in flight (reads first).
    write_defer_max_s: float = field(default=0.05, metadata=TUNED)
    # After lookup() reports a key present, this process will not evict it for
    # this long (or until it is loaded), so lookup -> load does not race eviction.
    lookup_lease_s: float = field(default=10.0, metadata=TUNED)
    # Fault back-off: writes are dropped while backing off; it doubles per failed real
    # write up to the cap. Probes (a 4 KiB write) run every probe_interval_s during an
    # episode whatever the back-off, and a successful one ends it: recovery after the
    # fault clears takes at most about one probe interval (failed probes do not double
    # the back-off).
    fault_backoff_initial_s: float = field(default=1.0, metadata=TUNED)
    fault_backoff_max_s: float = field(default=2.0, metadata=TUNED)
    probe_interval_s: float = field(default=1.0, metadata=TUNED)
    # If close() was never called, how long the writer keeps draining after the
    # main thread has exited before giving up (the process then exits).
    exit_drain_s: float = field(default=5.0, metadata=TUNED)

    def validate(self) -> None:
        if self.policy not in SSD_POLICIES:
            raise ValueError(f"ssd_policy must be one of {', '.join(SSD_POLICIES)}, not {self.policy!r}")
        if self.durability not in DURABILITIES:
            raise ValueError(f"ssd_durability must be best_effort or persistent, not {self.durability!r}")
        if self.capacity_bytes < 0 or (self.min_free_bytes or 0) < 0 or self.ttl_s <= 0:
            raise ValueError("disk_cache_gb and disk_min_free_gb must be >= 0, ssd_ttl_days > 0")
        if self.persistent_retries < 0:
            raise ValueError(f"ssd_persistent_retries must be >= 0, not {self.persistent_retries}")
        if self.queue_blocks < 1 or self.io_threads < 1:
            raise ValueError("ssd_queue_blocks and ssd_io_threads must be >= 1")
        for f in fields(self):
            if f.name.endswith("_s") and getattr(self, f.name) < 0:
                raise ValueError(f"{f.metadata['key'] or f.name} must be >= 0")
