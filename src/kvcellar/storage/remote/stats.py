"""The remote tier's counters (``remote_*``; the block checks' from ``block_format.CheckStats``), changed
from the request path and its writer thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcellar.stats import Count, counter
from kvcellar.storage.block_format import CheckStats


@dataclass
class RemoteStats(CheckStats):
    PREFIX: ClassVar[str] = "remote_"
    lookup_calls: Count = counter()
    lookup_hit_blocks: Count = counter()
    lookup_seconds: Count = counter(0.0)
    load_calls: Count = counter()
    load_hits: Count = counter()
    load_misses: Count = counter()
    load_missing: Count = counter()
    load_bytes: Count = counter()
    load_seconds: Count = counter(0.0)
    load_timeouts: Count = counter()
    stored_blocks: Count = counter()
    stored_bytes: Count = counter()
    store_seconds: Count = counter(0.0)
    store_skipped_existing: Count = counter()
    enqueued: Count = counter()
    dropped_queue_full: Count = counter()
    dropped_backoff: Count = counter()
    dropped_closed: Count = counter()
    dropped_oom: Count = counter()
    dropped_error: Count = counter()
    enqueue_wait_s_total: Count = counter(0.0)
    # Faults (each also counted per error name, ``<kind>_errors_<name>``).
    conn_errors: Count = counter()
    write_errors: Count = counter()
    probes: Count = counter()
    probe_failures: Count = counter()
    removed_blocks: Count = counter()
