"""The remote tier's store queue: the shared bounded writer (storage/writer.py) set up
the remote tier's way.

``offer`` (any thread; the engine's step loop) never waits: a block goes into the bounded
queue or is dropped and counted, so a slow or full Redis costs decode nothing. The thread
``kvcellar-remote-writer-<ns>`` takes up to ``batch`` blocks at a time and hands them to
``write_batch`` (one pipelined round trip, RemoteTier._write_batch); while idle it calls
``idle`` every ``idle_s`` (the tier probes a faulty connection there, so it recovers
without traffic). A batch that raises is counted as ``dropped_error``; blocks a timed-out
``close`` drops, as ``dropped_closed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvcellar.storage.base import StoreRequest
from kvcellar.storage.remote.stats import RemoteStats
from kvcellar.storage.writer import BoundedWriter

_log = logging.getLogger("kvcellar.storage.remote")


class RemoteWriter(BoundedWriter[StoreRequest]):
    def __init__(self, name: str, capacity: int, batch: int, write_batch: Callable[[list[StoreRequest]], None],
                 idle: Callable[[], None], counters: RemoteStats, idle_s: float = 0.25) -> None:
        super().__init__(name, capacity, write_batch, counters, log=_log, label="remote tier writer", batch=batch,
                         idle=idle, idle_s=idle_s, error_count=counters.dropped_error,
                         abort_count=counters.dropped_closed)
