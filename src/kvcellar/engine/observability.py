"""What an engine reports: its counters merged with its parts', and the cache tiers'.

Read from any thread (the server's /health and /metrics, the bench); every number is
owned by one part of the engine and only read here. Counter names carry their owner's
prefix (``engine_``, ``sched_``, ``runner_``, ``kv_``, ``<tier>_``), so merging them into
one flat dict keeps them apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcellar.cache.block_manager import BlockLevels, BlockStats
from kvcellar.cache.prefetch import PrefetchStats
from kvcellar.cache.prefix_cache import PrefixCacheStats
from kvcellar.cache.state_pool import StateStats
from kvcellar.engine.engine import Engine
from kvcellar.engine.model_runner import RunnerStats
from kvcellar.engine.scheduler import SchedulerStats
from kvcellar.engine.stats import EngineStats
from kvcellar.stats import Stats, gauge


@dataclass
class EngineLevels(Stats):
    """The engine's queues, read when reported."""

    PREFIX: ClassVar[str] = "engine_"
    running: int = gauge()
    waiting: int = gauge()
    loading: int = gauge()  # admitted, blocks being read from a lower tier
    prefetching: int = gauge()  # prefetch reads in flight


def levels(engine: Engine) -> EngineLevels:
    sched = engine.scheduler
    return EngineLevels(running=len(sched.running), waiting=len(sched.waiting), loading=len(sched.loading),
                        prefetching=len(sched.cache.prefetch.reads))


def snapshot(engine: Engine) -> dict[str, float]:
    """Counters of the engine, scheduler, runner and every cache tier, merged into one flat
    dict; ``tier_stats`` has the tiers' part by tier."""
    sched = engine.scheduler
    return {
        **engine.stats.as_dict(),
        **levels(engine).as_dict(),
        **sched.stats.as_dict(),
        **sched.cache.stats.as_dict(),
        **sched.cache.prefetch.stats.as_dict(),
        **engine.runner.stats.as_dict(),
        **(sched.cache.states.stats.as_dict() if sched.cache.states is not None else {}),
        **{k: v for counters in tier_stats(engine).values() for k, v in counters.items()},
    }


def tier_stats(engine: Engine) -> dict[str, dict[str, float]]:
    """Counters per cache tier, top first: ``ram`` (the block manager's ``kv_*``), then each
    lower tier's own and the link's for it."""
    return {"ram": dict(engine.blocks.snapshot()), **engine.lower.stats_by_tier()}


def gauge_keys(engine: Engine) -> frozenset[str]:
    """The keys of ``snapshot`` that are levels, as their owners declare them."""
    owned: tuple[type[Stats], ...] = (EngineStats, EngineLevels, SchedulerStats, PrefixCacheStats, PrefetchStats,
                                      RunnerStats, BlockStats, BlockLevels, StateStats)
    return frozenset().union(*(s.gauge_names() for s in owned), engine.lower.gauge_keys())


def step_health(engine: Engine) -> dict[str, object]:
    """The step loop's state for /health."""
    return {
        "healthy": engine.healthy,
        "step_failures": engine.stats.step_failures,
        "step_failures_in_a_row": engine.stats.step_failures_in_a_row,
        "unhealthy_after_failed_steps": engine.config.unhealthy_after_failed_steps,
        "last_step_error": engine.last_step_error,
        "last_step_error_time": engine.last_step_error_time,
    }


def speculation_health(engine: Engine) -> dict[str, object]:
    """Speculative decoding for /health: the mode, and what drafts did (``/metrics`` has the
    counters: ``engine_spec_*``)."""
    stats = engine.stats
    drafted, accepted, verifies = stats.spec_drafted_tokens, stats.spec_accepted_tokens, stats.spec_verifies
    active = engine.scheduler.drafter is not None
    return {
        "mode": engine.scheduler.drafter.mode if engine.scheduler.drafter is not None else "off",
        "max_tokens": engine.config.speculative_max_tokens if active else 0,
        "verifies": verifies,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        # tokens a verification emitted: the accepted ones and the one the model picked after them
        "tokens_per_verify": round((accepted + verifies) / verifies, 3) if verifies else None,
    }


def tier_reports(engine: Engine) -> list[dict[str, object]]:
    """Per cache tier, top first: name, state, last_shutdown_clean, and the blocks asked of
    it and served by it (the hit-rate pair)."""
    kv = engine.blocks.stats
    reports: list[dict[str, object]] = [{
        "tier": "ram", "state": "ok", "last_shutdown_clean": None,
        "queried_blocks": kv.lookup_hits + kv.lookup_misses, "hit_blocks": kv.lookup_hits,
    }]
    lower = engine.lower
    for attached in lower.tiers:
        name = attached.tier.name
        health = attached.calls.health()
        reports.append({
            "tier": name, "state": health.get("state"),
            "last_shutdown_clean": health.get("last_shutdown_clean"),
            "queried_blocks": attached.stats.queried_blocks,
            "hit_blocks": attached.stats.loaded_blocks,
        })
    return reports


def tier_health(engine: Engine) -> dict[str, dict[str, object]]:
    """Each lower tier's health with its policy, by tier name (empty without tiers)."""
    return engine.lower.health()
