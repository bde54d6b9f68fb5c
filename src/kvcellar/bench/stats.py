"""Small statistics for noisy machines: medians of repeats with their range, percentiles, ratios."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """The finite values of a repeated measurement: their median and range, as result.json has them."""

    median: float
    min: float
    max: float
    n: int
    values: list[float]

    def scaled(self, factor: float) -> Summary:
        """The same figures in another unit (seconds to ms, a ratio to %); ``n`` stays."""
        return dataclasses.replace(self, median=self.median * factor, min=self.min * factor,
                                   max=self.max * factor, values=[v * factor for v in self.values])


def summarize(values: Iterable[float | None]) -> Summary | None:
    """The ``Summary`` of the finite values, or None if there are none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return Summary(median=statistics.median(vals), min=min(vals), max=max(vals), n=len(vals), values=vals)


def percentile(values: Iterable[float], p: float) -> float | None:
    """Linear-interpolated percentile (``p`` in 0..100), as numpy's default."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return None
    k = (len(vals) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def median_of(summary: Summary | None) -> float | None:
    return None if summary is None else summary.median


def ratio(num: float | Summary | None, den: float | Summary | None) -> float | None:
    """``num / den`` of two numbers or of two summaries' medians; None if either is missing or den is 0."""
    a = median_of(num) if isinstance(num, Summary) else num
    b = median_of(den) if isinstance(den, Summary) else den
    if a is None or b is None or b == 0:
        return None
    return a / b
