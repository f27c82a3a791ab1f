"""Which trade-off curve is faster at the same cost: paired comparisons of the lossy rules' curves.

A curve is one rule (and divergence, for fuzzy/pure) at one k, through its thresholds: the points
(cost per token, tokens/s), where cost is the configuration's mean over prompts (`Quality`). Exact SD
with the same k is every fsd-chat curve's point at cost 0 (T = 0 of every rule is exact SD), so each
curve starts there; transformers' `hf-ensemble` curve (through its ensemble weights w) starts from
`hf-assisted` with the same k, its lossless end (w → 1). Points of infinite cost (a lossy law with
mass where the target's truncated law has none) are left out.

Two curves a and b are compared at matched cost, paired by prompt:

1. The cost levels are the costs of both curves' own points (above 0) up to the lower of the two
   curves' highest costs, so that neither curve is extrapolated.
2. At each level, each prompt's tokens/s on a curve is interpolated linearly in cost between that
   prompt's runs at the two neighbouring points (the weights come from the points' mean costs, so
   they are the same for every prompt); the paired ratio a/b is taken per prompt.
3. Per level: the median over prompts of that ratio with its distribution-free 95% interval
   (`stats.median_ci95`). Overall: per prompt, the geometric mean of its ratios over the levels; then the
   median over prompts of that, with its interval: "a is x times as fast as b at equal cost".
4. The same paired ratio at the round costs of `COST_LEVELS` that both curves reach, for reports
   that quote speed at a given cost ("at 0.02 nats/token").

Every comparison is made on each of `CLOCKS` (`metrics`): wall clock; forward work (forward counts
× per-forward times shared by the whole group), which a busy machine cannot disturb; and τ, tokens
per target forward, which no timing enters at all.

The intervals cover the prompt-to-prompt spread of speed, not the uncertainty of the costs' means,
which is an order of magnitude smaller (the cost is computed exactly at each position). a
`dominates` b when the overall interval lies above 1; the group's `leader` is the curve whose overall
median beats every other curve it was compared with.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from fsd_chat.bench.metrics import RunRate, Summary, run_rate, tau_rate, trial_key, work_rate
from fsd_chat.bench.records import Configuration, Measurement, Setup
from fsd_chat.bench.stats import median_with_ci95

Trial = tuple[int, int]

TAU = "τ"
CLOCKS: dict[str, Callable[[list[Measurement]], RunRate]] = {
    "wall clock": lambda _runs: run_rate,
    "forward work": work_rate,
    TAU: lambda _runs: tau_rate,
}
"""The clocks curves are compared on, by name: each makes a run's speed (tokens/s; τ: tokens per
target forward) from all the runs."""

COST_LEVELS = (0.01, 0.02, 0.05)
"""Round costs, nats/token, at which every comparison also quotes its paired ratio."""


def _interval(bounds: list[float] | None) -> tuple[float, float] | None:
    """A confidence interval from JSON's [low, high] list (None stays None)."""
    return None if bounds is None else (bounds[0], bounds[1])


def _levels(data: list[Mapping[str, Any]]) -> list[Level]:
    """Levels back from JSON."""
    return [Level(level["cost"], level["ratio"], _interval(level["ci95"])) for level in data]


def _ratio_text(ratio: float, ci95: tuple[float, float] | None) -> str:
    """×1.10 [1.02–1.19]."""
    return f"×{ratio:.2f}" + ("" if ci95 is None else f" [{ci95[0]:.2f}–{ci95[1]:.2f}]")


@dataclass(frozen=True, slots=True)
class Level:
    """The paired speed ratio a/b at one cost level.

    Attributes:
        cost: Cost per token, nats.
        ratio: Median over prompts of the ratio of the interpolated tokens/s.
        ci95: Its distribution-free 95% confidence interval (None below 6 prompts).
    """

    cost: float
    ratio: float
    ci95: tuple[float, float] | None


