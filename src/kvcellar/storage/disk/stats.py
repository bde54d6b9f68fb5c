"""The SSD tier's counters: the namespace's (``ssd_*``) and its writer's (``writer_*``).
Changed from the request path, the writer thread and the upkeep thread (``SharedStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcellar.stats import Count, SharedStats, counter
from kvcellar.storage.block_format import CheckStats


@dataclass
class DiskStats(CheckStats):
    PREFIX: ClassVar[str] = "ssd_"
    lookup_calls: Count = counter()
    lookup_hit_blocks: Count = counter()
    stale_dropped: Count = counter()
    removed_blocks: Count = counter()
    load_calls: Count = counter()
    load_hits: Count = counter()
    load_misses: Count = counter()
    load_bytes: Count = counter()
    load_missing: Count = counter()
    stored_blocks: Count = counter()
    stored_bytes: Count = counter()
    store_skipped_existing: Count = counter()
    store_verified_existing: Count = counter()
    store_repaired: Count = counter()
    evicted_blocks: Count = counter()
    evicted_bytes: Count = counter()
    ttl_pruned_blocks: Count = counter()
    ttl_pruned_bytes: Count = counter()
    dropped_capacity: Count = counter()
    dropped_no_space: Count = counter()
    # Faults by direction (each also counted per errno name, ``<dir>_errors_<errno>``).
    write_errors: Count = counter()
    read_errors: Count = counter()
    probe_failures: Count = counter()
    atime_errors: Count = counter()
    delete_errors: Count = counter()
    recovered_orphan_tmp: Count = counter()
    recovered_bad_size: Count = counter()
    recovered_bad_header: Count = counter()
    recovered_misplaced: Count = counter()
    recovered_adopted: Count = counter()
    recovered_unclean_sessions: Count = counter()
    rescan_adopted: Count = counter()
    rescan_dropped: Count = counter()
    scans: Count = counter()
    scan_seconds: Count = counter(0.0)


@dataclass
class DiskWriterStats(SharedStats):
    PREFIX: ClassVar[str] = "writer_"
    enqueued: Count = counter()
    dedup_inflight: Count = counter()
    dropped_queue_full: Count = counter()
    dropped_backoff: Count = counter()
    dropped_closed: Count = counter()
    dropped_abort: Count = counter()
    retries: Count = counter()
    retry_final_fail: Count = counter()
    failed: Count = counter()
    deferred_timeouts: Count = counter()
    enqueue_wait_s_total: Count = counter(0.0)
    written_after_drop: Count = counter()
    dropped_no_parent: Count = counter()
    deferred_for_reads: Count = counter()
