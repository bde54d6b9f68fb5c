"""``kvcellar.stats``: typed counters, their kinds and exported names."""

from __future__ import annotations

import importlib
import itertools
import pkgutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest

import kvcellar
from kvcellar.stats import Count, SharedStats, Stats, counter, gauge


@dataclass
class Example(Stats):
    PREFIX: ClassVar[str] = "ex_"
    requests: int = counter()
    seconds: float = counter(0.0)
    depth: int = gauge()


def test_fields_export_under_the_prefix_with_their_kind() -> None:
    s = Example()
    s.requests += 2
    s.depth = 5
    assert s.as_dict() == {"ex_requests": 2, "ex_seconds": 0.0, "ex_depth": 5}
    assert s.as_dict("tier_link_") == {"tier_link_requests": 2, "tier_link_seconds": 0.0, "tier_link_depth": 5}
    assert Example.gauge_names() == {"ex_depth"}


def test_read_back_from_exported_names_and_differenced() -> None:
    before = Example.from_dict({"ex_requests": 3, "other": 9})
    after = Example.from_dict({"ex_requests": 7, "ex_seconds": 1.5, "ex_depth": 2})
    assert before == Example(requests=3)
    assert after.since(before) == Example(requests=4, seconds=1.5, depth=2)


def test_restore_sets_the_same_object_back() -> None:
    live = Example(requests=1)
    saved = live.copy()
    held = live
    live.requests += 10
    live.restore(saved)
    assert held.requests == 1 and saved is not live


def test_a_field_without_a_kind_is_refused() -> None:
    with pytest.raises(TypeError, match="counter\\(\\) or gauge\\(\\)"):
        @dataclass
        class Bad(Stats):
            plain: int = 0


@dataclass
class Shared(SharedStats):
    PREFIX: ClassVar[str] = "sh_"
    writes: Count = counter()
    write_errors: Count = counter()
    peak: Count = gauge()


def test_shared_counts_lose_no_update_across_threads() -> None:
    s = Shared()
    threads = [threading.Thread(target=lambda: [s.writes.add() for _ in range(20_000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.peak.set_max(3)
    s.peak.set_max(2)
    assert s.writes.value == 80_000 and s.peak.value == 3
    assert Shared.gauge_names() == {"sh_peak"}


def test_a_name_picked_by_reason_is_the_field_or_a_count_beside_the_fields() -> None:
    s = Shared()
    s.add_named("write_errors")
    s.add_named("write_errors_enospc", 2)
    assert s.write_errors.value == 1
    assert s.as_dict() == {"sh_writes": 0, "sh_write_errors": 1, "sh_peak": 0, "sh_write_errors_enospc": 2}


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


# Stats kinds that /health and /metrics do not merge: bases, and the grammar compiler's
# (kept on the compiler, not exported).
NOT_MERGED = {"kvcellar.stats.SharedStats", "kvcellar.storage.block_format.CheckStats",
              "kvcellar.engine.constraints.GrammarStats"}


def test_stats_of_different_owners_never_share_a_name(tmp_path) -> None:
    """/health and /metrics flatten every owner's numbers into one dict (server/app.py: the
    engine's snapshot with the RAM tier's and each lower tier's, the artifact cache's, the
    server's): a name two owners export would silently hide one of them. Every ``Stats``
    class in kvcellar is either merged (and listed here with the names it exports, the lower
    tiers' as real tiers export them) or named as not merged."""
    from kvcellar.artifacts.store import ArtifactCache
    from kvcellar.cache.block_manager import BlockLevels, BlockStats
    from kvcellar.cache.prefetch import PrefetchStats
    from kvcellar.cache.prefix_cache import PrefixCacheStats
    from kvcellar.cache.state_pool import StateStats
    from kvcellar.cache.tiering import SNAPSHOTS, LinkStats, SnapshotLinkStats
    from kvcellar.engine.model_runner import RunnerStats
    from kvcellar.engine.observability import EngineLevels
    from kvcellar.engine.scheduler import SchedulerStats
    from kvcellar.engine.stats import EngineStats
    from kvcellar.server.metrics import InflightLevels, ServerStats
    from kvcellar.storage.disk.config import DiskConfig
    from kvcellar.storage.disk.stats import DiskStats, DiskWriterStats
    from kvcellar.storage.disk.tier import DiskTier
    from kvcellar.storage.guard import GuardStats
    from kvcellar.storage.remote.config import RemoteConfig
    from kvcellar.storage.remote.stats import RemoteStats
    from kvcellar.storage.remote.tier import RemoteTier
    from tests.storage.helpers import SPEC

    for module in pkgutil.walk_packages(kvcellar.__path__, "kvcellar."):  # every Stats class defined
        importlib.import_module(module.name)
    defined = {f"{c.__module__}.{c.__qualname__}" for c in _subclasses(Stats) if c.__module__.startswith("kvcellar.")}

    fixed: list[type[Stats]] = [EngineStats, EngineLevels, SchedulerStats, PrefixCacheStats, PrefetchStats,
                                RunnerStats, BlockStats, BlockLevels, ServerStats, InflightLevels, StateStats]
    names: dict[str, set[str]] = {c.__qualname__: set(c().as_dict()) for c in fixed}
    disk = DiskTier(tmp_path / "kv", "ns", SPEC, DiskConfig(min_free_bytes=0))
    remote = RemoteTier("redis://127.0.0.1:1", "ns", SPEC, RemoteConfig(timeout_s=0.05))
    try:
        for tier, own in ((disk, (DiskStats, DiskWriterStats)), (remote, (RemoteStats,))):
            exported = set(tier.stats())
            for c in own:
                names[c.__qualname__] = set(c().as_dict())
                assert names[c.__qualname__] <= exported
            names[f"{tier.name} tier's levels"] = exported - set().union(*(names[c.__qualname__] for c in own))
            names[f"{tier.name} link"] = set(LinkStats().as_dict(f"{tier.name}_link_"))
            names[f"{tier.name} guard"] = set(GuardStats().as_dict(f"{tier.name}_guard_"))
            # a hybrid model's snapshot tier beside it (the same kind of tier), and the link's counts of it
            names[f"{tier.name} snapshots"] = {SNAPSHOTS + k for k in (*exported, *names[f"{tier.name} guard"])}
            names[f"{tier.name} link snapshots"] = set(SnapshotLinkStats().as_dict(f"{tier.name}_link_snapshots_"))
    finally:
        disk.close(10)
        remote.close(10)
    names["artifact cache"] = set(ArtifactCache(tmp_path / "models").stats())

    covered = {f"{c.__module__}.{c.__qualname__}" for c in
               (*fixed, DiskStats, DiskWriterStats, RemoteStats, LinkStats, SnapshotLinkStats, GuardStats)}
    assert defined - NOT_MERGED == covered, "a Stats class /health and /metrics merge is missing here"
    shared = {(a, b): names[a] & names[b] for a, b in itertools.combinations(names, 2) if names[a] & names[b]}
    assert not shared, shared
