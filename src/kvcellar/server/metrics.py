"""The one place where every module's counters are merged, for /health and /metrics.

Each module owns its counters under a prefix (``engine_``, ``sched_``, ``runner_``,
``artifact_``; this layer's ``server_``); the cache tiers' counters come from the engine by
tier (``observability.tier_stats``: each tier names itself, so nothing here maps prefixes to
tiers). ``merged_stats`` flattens every source into one dict, which ``SnapshotCollector``
exports to Prometheus as ``kvcellar_<key>``; /health lists each tier once under ``tiers``
(its state and health with its counters) and groups the rest by prefix
(``group_by_prefix``).

Kinds are declared where the numbers are made, never guessed from names: each owner lists
which of its keys are levels (the ``gauge()`` fields of its ``kvcellar.stats.Stats``;
``KVTier.gauges``, ``ArtifactStore.GAUGES``); those are gauges,
every other key is a monotonic count and a counter. Per tier (``observability.tier_reports``) the
collector also exports the state as ``kvcellar_tier_state{tier,state}`` (1 for the current
state), ``kvcellar_tier_last_shutdown_clean{tier}``, and the hit-rate pair
``kvcellar_tier_queried_blocks_total{tier}`` / ``kvcellar_tier_hit_blocks_total{tier}``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcellar.stats import Stats, counter, gauge

# Every state a tier can report; the current one is exported as 1, the others as 0.
TIER_STATES = ("ok", "degraded", "no_space")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/input_tokens", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics")

_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


def group_by_prefix(stats: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``{"engine": {"engine_*": ...}, "sched": {...}, ...}``: one group per owner's prefix."""
    groups: dict[str, dict[str, float]] = {}
    for key, value in stats.items():
        groups.setdefault(key.split("_", 1)[0], {})[key] = value
    return groups


class SnapshotCollector(Collector):
    """Reads ``snapshot()``, ``gauges()`` and ``tiers()`` on every scrape.

    ``gauges``: the keys of the snapshot that are levels, as their owners declare them.
    ``tiers``: one dict per cache tier, top first: ``tier`` (name), ``state`` (one of
    ``TIER_STATES``), ``last_shutdown_clean`` (bool or None), ``queried_blocks`` (blocks
    asked of the tier) and ``hit_blocks`` (of those, served by it)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, float]], gauges: Callable[[], Collection[str]],
                 tiers: Callable[[], Sequence[Mapping[str, object]]] = tuple) -> None:
        self._snapshot = snapshot
        self._gauges = gauges
        self._tiers = tiers

    def collect(self) -> Iterable[Metric]:
        gauges = self._gauges()
        for key, value in sorted(self._snapshot().items()):
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)):
                continue
            name = "kvcellar_" + _NAME_OK.sub("_", key)
            if key in gauges:
                yield GaugeMetricFamily(name, f"{key} (level)", value=value)
            else:
                yield CounterMetricFamily(name, f"{key} (count)", value=value)
        yield from self._tier_families(self._tiers())

    @staticmethod
    def _tier_families(tiers: Sequence[Mapping[str, Any]]) -> Iterable[Metric]:
        if not tiers:
            return
        state = GaugeMetricFamily("kvcellar_tier_state", "1 for the tier's current state", labels=["tier", "state"])
        clean = GaugeMetricFamily("kvcellar_tier_last_shutdown_clean",
                                  "1 if the previous run on this tier shut down cleanly", labels=["tier"])
        queried = CounterMetricFamily("kvcellar_tier_queried_blocks", "blocks asked of the tier", labels=["tier"])
        hits = CounterMetricFamily("kvcellar_tier_hit_blocks", "blocks the tier served", labels=["tier"])
        for t in tiers:
            name = str(t["tier"])
            for s in TIER_STATES:
                state.add_metric([name, s], 1.0 if t.get("state") == s else 0.0)
            if t.get("last_shutdown_clean") is not None:
                clean.add_metric([name], float(bool(t["last_shutdown_clean"])))
            queried.add_metric([name], float(t.get("queried_blocks", 0)))
            hits.add_metric([name], float(t.get("hit_blocks", 0)))
        yield from (state, clean, queried, hits)

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: the set of keys grows as tiers attach


@dataclass
class ServerStats(Stats):
    PREFIX: ClassVar[str] = "server_"
    requests_total: int = counter()
    requests_failed: int = counter()  # any 5xx (timeouts and shutdown included)
    internal_errors: int = counter()  # 500 only: a bug or an engine failure
    first_token_timeouts: int = counter()
    inter_token_timeouts: int = counter()
    client_disconnects: int = counter()
    # x-anthropic-* pseudo-header lines dropped from Messages system prompts
    anthropic_pseudo_headers_dropped: int = counter()
    # requests naming another model, served with the loaded one (--serve-any-model)
    other_model_names: int = counter()
    # forced tool calls checked against their tool's full schema, and those that failed it
    # (a keyword the grammar does not enforce: tools/schemas.py)
    tool_arguments_checked: int = counter()
    tool_arguments_invalid: int = counter()


@dataclass
class InflightLevels(Stats):
    PREFIX: ClassVar[str] = "server_"
    inflight_requests: int = gauge()
    inflight_sequences: int = gauge()


class ServerMetrics:
    """Counters and histograms of the HTTP layer. Touched from the event loop thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.stats = ServerStats()
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
            self.stats.requests_total += 1
            if status >= 500:
                self.stats.requests_failed += 1
            if status == 500:
                self.stats.internal_errors += 1


def merged_stats(*sources: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for source in sources:
        out.update(source)
    return out
