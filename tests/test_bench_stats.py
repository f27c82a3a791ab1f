"""The bench's generic statistics (`fsd_chat.bench.stats`) on values whose answers are known."""

from __future__ import annotations

import math

import pytest

from fsd_chat.bench.stats import Spread, mean_ci95, median_ci95, paired_ratios, pareto_front


@pytest.mark.parametrize(
    ("n", "expected"),
    # Order statistics of the 95% CI of a median, as tabulated (binomial coverage): coverage
    # 99.2% at n = 8, 96.1% at n = 9, 95.9% at n = 20; none exists below n = 6.
    [(5, None), (6, (1, 6)), (8, (1, 8)), (9, (2, 8)), (20, (6, 15))],
)
def test_median_confidence_interval(n: int, expected: tuple[int, int] | None) -> None:
    assert median_ci95([float(v) for v in range(n, 0, -1)]) == expected


def test_mean_interval_is_the_normal_approximation() -> None:
    # Sample standard deviation of 1..5 is √2.5; the half-width is 1.96 · √2.5 / √5.
    mean, half = mean_ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and half == pytest.approx(1.959964 * math.sqrt(2.5 / 5))
    assert mean_ci95([2.0]) == (2.0, None)  # one value has no spread to measure
    assert mean_ci95([1.0, math.inf])[1] is None


def test_spread_quartiles_are_inclusive() -> None:
    assert Spread.of([1.0, 2.0, 3.0, 4.0, 5.0]) == Spread(3.0, 2.0, 4.0, 1.0, 5.0)
    assert Spread.of([7.0]) == Spread(7.0, 7.0, 7.0, 7.0, 7.0)


def test_ratios_are_paired_by_key_and_skip_missing_or_zero_denominators() -> None:
    numerators = {"a": 6.0, "b": 4.0, "c": 3.0, "d": 1.0}
    assert paired_ratios(numerators, {"a": 3.0, "b": 0.0, "d": 4.0}) == [2.0, 0.25]


def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes() -> None:
    points = [(1.0, 0.5), (3.0, 0.9), (2.0, 0.2), (2.5, 0.95), (0.5, 0.1)]
    assert pareto_front(points, higher_is_better=False) == [1, 2, 4]  # fast and low cost
    assert pareto_front(points, higher_is_better=True) == [1, 3]  # fast and high quality
