"""Structured, quiet logs for ``kvcellar serve``.

Records may carry ``extra={"fields": {...}}``; the text format appends them as
``key=value``, the JSON format (one object per line) merges them in. The default level is
WARNING: a healthy server prints its one "serving on" line and nothing per request; pass
``--log-level INFO`` for a line per finished request.
"""

from __future__ import annotations

import json
import logging
from typing import Any


class FirstSeen:
    """Names worth one log line each (an unknown model, a tool type this server ignores): true
    the first time a name is seen. Bounded, since any client can send any number of names: at
    most ``limit`` names of ``max_len`` characters are remembered, and once full nothing more is
    logged."""

    def __init__(self, limit: int = 256, max_len: int = 128) -> None:
        self._seen: set[str] = set()
        self._limit = limit
        self._max_len = max_len

    def __call__(self, name: str) -> bool:
        name = name[:self._max_len]
        if name in self._seen or len(self._seen) >= self._limit:
            return False
        self._seen.add(name)
        return True

    def __len__(self) -> int:
        return len(self._seen)


def _value(v: Any) -> str:
    text = str(v)
    return json.dumps(text) if (not text or any(c in text for c in ' "=')) else text


class KeyValueFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            head, sep, tail = line.partition("\n")  # keep a traceback after the fields
            line = head + " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items()) + sep + tail
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": self.formatTime(record), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, fmt: str) -> None:
    """Install the formatter on the root logger's handlers (adding one if there is none)."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    formatter: logging.Formatter = JsonFormatter() if fmt == "json" else KeyValueFormatter()
    for handler in root.handlers:
        handler.setFormatter(formatter)
    root.setLevel(level.upper())
