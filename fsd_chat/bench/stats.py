"""Generic statistics of the benchmark: spreads, confidence intervals of a mean and of a median,
paired ratios, and the Pareto front of a two-objective trade-off. Nothing here knows what was
measured; `metrics` and `curves` apply it to fsd-chat's runs. Standard library only (no torch).

Geometric means are the standard library's `statistics.geometric_mean`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

Key = TypeVar("Key", bound=Hashable)

Z95 = 1.959964
"""Two-sided 95% quantile of the standard normal distribution, Φ⁻¹(0.975)."""


@dataclass(frozen=True, slots=True)
class Spread:
    """Distribution of a sample: median, quartiles, extremes."""

    median: float
    q1: float
    q3: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        """Spread of a non-empty list (quartiles by the inclusive method, `statistics.quantiles`;
        all five equal to the value for one value).

        Raises:
            ValueError: `values` is empty.
        """
        if len(values) == 1:
            return cls(values[0], values[0], values[0], values[0], values[0])
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(median, q1, q3, min(values), max(values))


def mean_ci95(values: list[float]) -> tuple[float, float | None]:
    """Mean of a non-empty sample and the half-width of its 95% confidence interval by the normal
    approximation, Z95 · s / √n with s the sample standard deviation (None for n < 2, or when a
    value is infinite).

    Coverage is 95% only asymptotically (central limit theorem); for a handful of values from a
    skewed distribution it is lower.

    Raises:
        statistics.StatisticsError: `values` is empty.
    """
    mean = statistics.fmean(values)
    if len(values) < 2 or not all(map(math.isfinite, values)):
        return mean, None
    return mean, Z95 * statistics.stdev(values) / math.sqrt(len(values))


def median_ci95(values: list[float]) -> tuple[float, float] | None:
    """Distribution-free 95% confidence interval of the median: the binomial order-statistic
    (sign-test) interval (x_(j), x_(n+1-j)) with the largest j whose coverage
    1 - 2·P(Bin(n, ½) < j) is still ≥ 95% (Conover, *Practical Nonparametric Statistics*). It holds for any continuous distribution of independent values, at any n; the coverage
    is exact, so it is at least 95% (e.g. 99.2% at n = 8, 96.1% at n = 9). None for n < 6, where
    even (min, max) covers less than 95%."""
    n = len(values)
    ordered = sorted(values)
    j, below = 0, 0.0  # below = P(Bin(n, ½) < j + 1) as j grows
    while True:
        below += math.comb(n, j) / 2**n
        if 1 - 2 * below < 0.95:
            break
        j += 1
    return (ordered[j - 1], ordered[n - j]) if j >= 1 else None


def median_with_ci95(values: list[float]) -> tuple[float, tuple[float, float] | None]:
    """The median of a non-empty sample with its distribution-free 95% interval (`median_ci95`).

    Raises:
        statistics.StatisticsError: `values` is empty.
    """
    return statistics.median(values), median_ci95(values)


def paired_ratios(numerators: Mapping[Key, float], denominators: Mapping[Key, float]) -> list[float]:
    """The ratio numerators[key] / denominators[key] for every key of `numerators` that has a
    non-zero denominator, in the order of `numerators`: the pairing cancels what the two share
    (the same prompt and seed), so the ratios' median measures the difference alone."""
    return [value / denominators[key] for key, value in numerators.items() if denominators.get(key)]


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the points (x, y) that no other point beats on both axes, largest x first: x is
    better when larger, y when larger if `higher_is_better` else when smaller."""
    sign = 1.0 if higher_is_better else -1.0
    front: list[int] = []
    best = -math.inf
    for i in sorted(range(len(points)), key=lambda i: -points[i][0]):
        if sign * points[i][1] > best:
            front.append(i)
            best = sign * points[i][1]
    return front
