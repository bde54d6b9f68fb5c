"""The one place where every module's counters are merged, for /health and /metrics.

Each module owns its counters under a prefix (``engine_``, ``sched_``, ``kv_``; later
``ssd_``, ``writer_``, ``artifact_``; this layer's ``server_``). ``merged_stats`` flattens
them into one dict; ``group_by_prefix`` shapes that for /health, where the prefixes that
belong to a cache tier (``TIER_OF_PREFIX``) are listed under ``tiers``; ``SnapshotCollector``
exports the same dict to Prometheus as ``kvcellar_<key>``: gauges for the keys that describe
a current state (``GAUGE_MARKERS``), counters for the rest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Which tier each counter prefix reports for.
TIER_OF_PREFIX = {"kv": "ram", "ssd": "ssd", "writer": "ssd", "remote": "remote"}

# Substrings of keys that are gauges (a level, not a running total).
GAUGE_MARKERS = ("_running", "_waiting", "_inflight", "_blocks_total", "_blocks_free", "_blocks_cached",
                 "_blocks_used", "_queue", "_depth", "_bytes_used", "_bytes_limit", "_files", "_entries",
                 "_size", "_capacity", "_clean", "_last_")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


def prefix_of(key: str) -> str:
    return key.split("_", 1)[0]


def is_gauge(key: str) -> bool:
    return any(marker in key for marker in GAUGE_MARKERS) or key.endswith("_state")


def group_by_prefix(stats: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``{"tiers": {"ram": {...kv_*}}, "engine": {...}, "sched": {...}, ...}``."""
    groups: dict[str, dict[str, float]] = {}
    tiers: dict[str, dict[str, float]] = {}
    for key, value in stats.items():
        prefix = prefix_of(key)
        tier = TIER_OF_PREFIX.get(prefix)
        target = tiers.setdefault(tier, {}) if tier else groups.setdefault(prefix, {})
        target[key] = value
    tiers.setdefault("ram", {})
    return {"tiers": tiers, **groups}


class SnapshotCollector(Collector):
    """Reads ``snapshot()`` on every scrape."""

    def __init__(self, snapshot: Callable[[], Mapping[str, float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        for key, value in sorted(self._snapshot().items()):
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)):
                continue
            name = "kvcellar_" + _NAME_OK.sub("_", key)
            if is_gauge(key):
                yield GaugeMetricFamily(name, f"{key} (gauge)", value=value)
            else:
                yield CounterMetricFamily(name, f"{key} (counter)", value=value)

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: the set of keys grows as tiers attach


class ServerMetrics:
    """Counters and histograms of the HTTP layer. Touched from the event loop thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.stats: dict[str, float] = {
            "server_requests_total": 0,
            "server_requests_failed": 0,  # any 5xx (timeouts and shutdown included)
            "server_internal_errors": 0,  # 500 only: a bug or an engine failure
            "server_first_token_timeouts": 0,
            "server_inter_token_timeouts": 0,
            "server_client_disconnects": 0,
        }
        self.http_seconds = Histogram(
            "kvcellar_http_request_duration_seconds", "Time from request to the end of the response",
            ["route", "status"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft_seconds = Histogram(
            "kvcellar_time_to_first_token_seconds", "Time from submission to the first generated token",
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        self.http_seconds.labels(route=route, status=str(status)).observe(seconds)
        if path.startswith("/v1/") and route != "/v1/models":
            self.stats["server_requests_total"] += 1
            if status >= 500:
                self.stats["server_requests_failed"] += 1
            if status == 500:
                self.stats["server_internal_errors"] += 1

    def count(self, key: str, n: float = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n


def merged_stats(*sources: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for source in sources:
        out.update(source)
    return out
