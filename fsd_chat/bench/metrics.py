"""Per-configuration summaries of a sweep: speed, acceptance, forward times, quality; and the
trade-off's points and Pareto front that the plot and the terminal draw. Torch-free: it reads
`records` only.

Terms follow the speculative-decoding literature (Leviathan et al. 2023; Holsman et al. 2025):
acceptance rate = accepted / drafted tokens; mean accepted length τ = tokens per target forward.
Speed-ups are paired: the median over prompts of the ratio of two configurations' tokens/s on the
same prompt (same models, same sampling), so drift between prompts cancels.

For hf-assisted, transformers reports no step statistics: target forwards are counted by the hooks
(every one is a verification), drafted tokens = draft forwards (one token each), and accepted
tokens = generated tokens − target forwards (each step emits its accepted tokens plus one).

Speed is measured on three clocks. Wall clock (`tokens_per_second`, `speedup`) is what a user sees,
the prompt's prefill included, but on a machine shared with other processes one run can wait seconds
for a core; and it favours longer replies, which share the prefill among more tokens: a lossy rule
that changes a reply's length moves it with no change in decoding speed (on summaries of the default
model, 2026-11-28, replies 22% longer than the target alone's ran 1.03× on it and 1.02× decoding).
The decode clock (`decode_tokens_per_second`, `decode_speedup`) leaves the prefill out: a reply's
tokens after its first over the wall-clock seconds after its first (the inverse of the time per
output token), for every method whose first token is seen (`Generation.first_token_seconds`). Forward work
(`work_speedup`) is immune to that: each run's tokens / (its target forwards × t_target + its draft
forwards × t_draft), where t_target and t_draft are the median per-forward times over all runs of
the same setup, temperature, k (the verify width) and draft policy, so every configuration of that kind is charged
the same price per forward and only the forward counts differ. It leaves out time outside forward
passes (1–3% in fsd-chat's decoders), so it cannot see a rule's own arithmetic.

Quality's main figure is the cost per token (nats; `Token.cost` in fsd_chat/decoding/acceptance.py):
the KL divergence of each emitted token's law from the target's (greedy: the log-probability regret),
computed exactly from the distributions at each position, so a configuration's mean over prompts
varies only with which positions the replies visited. The target NLL change is kept beside it; it
is the difference of two large, noisy sums and needs many more prompts to resolve the same loss.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from fsd_chat.bench.records import (
    BASELINES,
    TARGET_ONLY,
    UNCOUNTED_DRAFTS,
    UNMETERED,
    Configuration,
    ConfigurationRecord,
    Measurement,
    Method,
    ReplyProfile,
    Setup,
)
from fsd_chat.bench.stats import Spread, mean_ci95, median_with_ci95, paired_ratios

SPEEDUP_BASELINES: tuple[Method, ...] = tuple(m for m in BASELINES if m != "hf-ensemble")
"""The methods every configuration's speed-up is paired against (when the sweep ran them):
the lossless baselines (hf-ensemble, a curve through its weights, is compared at matched cost in
`curves`)."""
NLL_REFERENCES: tuple[Method, ...] = ("autoregressive", "exact")
"""The methods target_nll_change is relative to, the first one the sweep ran."""


@dataclass(frozen=True, slots=True)
class Quality:
    """Quality of a configuration's replies.

    Attributes:
        cost_per_token: Mean over prompts of each prompt's cost per generated token (nats: the KL
            divergence of the tokens' laws from the target's, summed over the reply and divided by
            its tokens; greedy: log-probability regret). Exactly 0 for autoregressive decoding and
            exact SD; hf-assisted is exact speculative sampling too and counts 0 by construction
            (transformers reports no per-token laws, so it is not measured); hf-ensemble's is
            computed from the laws its verification used (`bench.methods`).
        cost_per_token_ci95: Half-width of its 95% confidence interval (normal approximation over
            prompts); None with fewer than 2 prompts.
        target_nll: Mean target negative log-likelihood per generated token (nats).
        target_nll_change: Relative change of target_nll against the reference (the group's
            autoregressive run, else exact SD with the same k); 0.02 = 2% worse.
        target_nll_change_ci95: Half-width of its 95% confidence interval (normal approximation
            over prompts of the paired per-prompt differences); None with fewer than 2 prompts.
        reference: The method target_nll_change is relative to.
        accuracy: Share of correct answers (sets with answers only).
        greedy_agreement: Mean over prompts of the share of the reply equal to target-only greedy
            output before the first difference (greedy runs with an autoregressive baseline only).
    """

    target_nll: float | None
    cost_per_token: float | None = None
    cost_per_token_ci95: float | None = None
    target_nll_change: float | None = None
    target_nll_change_ci95: float | None = None
    reference: str | None = None
    accuracy: float | None = None
    greedy_agreement: float | None = None


@dataclass(frozen=True, slots=True)
class Summary:
    """Everything measured for one configuration (the items of report.json's `configs`).

    Attributes:
        config: The configuration.
        runs: Measured generations.
        tokens: Generated tokens in all of them.
        tokens_per_second: Per-run generated tokens / wall-clock seconds of the call (prefill
            included, the same clock for every method), over runs.
        decode_tokens_per_second: Median over runs of the decode clock (`decode_rate`: tokens
            after the first / wall-clock seconds after it); None where no run saw its first token
            (transformers' methods).
        speedup: Paired median tokens/s ratio against each baseline of the same group (and k).
        speedup_ci95: Distribution-free 95% confidence interval of each of those medians (from 6
            prompts × repeats up; see `stats.median_ci95`).
        work_speedup: The same paired medians on the forward-work clock (see the module docstring).
        work_speedup_ci95: Their intervals.
        decode_speedup: The same paired medians on the decode clock (`decode_rate`).
        decode_speedup_ci95: Their intervals.
        time_to_first_token: Median over runs of the seconds from the call to the first token
            (the prompt's prefill and the first step); None as for `decode_tokens_per_second`.
        mean_accepted_length: τ, tokens per target forward.
        draft_tokens_per_step: Mean k: drafted tokens per target forward (0 for a method that
            drafted nothing; None for those whose drafts are not counted, `UNCOUNTED_DRAFTS`).
        acceptance_rate: Accepted / drafted draft tokens (None without drafting).
        fuzzy_share: Share of tokens kept by the relaxed test at a cost > 0, the `draft-fuzzy`
            tokens (None without drafting).
        target_forwards_per_token: Target forwards / tokens (1/τ).
        draft_forwards_per_token: Draft forwards / tokens.
        target_forward_seconds: Mean seconds of one target forward (prefill excluded).
        draft_forward_seconds: Mean seconds of one draft forward (prefill excluded).
        limit_tokens_per_second: The analytic limit with zero overhead, median over runs of
            tokens / (target forwards × mean target forward seconds + draft forwards × mean draft
            forward seconds), each run with its own measured times (comparable to tokens_per_second).
        overhead_share: fsd-chat's other_seconds / decode seconds (acceptance, rollback,
            detokenisation); None for hf-assisted.
        outside_forward_share: Share of wall-clock time outside the models' forward passes
            (sampling included), for every method alike but those run unmetered (`UNMETERED`: None).
        prefill_seconds: Mean prompt prefill seconds (fsd-chat's decoders only).
        quality: See `Quality`.
        status: "ok", or "cut": it ran past its time budget and was stopped (its figures come
            from the replies it finished).
        cut_after_seconds: That budget, for its warm-up and for its measured replies (None: none).
        warmup_seconds: Seconds of its untimed warm-up reply, compilation included.
        compiled_graphs: Graphs torch.compile compiled during its measured runs (0 expected).
        profile: One more reply under torch.profiler (`bench --profile`; None without).
    """

    config: Configuration
    runs: int
    tokens: int
    tokens_per_second: Spread
    decode_tokens_per_second: float | None
    speedup: dict[str, float]
    speedup_ci95: dict[str, tuple[float, float]]
    work_speedup: dict[str, float]
    work_speedup_ci95: dict[str, tuple[float, float]]
    mean_accepted_length: float
    draft_tokens_per_step: float | None
    acceptance_rate: float | None
    fuzzy_share: float | None
    target_forwards_per_token: float
    draft_forwards_per_token: float
    target_forward_seconds: float | None
    draft_forward_seconds: float | None
    limit_tokens_per_second: float | None
    overhead_share: float | None
    outside_forward_share: float | None
    prefill_seconds: float | None
    quality: Quality
    status: str = "ok"
    cut_after_seconds: float | None = None
    warmup_seconds: float | None = None
    compiled_graphs: int | None = None
    profile: ReplyProfile | None = None
    decode_speedup: dict[str, float] = field(default_factory=dict)
    decode_speedup_ci95: dict[str, tuple[float, float]] = field(default_factory=dict)
    time_to_first_token: float | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict: the configuration's fields flattened in with its `label`, `setup` and
        `sampling` for people, tokens/s as its median with a separate `tokens_per_second_spread`."""
        data = asdict(self)
        config = data.pop("config")
        setup = config.pop("setup")
        spread = data.pop("tokens_per_second")
        return {
            **config,
            **setup,
            "label": self.config.label,
            "setup": self.config.setup_label,
            "sampling": self.config.sampling,
            "tokens_per_second": spread["median"],
            "tokens_per_second_spread": spread,
            **data,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        """The summary back from its `to_dict` form, as report.json holds it (JSON's lists become
        the intervals' tuples again; figures JSON could not hold, infinities and NaN, come back
        None).

        Raises:
            KeyError: a field is missing.
            TypeError: a field has the wrong shape.
        """
        setup = Setup(
            **{f.name: data[f.name] for f in fields(Setup) if f.name in data or f.default is MISSING}
        )
        # A field with a default may be missing: report.json written before it existed.
        config = Configuration(
            setup=setup,
            **{
                f.name: data[f.name] if f.name in data or f.default is MISSING else f.default
                for f in fields(Configuration)
                if f.name != "setup"
            },
        )
        own = {
            f.name: data[f.name]
            for f in fields(cls)
            # A field with a default may be missing: report.json written before it existed.
            if f.name not in ("config", "tokens_per_second") and (f.name in data or f.default is MISSING)
        }
        return cls(
            **own
            | {
                "config": config,
                "tokens_per_second": Spread(**data["tokens_per_second_spread"]),
                "speedup_ci95": _intervals(data["speedup_ci95"]),
                "work_speedup_ci95": _intervals(data["work_speedup_ci95"]),
                "decode_speedup_ci95": _intervals(data.get("decode_speedup_ci95", {})),
                "quality": Quality(**data["quality"]),
            }
        )


def _intervals(data: Mapping[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Confidence intervals by baseline, from JSON's [low, high] lists."""
    return {method: (low, high) for method, (low, high) in data.items()}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _mean_forward_seconds(seconds: Iterable[float], calls: Iterable[int]) -> float | None:
    total_calls = sum(calls)
    return sum(seconds) / total_calls if total_calls else None


def run_rate(run: Measurement) -> float:
    """Generated tokens / wall-clock seconds of one run (0.0 for a run that took no time)."""
    return len(run.generation.token_ids) / run.generation.seconds if run.generation.seconds > 0 else 0.0


def decode_rate(run: Measurement) -> float | None:
    """The decode clock of one run (see the module docstring): tokens after the first / wall-clock
    seconds after the first token; None without a first-token time or a second token."""
    generation = run.generation
    first = generation.first_token_seconds
    if first is None or len(generation.token_ids) < 2 or generation.seconds <= first:
        return None
    return (len(generation.token_ids) - 1) / (generation.seconds - first)


def tau_rate(run: Measurement) -> float:
    """Tokens per target forward of one run, τ (0.0 for a run without one)."""
    forwards = _Counts.of(run).target
    return len(run.generation.token_ids) / forwards if forwards else 0.0


def trial_key(run: Measurement) -> tuple[int, int]:
    """(prompt, repeat): runs of different configurations with the same key are paired (same
    prompt, same seed)."""
    return (run.prompt, run.repeat)


def per_prompt(pairs: Iterable[tuple[int, float]]) -> list[float]:
    """The mean of each prompt's values, from (prompt, value) pairs: repeats of a prompt reuse its
    seed, so they are one observation, not several independent ones."""
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for prompt, value in pairs:
        by_prompt[prompt].append(value)
    return [statistics.fmean(v) for v in by_prompt.values()]


def _cost_per_token(run: Measurement) -> float:
    """The run's cost per token (nats): fsd-chat's own, hf-ensemble's recorded costs, or 0 for
    hf-assisted, which is lossless (see `Quality`)."""
    g = run.generation
    if g.stats is not None:
        return g.stats.cost_per_token
    if g.costs:
        return statistics.fmean(g.costs)
    return 0.0


def _reference(config: Configuration, method: Method) -> Configuration:
    """The baseline `method` that `config` is compared with (same group; same k, fixed, for SD
    baselines but hf-assisted-default, which drafts as transformers decides)."""
    k = None if method in (*TARGET_ONLY, "hf-assisted-default") else config.draft_tokens
    return replace(
        config, method=method, draft_tokens=k, divergence=None, threshold=None, draft_policy="fixed"
    )


@dataclass(frozen=True, slots=True)
class _Counts:
    """Forward passes and acceptance counts of one run (see the module docstring for hf-assisted)."""

    target: int
    draft: int
    drafted: int
    accepted: int
    fuzzy: int

    @classmethod
    def of(cls, run: Measurement) -> _Counts:
        g = run.generation
        if g.stats is None:
            return cls(
                g.target.calls, g.draft.calls, g.draft.calls, max(len(g.token_ids) - g.target.calls, 0), 0
            )
        s = g.stats
        return cls(
            s.target_forwards,
            s.draft_forwards,
            s.drafted,
            s.accepted_exact + s.accepted_fuzzy,
            s.accepted_fuzzy,
        )


def _limit(run: Measurement, counts: _Counts) -> float | None:
    """Zero-overhead tokens/s of one run: its forward counts × its mean forward times."""
    g = run.generation
    seconds = 0.0
    for tally, calls in ((g.target, counts.target), (g.draft, counts.draft)):
        if calls and tally.decode_calls:
            seconds += calls * tally.decode_seconds / tally.decode_calls
    return len(g.token_ids) / seconds if seconds > 0 else None


RunRate = Callable[[Measurement], float]
"""A clock: tokens/s of one run."""


def _work_key(config: Configuration) -> tuple[object, ...]:
    return (*config.group, config.draft_tokens, config.draft_policy)


def work_rate(runs: list[Measurement]) -> RunRate:
    """The forward-work clock of a set of runs: tokens / (target forwards × t_target + draft
    forwards × t_draft), with t the median over the runs of the same setup, temperature, k and draft policy of
    each run's mean per-forward decode seconds (see the module docstring). Runs under different draft
    policies do not share t: a policy that chooses k per step (goodput's target-only steps) runs
    forwards of other widths than fixed k's."""
    per_forward: dict[tuple[object, ...], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for run in runs:
        g, c = run.generation, run.config
        for tally, times in zip((g.target, g.draft), per_forward[_work_key(c)], strict=True):
            if tally.decode_calls:
                times.append(tally.decode_seconds / tally.decode_calls)
    medians = {
        key: tuple(statistics.median(times) if times else 0.0 for times in pair)
        for key, pair in per_forward.items()
    }

    def rate(run: Measurement) -> float:
        counts = _Counts.of(run)
        t_target, t_draft = medians[_work_key(run.config)]
        seconds = counts.target * t_target + counts.draft * t_draft
        return len(run.generation.token_ids) / seconds if seconds > 0 else 0.0

    return rate


def _nll_change(
    runs: list[Measurement], reference: list[Measurement], nll: float | None
) -> tuple[float | None, float | None]:
    ref_tokens = sum(len(r.generation.token_ids) for r in reference)
    if nll is None or not ref_tokens:
        return None, None
    ref_nll = sum(r.nll for r in reference) / ref_tokens
    if ref_nll <= 0:
        return None, None
    ref_by_trial = {trial_key(r): r for r in reference}
    diffs = per_prompt(
        (r.prompt, r.nll / len(r.generation.token_ids) - ref.nll / len(ref.generation.token_ids))
        for r in runs
        if (ref := ref_by_trial.get(trial_key(r))) is not None
        and r.generation.token_ids
        and ref.generation.token_ids
    )
    half = mean_ci95(diffs)[1] if diffs else None
    return (nll - ref_nll) / ref_nll, None if half is None else half / ref_nll


def greedy_agreement(reply_ids: list[int], reference_ids: list[int]) -> float:
    """The share of a reply equal to the target's greedy reply before the first differing token:
    common prefix length / the longer reply's length (1.0 when both are empty). After one differing
    token the two continue different contexts, so later coincidences say nothing."""
    longest = max(len(reply_ids), len(reference_ids))
    if longest == 0:
        return 1.0
    prefix = next(
        (i for i, (a, b) in enumerate(zip(reply_ids, reference_ids, strict=False)) if a != b),
        min(len(reply_ids), len(reference_ids)),
    )
    return prefix / longest


def _quality(
    config: Configuration, runs: list[Measurement], by_config: dict[Configuration, list[Measurement]]
) -> Quality:
    tokens = sum(len(r.generation.token_ids) for r in runs)
    nll = sum(r.nll for r in runs) / tokens if tokens else None
    reference = next(
        (
            method
            for method in NLL_REFERENCES
            if by_config.get(_reference(config, method)) and _reference(config, method) != config
        ),
        None,
    )
    change = ci = None
    if reference is not None:
        change, ci = _nll_change(runs, by_config[_reference(config, reference)], nll)
    elif config.method in NLL_REFERENCES:
        change = 0.0
    checked = [r.correct for r in runs if r.correct is not None]
    agreement = None
    greedy_reference = by_config.get(_reference(config, "autoregressive"), [])
    if config.temperature == 0 and greedy_reference:
        ref_ids = {trial_key(r): r.generation.token_ids for r in greedy_reference}
        scores = [
            greedy_agreement(r.generation.token_ids, ref_ids[trial_key(r)])
            for r in runs
            if trial_key(r) in ref_ids
        ]
        agreement = statistics.fmean(scores) if scores else None
    cost, cost_ci = mean_ci95(per_prompt((r.prompt, _cost_per_token(r)) for r in runs))
    return Quality(
        target_nll=nll,
        cost_per_token=cost,
        cost_per_token_ci95=cost_ci,
        target_nll_change=change,
        target_nll_change_ci95=ci,
        reference=reference,
        accuracy=statistics.fmean(checked) if checked else None,
        greedy_agreement=agreement,
    )


def _speedups(
    config: Configuration,
    runs: list[Measurement],
    by_config: dict[Configuration, list[Measurement]],
    rate: Callable[[Measurement], float | None],
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Paired median tokens/s ratio on the clock `rate` against each baseline, with intervals (runs
    the clock has no figure for, None, are left out)."""

    def rates(of: list[Measurement]) -> dict[tuple[int, int], float]:
        return {trial_key(r): value for r in of if (value := rate(r)) is not None}

    speedups: dict[str, float] = {}
    intervals: dict[str, tuple[float, float]] = {}
    mine = rates(runs)
    for method in SPEEDUP_BASELINES:
        reference = by_config.get(_reference(config, method))
        if not reference:
            continue
        ratios = paired_ratios(mine, rates(reference))
        if ratios:
            speedups[method], interval = median_with_ci95(ratios)
            if interval is not None:
                intervals[method] = interval
    return speedups, intervals


def summarize(
    configs: list[Configuration],
    runs: list[Measurement],
    records: Mapping[Configuration, ConfigurationRecord] | None = None,
    cut_after: float | None = None,
) -> list[Summary]:
    """One `Summary` per configuration that has at least one run, in the configurations' order,
    with its warm-up, compilation and cut from the sweep's `records` (under the budget `cut_after`)."""
    by_config: dict[Configuration, list[Measurement]] = defaultdict(list)
    for run in runs:
        by_config[run.config].append(run)
    work = work_rate(runs)
    summaries = []
    for config in configs:
        mine = by_config.get(config)
        if not mine:
            continue
        tokens = sum(len(r.generation.token_ids) for r in mine)
        counts = [_Counts.of(r) for r in mine]
        target_forwards = sum(c.target for c in counts)
        draft_forwards = sum(c.draft for c in counts)
        drafted = sum(c.drafted for c in counts)
        limits = [x for r, c in zip(mine, counts, strict=True) if (x := _limit(r, c)) is not None]
        t_target = _mean_forward_seconds(
            (r.generation.target.decode_seconds for r in mine),
            (r.generation.target.decode_calls for r in mine),
        )
        t_draft = _mean_forward_seconds(
            (r.generation.draft.decode_seconds for r in mine), (r.generation.draft.decode_calls for r in mine)
        )
        engine = [r.generation.stats for r in mine if r.generation.stats is not None]
        speedups, intervals = _speedups(config, mine, by_config, run_rate)
        work_speedups, work_intervals = _speedups(config, mine, by_config, work)
        decode_speedups, decode_intervals = _speedups(config, mine, by_config, decode_rate)
        decode_rates = [x for r in mine if (x := decode_rate(r)) is not None]
        first_tokens = [f for r in mine if (f := r.generation.first_token_seconds) is not None]
        wall = sum(r.generation.seconds for r in mine)
        metered = sum(r.generation.target.seconds + r.generation.draft.seconds for r in mine)
        summaries.append(
            Summary(
                config=config,
                runs=len(mine),
                tokens=tokens,
                tokens_per_second=Spread.of([run_rate(r) for r in mine]),
                decode_tokens_per_second=statistics.median(decode_rates) if decode_rates else None,
                decode_speedup=decode_speedups,
                decode_speedup_ci95=decode_intervals,
                time_to_first_token=statistics.median(first_tokens) if first_tokens else None,
                speedup=speedups,
                speedup_ci95=intervals,
                work_speedup=work_speedups,
                work_speedup_ci95=work_intervals,
                mean_accepted_length=_ratio(tokens, target_forwards) or 0.0,
                draft_tokens_per_step=None
                if config.method in UNCOUNTED_DRAFTS
                else _ratio(drafted, target_forwards) or 0.0,
                acceptance_rate=_ratio(sum(c.accepted for c in counts), drafted),
                fuzzy_share=(_ratio(sum(c.fuzzy for c in counts), tokens) or 0.0) if drafted else None,
                target_forwards_per_token=_ratio(target_forwards, tokens) or 0.0,
                draft_forwards_per_token=_ratio(draft_forwards, tokens) or 0.0,
                target_forward_seconds=t_target,
                draft_forward_seconds=t_draft,
                limit_tokens_per_second=statistics.median(limits) if limits else None,
                overhead_share=_ratio(
                    sum(s.other_seconds for s in engine), sum(s.decode_seconds for s in engine)
                )
                if engine
                else None,
                outside_forward_share=None
                if config.method in UNMETERED
                else max(1.0 - metered / wall, 0.0)
                if wall > 0
                else 0.0,
                prefill_seconds=statistics.fmean(s.prefill_seconds for s in engine) if engine else None,
                quality=_quality(config, mine, by_config),
                **_record_fields(records.get(config) if records else None, cut_after),
            )
        )
    return summaries


def _record_fields(record: ConfigurationRecord | None, cut_after: float | None) -> dict[str, Any]:
    """A summary's fields from the sweep's record of its configuration (none without one)."""
    if record is None:
        return {}
    return {
        "status": "cut" if record.cut else "ok",
        "cut_after_seconds": cut_after,
        "warmup_seconds": record.warmup_seconds,
        "compiled_graphs": record.compiled_graphs,
        "profile": record.profile,
    }


Speed = Callable[[Summary], float | None]
"""A summary's speed on some axis (None: it has none there)."""


def trade_off_points(
    summaries: list[Summary], speed: Speed = lambda s: s.tokens_per_second.median
) -> list[tuple[Summary, float, float]]:
    """(summary, speed, cost per token) of every summary whose speed and finite cost are known."""
    return [
        (s, v, cost)
        for s in summaries
        if (cost := s.quality.cost_per_token) is not None
        and math.isfinite(cost)
        and (v := speed(s)) is not None
    ]
