"""Fault episodes: count every I/O fault, log once per episode, back off.
Shared by the tiers (disk: OS errors; remote: connection errors, timeouts, OOM).

An episode starts with the first fault after a success and ends with the next
success (a block written or read, or a probe write). While a write episode is
backing off, writes are dropped without touching the disk; the delay doubles
per fault of a real operation up to a maximum and resets after a real block
write succeeds. A failed probe changes neither the back-off nor the counters:
probes run on their own short interval, so the episode ends within one probe
interval of the fault clearing however long it lasted.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

from kvcellar.stats import SharedStats

# Episodes flapping faster than this (a probe succeeds, the next write fails
# again) are counted but not logged again.
_RELOG_AFTER_S = 60.0


def error_name(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno{exc.errno}")
    return type(exc).__name__


class FaultTracker:
    """Fault state of one direction (``op`` = "write" or "read").

    ``_lock`` protects every attribute below it; methods are thread-safe.
    """

    def __init__(
        self,
        op: str,
        counters: SharedStats,
        logger: logging.Logger,
        where: str,
        backoff_initial_s: float = 0.0,
        backoff_max_s: float = 0.0,
        tier: str = "disk",
    ) -> None:
        self.op = op
        self._tier = tier
        self._counters = counters
        self._log = logger
        self._where = where
        self._initial = backoff_initial_s
        self._max = max(backoff_max_s, backoff_initial_s)
        self._lock = threading.Lock()
        self._in_episode = False
        self._episode_faults = 0
        self._delay = backoff_initial_s
        self._backoff_until = 0.0
        self._last_error: str | None = None
        self._last_error_time: float | None = None
        self._last_log = -_RELOG_AFTER_S
        self._last_logged_error = ""

    def failure(self, exc: BaseException, what: str, *, probe: bool = False, counter: str | None = None) -> None:
        """Record a fault. ``probe=True``: it keeps the episode going (and its last
        error current) but is not an error of a real block and does not lengthen the
        back-off. ``counter``: the counter prefix (default ``op``; e.g. "delete" for a
        failed unlink, which is a fault of the write direction)."""
        name = error_name(exc)
        if not probe:
            prefix = counter or self.op
            self._counters.add_named(f"{prefix}_errors")
            self._counters.add_named(f"{prefix}_errors_{name.lower()}")
        now = time.monotonic()
        with self._lock:
            first = not self._in_episode
            self._in_episode = True
            self._episode_faults += 1
            self._last_error = f"{self.op} {what}: {name}: {exc}"
            self._last_error_time = time.time()
            if self._initial > 0 and not probe:
                self._backoff_until = now + self._delay
                self._delay = min(self._delay * 2, self._max)
            log = first and (now - self._last_log >= _RELOG_AFTER_S or name != self._last_logged_error)
            if log:
                self._last_log = now
                self._last_logged_error = name
        if log:
            self._log.warning(
                "%s tier %s fault in %s (%s): %s; further faults are counted, not logged, until it clears",
                self._tier, self.op, self._where, what, f"{name}: {exc}",
            )

    def success(self, *, probe: bool = False) -> None:
        if not self._in_episode and (probe or self._delay == self._initial):
            return
        with self._lock:
            ended, faults = self._in_episode, self._episode_faults
            self._in_episode = False
            self._episode_faults = 0
            self._backoff_until = 0.0
            if not probe:
                self._delay = self._initial
        if ended:
            self._log.info("%s tier %s fault in %s cleared after %d fault(s)", self._tier, self.op, self._where,
                           faults)

    @property
    def in_episode(self) -> bool:
        return self._in_episode

    def backing_off(self) -> bool:
        return self._in_episode and time.monotonic() < self._backoff_until

    def backoff_remaining(self) -> float:
        return max(0.0, self._backoff_until - time.monotonic()) if self._in_episode else 0.0

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @property
    def last_error_time(self) -> float | None:
        return self._last_error_time
