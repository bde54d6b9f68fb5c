"""``kvcellar.stats``: typed counters, their kinds and exported names."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

import pytest

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
