"""The tier contract, enforced: ``GuardedTier`` wraps a ``KVTier`` so that nothing a tier
does wrong reaches the engine.

``storage/base.py`` promises that tier verbs never raise for faults and return within a
bounded time. The tiers keep that promise for the faults they know (OS errors, Redis
errors); the guard keeps it for the rest: any exception from a verb, or a verb slower than
the tier's ``call_timeout_s`` (a load: a future not resolved within ``load_timeout_for``), is
a fault of that tier. It is counted (``<tier>_guard_call_errors[_<type>]``), logged once per
episode with its type, and turns the tier ``degraded``; the caller gets the safe answer
(nothing present, a miss, a dropped write). While the guard backs off (doubling per fault,
from ``backoff_initial_s`` up to ``backoff_max_s``) the tier is not called at all; the first
call after the back-off is the probe, and a call that succeeds ends the episode.

A verb that never returns still holds its caller: the tiers bound their own I/O by
timeouts, and the guard makes a tier that overruns them stop being called.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvcellar.stats import Count, SharedStats, counter
from kvcellar.storage.base import KVTier, LoadRequest, StoreRequest
from kvcellar.storage.faults import FaultTracker

_log = logging.getLogger("kvcellar.storage.guard")

T = TypeVar("T")

VERBS = ("lookup", "load", "store", "wants", "pin", "unpin", "touch", "remove", "wait_idle", "stats", "health",
         "close")


class TierTimeout(Exception):
    """A tier verb that took longer than the tier's own timeout allows."""


@dataclass
class GuardStats(SharedStats):
    """Exported as ``<tier>_guard_*``."""

    call_errors: Count = counter()
    slow_calls: Count = counter()
    skipped_calls: Count = counter()


class GuardedTier(KVTier):
    """``tier`` behind the contract. Thread-safe as the tier is."""

    def __init__(self, tier: KVTier, *, backoff_initial_s: float = 1.0, backoff_max_s: float = 30.0) -> None:
        self.tier = tier
        self.name = tier.name
        self.gauges = tier.gauges
        self._c = GuardStats()
        # One fault state per verb: a broken store backs off stores while lookups go on, and
        # a lookup that succeeds does not end the stores' episode.
        self._faults = {verb: FaultTracker("call", self._c, _log, verb, backoff_initial_s, backoff_max_s,
                                           tier=tier.name) for verb in VERBS}

    def _call(self, verb: str, default: T, fn: Callable[[], T], waits_s: float = 0.0) -> T:
        """``waits_s``: how long the verb was allowed to wait, on top of ``call_timeout_s``."""
        faults = self._faults[verb]
        if faults.backing_off():
            self._c.skipped_calls.add()
            return default
        t0 = time.monotonic()
        try:
            result = fn()
        except Exception as exc:
            faults.failure(exc, verb)
            return default
        self._timed(verb, time.monotonic() - t0, self.tier.call_timeout_s + waits_s)
        return result

    def _timed(self, verb: str, seconds: float, limit: float) -> None:
        faults = self._faults[verb]
        if seconds > limit:
            self._c.slow_calls.add()
            faults.failure(TierTimeout(f"{verb} took {seconds:.2f} s, more than {limit:g} s"), verb)
        elif faults.in_episode:
            faults.success()

    def _in_episode(self) -> list[FaultTracker]:
        return [f for f in self._faults.values() if f.in_episode]

    # ---- reads ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        if self._faults["load"].backing_off():  # what it cannot load it must not offer
            self._c.skipped_calls.add()
            return 0
        n = self._call("lookup", 0, lambda: self.tier.lookup(keys))
        try:
            return max(0, min(int(n), len(keys)))
        except (TypeError, ValueError) as exc:  # not a count: a fault, nothing present
            self._faults["lookup"].failure(exc, "lookup")
            return 0

    def load(self, requests: Sequence[LoadRequest]) -> concurrent.futures.Future[int]:
        faults = self._faults["load"]
        out: concurrent.futures.Future[int] = concurrent.futures.Future()
        if faults.backing_off():
            self._c.skipped_calls.add()
            out.set_result(0)
            return out
        started = time.monotonic()
        limit = self.tier.load_timeout_for(sum(r.dest.nbytes for r in requests))
        try:
            future = self.tier.load(requests)
        except Exception as exc:
            faults.failure(exc, "load")
            out.set_result(0)
            return out

        def resolved(f: concurrent.futures.Future[int]) -> None:
            try:
                n = max(0, min(int(f.result()), len(requests)))
            except Exception as exc:  # the contract says a future never carries one
                self._faults["load"].failure(exc, "load")
                n = 0
            else:
                self._timed("load", time.monotonic() - started, limit)
            out.set_result(n)

        future.add_done_callback(resolved)
        return out

    def overdue(self, deadline: float, limit: float) -> None:
        """A load of this tier is still running past ``deadline``, ``limit`` seconds after it
        started (its caller gave up)."""
        self._c.slow_calls.add()
        waited = time.monotonic() - deadline + limit
        self._faults["load"].failure(
            TierTimeout(f"load still running after {waited:.2f} s, more than {limit:.3g} s"), "load")

    # ---- writes ---------------------------------------------------------------------------

    def store(self, requests: Sequence[StoreRequest]) -> None:
        self._call("store", None, lambda: self.tier.store(requests))

    def wants(self, key: bytes, wait_s: float = 0.0) -> bool:
        return bool(self._call("wants", False, lambda: self.tier.wants(key, wait_s), waits_s=wait_s))

    def pin(self, keys: Sequence[bytes]) -> None:
        self._call("pin", None, lambda: self.tier.pin(keys))

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._call("unpin", None, lambda: self.tier.unpin(keys))

    def touch(self, keys: Sequence[bytes]) -> None:
        self._call("touch", None, lambda: self.tier.touch(keys))

    def remove(self, keys: Sequence[bytes]) -> int:
        return int(self._call("remove", 0, lambda: self.tier.remove(keys)) or 0)

    def wait_idle(self, timeout: float) -> bool:
        try:
            return bool(self.tier.wait_idle(timeout))
        except Exception as exc:
            self._faults["wait_idle"].failure(exc, "wait_idle")
            return False

    # ---- reporting and shutdown -------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        try:
            own = dict(self.tier.stats())
        except Exception as exc:
            self._faults["stats"].failure(exc, "stats")
            own = {}
        return {**own, **self._c.as_dict(f"{self.name}_guard_")}

    def health(self) -> dict[str, object]:
        try:
            health: dict[str, Any] = dict(self.tier.health())
        except Exception as exc:
            self._faults["health"].failure(exc, "health")
            health = {"state": "degraded", self.name: {}}
        faults = self._in_episode()
        if faults:
            health["state"] = "degraded"
            last = max(faults, key=lambda f: f.last_error_time or 0.0)
            if (last.last_error_time or 0.0) >= float(health.get("last_error_time") or 0.0):
                health["last_error"] = last.last_error
                health["last_error_time"] = last.last_error_time
        health["guard"] = {"failing": sorted(v for v, f in self._faults.items() if f.in_episode),
                           "backoff_s": round(max((f.backoff_remaining() for f in faults), default=0.0), 3)}
        return health

    def close(self, timeout: float) -> bool:
        try:
            return bool(self.tier.close(timeout))
        except Exception as exc:
            self._faults["close"].failure(exc, "close")
            return False

    @property
    def degraded(self) -> bool:
        return bool(self._in_episode())

    def __repr__(self) -> str:
        return f"GuardedTier({self.tier!r})"
