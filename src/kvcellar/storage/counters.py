"""Thread-safe counters owned by one component, every name under its prefix."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Counters:
    """A bag of monotonic counters. ``_lock`` protects ``_values``; any thread
    may call any method."""

    def __init__(self, prefix: str, names: Iterable[str] = ()) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._values: dict[str, int | float] = {}
        for n in names:
            self._values[self._full(n)] = 0

    def _full(self, name: str) -> str:
        return name if name.startswith(self.prefix) else self.prefix + name

    def inc(self, name: str, n: int | float = 1) -> None:
        key = self._full(name)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + n

    def set_max(self, name: str, value: float) -> None:
        key = self._full(name)
        with self._lock:
            if value > self._values.get(key, 0):
                self._values[key] = value

    def get(self, name: str) -> int | float:
        with self._lock:
            return self._values.get(self._full(name), 0)

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._values)