@dataclass(frozen=True, slots=True)
class Comparison:
    """Curve a against curve b of one group at matched cost (see the module docstring).

    Attributes:
        setup: Setup label of the group.
        temperature: Temperature of the group.
        clock: The clock tokens/s were measured on (a key of `CLOCKS`).
        a: Curve name, e.g. "mixture k=5".
        b: Curve name, e.g. "fuzzy js k=5".
        levels: The cost levels compared, lowest first.
        ratio: Median over prompts of each prompt's geometric-mean ratio a/b over the levels.
        ci95: Its distribution-free 95% confidence interval (None below 6 prompts).
        prompts: Paired trials (prompt × repeat) it is computed from.
        at_costs: The paired ratio at each of `COST_LEVELS` that both curves reach.
    """

    setup: str
    temperature: float
    clock: str
    a: str
    b: str
    levels: list[Level]
    ratio: float
    ci95: tuple[float, float] | None
    prompts: int
    at_costs: list[Level]

    @property
    def winner(self) -> str | None:
        """a or b when the overall interval excludes 1, else None (no curve dominates)."""
        if self.ci95 is None:
            return None
        if self.ci95[0] > 1:
            return self.a
        if self.ci95[1] < 1:
            return self.b
        return None


@dataclass(frozen=True, slots=True)
class Verdict:
    """The comparisons of one group and the curve that leads them.

    Attributes:
        setup: Setup label.
        temperature: Temperature.
        clock: The clock of the comparisons (a key of `CLOCKS`).
        comparisons: Every pair of curves with a common cost range, each with the faster one
            (by overall median) as a.
        leader: The curve that is a in every comparison it takes part in (None when the curves
            cross, or when there is nothing to compare).
        dominates: Whether every one of the leader's overall intervals lies above 1.
    """

    setup: str
    temperature: float
    clock: str
    comparisons: list[Comparison]
    leader: str | None
    dominates: bool

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict (report.json's `curves` items), each comparison with its `winner`."""
        data = asdict(self)
        for item, comparison in zip(data["comparisons"], self.comparisons, strict=True):
            item["winner"] = comparison.winner
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        """The verdict back from its `to_dict` form, as report.json holds it (each comparison's
        `winner` is derived again, not read).

        Raises:
            KeyError: a field is missing.
            TypeError: a field has the wrong shape.
        """
        comparisons = [
            Comparison(
                **{
                    f.name: item[f.name]
                    for f in fields(Comparison)
                    if f.name not in ("levels", "ci95", "at_costs")
                },
                levels=_levels(item["levels"]),
                ci95=_interval(item["ci95"]),
                at_costs=_levels(item["at_costs"]),
            )
            for item in data["comparisons"]
        ]
        return cls(
            **{f.name: data[f.name] for f in fields(cls) if f.name != "comparisons"}, comparisons=comparisons
        )

    def lines(self) -> list[str]:
        """The verdict in words, then one line per comparison (for report.md and the terminal)."""
        where = f"{self.setup} · temperature {self.temperature:g} · {self.clock}"
        if self.leader is None:
            head = f"{where}: no curve is faster than every other at matched cost (the curves cross)"
        else:
            strength = (
                "dominates: every paired interval lies above 1"
                if self.dominates
                else "ahead by the median, not every interval above 1"
            )
            head = f"{where}: {self.leader} is the fastest curve at matched cost ({strength})"
        lines = [head]
        quantity = "τ" if self.clock == TAU else "tokens/s"
        for c in self.comparisons:
            at = "".join(f"; at {x.cost:g}: {_ratio_text(x.ratio, x.ci95)}" for x in c.at_costs)
            lines.append(
                f"- {c.a} vs {c.b}: {_ratio_text(c.ratio, c.ci95)} {quantity} at equal cost "
                f"({len(c.levels)} levels, {c.levels[0].cost:.4f}–{c.levels[-1].cost:.4f} nats/token, "
                f"{c.prompts} prompts){at}"
            )
        return lines


@dataclass(frozen=True, slots=True)
class _Curve:
    """One curve's points, the cost-0 anchor first: mean costs and per-trial tokens/s."""

    name: str
    costs: list[float]
    rates: list[dict[Trial, float]]

    def rate_at(self, cost: float, trial: Trial) -> float:
        """The trial's tokens/s, linearly interpolated at `cost` (within the curve's range)."""
        j = min(bisect.bisect_left(self.costs, cost), len(self.costs) - 1)
        if j == 0 or self.costs[j] == cost:
            return self.rates[j][trial]
        c0, c1 = self.costs[j - 1], self.costs[j]
        w = (cost - c0) / (c1 - c0)
        return (1 - w) * self.rates[j - 1][trial] + w * self.rates[j][trial]


def _curves(
    members: list[Summary], runs_of: dict[Configuration, list[Measurement]], rate: RunRate
) -> list[_Curve]:
    """The group's curves (each with its lossless method at its k and draft-length policy as the
    cost-0 point: exact SD, or hf-assisted for hf-ensemble), in configuration order.

    Points are ordered by cost; of points with equal cost only the first (nearest the lossless end:
    smallest T, largest w, or the anchor) is kept, so that interpolation is well defined (e.g. tv at
    small T accepts nothing and is exact).
    """
    lossless = {
        (s.config.method, s.config.draft_tokens, s.config.draft_policy): s
        for s in members
        if s.config.curve is None
    }
    by_curve: dict[str, list[Summary]] = defaultdict(list)
    for s in members:
        cost = s.quality.cost_per_token
        if s.config.curve is not None and cost is not None and math.isfinite(cost):
            by_curve[s.config.curve].append(s)
    curves = []
    for name, points in by_curve.items():
        first = points[0].config
        anchor = lossless.get((first.lossless, first.draft_tokens, first.draft_policy))
        if anchor is None:
            continue
        ordered = sorted(points, key=lambda s: (s.quality.cost_per_token, s.config.relaxation))
        costs: list[float] = [0.0]
        rates = [{trial_key(r): rate(r) for r in runs_of[anchor.config]}]
        for s in ordered:
            cost = s.quality.cost_per_token
            assert cost is not None
            if cost > costs[-1]:
                costs.append(cost)
                rates.append({trial_key(r): rate(r) for r in runs_of[s.config]})
        if len(costs) > 1:
            curves.append(_Curve(name, costs, rates))
    return curves


def _compare(setup: str, temperature: float, clock: str, a: _Curve, b: _Curve) -> Comparison | None:
    """a against b (see the module docstring), or None without a common cost range or trials."""
    top = min(a.costs[-1], b.costs[-1])
    levels = sorted({c for c in a.costs[1:] + b.costs[1:] if c <= top})
    trials = set.intersection(*(set(r) for r in a.rates + b.rates))
    trials = {t for t in trials if all(r[t] > 0 for r in a.rates + b.rates)}
    if not levels or not trials:
        return None
    ratios = [[a.rate_at(c, t) / b.rate_at(c, t) for c in levels] for t in sorted(trials)]
    matched = [Level(cost, *median_with_ci95([r[i] for r in ratios])) for i, cost in enumerate(levels)]
    ratio, ci95 = median_with_ci95([statistics.geometric_mean(r) for r in ratios])
    at_costs = [
        Level(cost, *median_with_ci95([a.rate_at(cost, t) / b.rate_at(cost, t) for t in sorted(trials)]))
        for cost in COST_LEVELS
        if cost <= top
    ]
    return Comparison(setup, temperature, clock, a.name, b.name, matched, ratio, ci95, len(trials), at_costs)


def compare_curves(summaries: list[Summary], runs: list[Measurement]) -> list[Verdict]:
    """One `Verdict` per (setup, temperature) group with two curves or more that share costs, and
    per clock of `CLOCKS`."""
    runs_of: dict[Configuration, list[Measurement]] = defaultdict(list)
    for run in runs:
        runs_of[run.config].append(run)
    groups: dict[tuple[Setup, float, int, float, float], list[Summary]] = defaultdict(list)
    for s in summaries:
        groups[s.config.group].append(s)
    verdicts = []
    for (setup, temperature, *_), members in groups.items():
        # The truncation, if any, is named with the setup (it is the same for the whole group).
        where = " · ".join([setup.label, *members[0].config.sampling.split(" · ")[1:]])
        for clock, make_rate in CLOCKS.items():
            curves = _curves(members, runs_of, make_rate(runs))
            comparisons = []
            for i, first in enumerate(curves):
                for second in curves[i + 1 :]:
                    comparison = _compare(where, temperature, clock, first, second)
                    if comparison is not None and comparison.ratio < 1:
                        # the faster curve first, so that every ratio reads "a is x times as fast as b"
                        comparison = _compare(where, temperature, clock, second, first)
                    if comparison is not None:
                        comparisons.append(comparison)
            if comparisons:
                verdicts.append(_verdict(where, temperature, clock, comparisons))
    return verdicts


def _verdict(setup: str, temperature: float, clock: str, comparisons: list[Comparison]) -> Verdict:
    """The leader: the curve that is the faster one in every comparison it takes part in."""
    names = {c.a for c in comparisons} | {c.b for c in comparisons}
    leaders = [n for n in names if all(c.a == n for c in comparisons if n in (c.a, c.b))]
    leader = leaders[0] if len(leaders) == 1 else None
    dominates = leader is not None and all(c.winner == leader for c in comparisons if c.a == leader)
    return Verdict(setup, temperature, clock, comparisons, leader, dominates)
