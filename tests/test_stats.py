"""``kvcellar.stats``: typed counters, their kinds and exported names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvcellar.stats import Stats, counter, gauge


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
