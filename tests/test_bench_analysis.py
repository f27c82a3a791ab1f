"""The bench's analysis on constructed measurements whose speeds and costs are known: paired
speed-ups and their intervals, curves compared at matched cost, report.json written and read back;
and the analysis stages load neither torch nor transformers. No model is loaded here.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsd_chat.bench import report, terminal
from fsd_chat.bench.advice import ADVICE_COST, advise
from fsd_chat.bench.curves import Verdict, compare_curves
from fsd_chat.bench.metrics import summarize
from fsd_chat.bench.records import Configuration, ForwardTally, Generation, Measurement, Setup
from fsd_chat.decoding.events import GenerationStats

ANALYSIS_MODULES = (
    "records",
    "sweep",
    "prompts",
    "stats",
    "metrics",
    "curves",
    "report",
    "plot",
    "terminal",
    "advice",
)
"""The bench modules that must load without torch or transformers."""
HEAVY = ("torch", "transformers")

SETUP = Setup("float32")
AUTOREGRESSIVE = Configuration(SETUP, 0.0, "autoregressive")
EXACT = Configuration(SETUP, 0.0, "exact", 4)
FUZZY = Configuration(SETUP, 0.0, "fuzzy", 4, "js", 0.2)
AR_SECONDS = [1.0 + 0.5 * prompt for prompt in range(9)]
"""Autoregressive seconds per prompt: prompts differ, so only a paired ratio is constant."""
EXACT_OVER_AR = [1.5, 2.0, 2.5, 1.8, 2.2, 3.3, 1.0, 1.6, 2.4]
"""Exact SD's tokens/s over autoregressive decoding's, per prompt; sorted: 1.0 1.5 1.6 1.8 2.0 2.2 2.4
2.5 3.3, so the median is 2.0 (the mean is not) and its 95% interval, order statistics 2 and 8 of 9,
is 1.5–2.5."""
FUZZY_OVER_EXACT = 1.25
"""Fuzzy SD's tokens/s over exact SD's, on every prompt."""


CURVE_EXACT = Configuration(SETUP, 1.0, "exact", 5)
A1, A2 = (
    Configuration(SETUP, 1.0, "mixture", 5, None, 0.1),
    Configuration(SETUP, 1.0, "mixture", 5, None, 0.3),
)
B1, B2 = Configuration(SETUP, 1.0, "fuzzy", 5, "js", 0.05), Configuration(SETUP, 1.0, "fuzzy", 5, "js", 0.2)
CURVE_COSTS = {CURVE_EXACT: 0.0, A1: 0.1, A2: 0.3, B1: 0.05, B2: 0.2}
"""Two curves from exact SD at k = 5, sampling: mixture at 2 budgets, fuzzy js at 2 thresholds."""
CURVE_SPEEDS = {CURVE_EXACT: 100.0, A1: 150.0, A2: 180.0, B1: 110.0, B2: 160.0}
FACTORS = [1.0, 0.5, 2.0, 1.5, 0.8, 1.2, 0.9]
"""Per-prompt speed factors: a slow prompt is slow for every configuration."""


def _measurement(
    config: Configuration, prompt: int, seconds: float, target_forwards: int, draft_forwards: int
) -> Measurement:
    """10 tokens in `seconds`, with the forward counts given; every target forward takes 10 ms and
    every draft forward 1 ms on the forward-work clock."""
    stats = GenerationStats(
        tokens=10, target_forwards=target_forwards, draft_forwards=draft_forwards, drafted=draft_forwards
    )
    target = ForwardTally(target_forwards + 1, 0.0, 10, 0.1)
    draft = ForwardTally(draft_forwards + 1, 0.0, 10, 0.01) if draft_forwards else ForwardTally()
    generation = Generation(list(range(10)), seconds, stats, target, draft)
    return Measurement(config, prompt, 0, [1], generation, 20.0, None)


def _speed_sweep() -> list[Measurement]:
    """Autoregressive decoding (10 target forwards), exact SD (4 target, 12 draft) and fuzzy SD
    (3 target, 12 draft) on 9 prompts, at the speeds of `EXACT_OVER_AR` and `FUZZY_OVER_EXACT`."""
    runs = []
    for prompt, (seconds, ratio) in enumerate(zip(AR_SECONDS, EXACT_OVER_AR, strict=True)):
        runs += [
            _measurement(AUTOREGRESSIVE, prompt, seconds, 10, 0),
            _measurement(EXACT, prompt, seconds / ratio, 4, 12),
            _measurement(FUZZY, prompt, seconds / ratio / FUZZY_OVER_EXACT, 3, 12),
        ]
    return runs


def test_speedups_are_paired_medians_with_their_intervals() -> None:
    autoregressive, exact, fuzzy = summarize([AUTOREGRESSIVE, EXACT, FUZZY], _speed_sweep())
    assert exact.speedup["autoregressive"] == pytest.approx(2.0)
    assert exact.speedup_ci95["autoregressive"] == pytest.approx((1.5, 2.5))
    assert fuzzy.speedup["exact"] == pytest.approx(FUZZY_OVER_EXACT)
    assert fuzzy.speedup_ci95["exact"] == pytest.approx((FUZZY_OVER_EXACT, FUZZY_OVER_EXACT))
    assert fuzzy.speedup["autoregressive"] == pytest.approx(2.0 * FUZZY_OVER_EXACT)
    assert fuzzy.speedup_ci95["autoregressive"] == pytest.approx(
        (1.5 * FUZZY_OVER_EXACT, 2.5 * FUZZY_OVER_EXACT)
    )
    assert "exact" not in autoregressive.speedup  # autoregressive decoding has no k to pair with
    # Forward work: 10 tokens / (target forwards × 10 ms + draft forwards × 1 ms), whatever the wall clock.
    assert exact.work_speedup["autoregressive"] == pytest.approx(0.1 / 0.052)
    assert fuzzy.work_speedup["exact"] == pytest.approx(0.052 / 0.042)
    assert fuzzy.work_speedup_ci95["exact"] == pytest.approx((0.052 / 0.042, 0.052 / 0.042))
    assert exact.mean_accepted_length == pytest.approx(2.5)


def test_the_decode_clock_leaves_the_prefill_out_so_a_longer_reply_is_not_faster() -> None:
    """Two methods decode at the same rate, 100 tokens/s after a 0.5 s prefill, but one writes 20%
    longer replies: on the wall clock, which shares the prefill among a reply's tokens, the longer
    replies look faster; on the decode clock they are not. A method whose first token was not seen
    (transformers' methods) has no decode figure."""
    prefill, rate = 0.5, 100.0
    longer = Configuration(SETUP, 0.0, "fuzzy", 4, "js", 0.2)

    def run(config: Configuration, prompt: int, tokens: int, first: float | None) -> Measurement:
        seconds = prefill + tokens / rate
        generation = Generation(
            list(range(tokens)), seconds, None, ForwardTally(), ForwardTally(), first_token_seconds=first
        )
        return Measurement(config, prompt, 0, [1], generation, 20.0, None)

    runs = []
    for prompt in range(9):
        tokens = 100 + 10 * prompt
        first = prefill + 1 / rate
        runs += [run(AUTOREGRESSIVE, prompt, tokens, first), run(longer, prompt, round(tokens * 1.2), first)]
        runs.append(run(EXACT, prompt, tokens, None))
    autoregressive, fuzzy, exact = summarize([AUTOREGRESSIVE, longer, EXACT], runs)
    assert fuzzy.speedup["autoregressive"] > 1.03
    assert fuzzy.decode_speedup["autoregressive"] == pytest.approx(1.0)
    assert fuzzy.decode_speedup_ci95["autoregressive"] == pytest.approx((1.0, 1.0))
    assert autoregressive.decode_tokens_per_second == pytest.approx(rate)
    assert autoregressive.time_to_first_token == pytest.approx(prefill + 1 / rate)
    assert exact.decode_tokens_per_second is None and exact.time_to_first_token is None
    assert "autoregressive" not in exact.decode_speedup and "autoregressive" in exact.speedup


@pytest.mark.slow
def test_analysis_modules_load_neither_torch_nor_transformers() -> None:
    script = (
        "import importlib, sys\n"
        f"for name in {ANALYSIS_MODULES!r}: importlib.import_module('fsd_chat.bench.' + name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_report_is_read_back_without_torch(tmp_path: Path) -> None:
    """report.json written from constructed measurements reads back into equal records, and a
    process that cannot import torch or transformers rebuilds report.md and the terminal's tables
    and plots from it."""
    runs = _speed_sweep() + _constructed_runs(
        lambda c, prompt: CURVE_SPEEDS[c] * FACTORS[prompt], CURVE_COSTS
    )
    summaries = summarize([AUTOREGRESSIVE, EXACT, FUZZY, *CURVE_COSTS], runs)
    verdicts = compare_curves(summaries, runs)
    # Every kind of figure is there to be read back: intervals, work speed-ups, curves.
    assert summaries[2].work_speedup_ci95 and verdicts[0].comparisons[0].ci95 is not None
    environment: dict[str, object] = {
        "packages": {"torch": "2", "transformers": None},
        "device": ["cpu"],
        "device_name": ["a CPU"],
        "torch_threads": 1,
        "cpu_count": 2,
        "scorer": "stories260K",
    }
    written = report.Report(environment, {"prompts": "x", "seed": 0}, False, summaries, verdicts)
    report.write_json(tmp_path / "report.json", written)
    report.write_markdown(tmp_path / "report.md", written, title="t", plot_name=None)
    assert report.read_json(tmp_path / "report.json") == written

    script = (
        "import sys; from pathlib import Path\n"
        "sys.modules['torch'] = sys.modules['transformers'] = None\n"
        "from rich.console import Console\n"
        "from fsd_chat.bench import report, terminal\n"
        "results = report.read_json(Path(sys.argv[1]) / 'report.json')\n"
        "report.write_markdown(Path(sys.argv[1]) / 'rebuilt.md', results, title='t', plot_name=None)\n"
        "terminal.show(Console(width=200, color_system=None), results.summaries)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    shown = io.StringIO()
    terminal.show(Console(width=200, color_system=None, file=shown), summaries)
    assert result.stdout == shown.getvalue()
    assert (tmp_path / "rebuilt.md").read_text() == (tmp_path / "report.md").read_text()


def _constructed_runs(
    speed: Callable[[Configuration, int], float], costs: dict[Configuration, float]
) -> list[Measurement]:
    """Runs of 7 prompts with known speed and cost: `speed(config, prompt)` tokens/s, 10 tokens,
    cost per token `costs[config]`."""
    runs = []
    for prompt in range(7):
        for config, cost in costs.items():
            stats = GenerationStats(tokens=10, cost=10 * cost, target_forwards=4)
            generation = Generation(
                [0] * 10, 10 / speed(config, prompt), stats, ForwardTally(), ForwardTally()
            )
            runs.append(Measurement(config, prompt, 0, [1], generation, 20.0, None))
    return runs


def test_curves_are_compared_at_matched_cost_from_the_data() -> None:
    configs = list(CURVE_COSTS)
    speeds, factors = CURVE_SPEEDS, FACTORS

    def verdict_of(speed: Callable[[Configuration, int], float]) -> Verdict:
        runs = _constructed_runs(speed, CURVE_COSTS)
        # The constructed runs time no forward passes, so the forward-work clock has nothing to
        # compare; every run has τ = 2.5, so on that clock only the order of the curves is arbitrary.
        verdicts = compare_curves(summarize(configs, runs), runs)
        assert [v.clock for v in verdicts] == ["wall clock", "τ"]
        assert all(c.ratio == pytest.approx(1.0) for c in verdicts[1].comparisons)
        return verdicts[0]

    verdict = verdict_of(lambda c, prompt: speeds[c] * factors[prompt])
    (comparison,) = verdict.comparisons
    assert (comparison.a, comparison.b) == ("mixture k=5", "fuzzy js k=5")
    # Common costs up to 0.2 (fuzzy's end): 0.05, 0.1, 0.2. mixture: 100 + 500·c up to 0.1, then
    # 150 + 150·(c − 0.1); fuzzy: 100 + 200·c up to 0.05, then 110 + (50 / 0.15)·(c − 0.05).
    expected = [125 / 110, 150 / (110 + 50 / 3), 165 / 160]
    assert [level.cost for level in comparison.levels] == pytest.approx([0.05, 0.1, 0.2])
    assert [level.ratio for level in comparison.levels] == pytest.approx(expected)
    geometric_mean = (expected[0] * expected[1] * expected[2]) ** (1 / 3)
    assert comparison.ratio == pytest.approx(geometric_mean) and comparison.prompts == 7
    # Paired by prompt: the prompts' factors cancel, so every prompt has the same ratio.
    assert comparison.ci95 == pytest.approx((geometric_mean, geometric_mean))
    assert verdict.leader == "mixture k=5" and verdict.dominates and comparison.winner == "mixture k=5"

    # The same costs with fuzzy faster: the verdict follows the data.
    slow_mixture = speeds | {A1: 105.0, A2: 120.0}
    verdict = verdict_of(lambda c, prompt: slow_mixture[c] * factors[prompt])
    assert verdict.leader == "fuzzy js k=5" and verdict.comparisons[0].b == "mixture k=5"

    # mixture faster on some prompts, slower on others: a leader by the median, but no dominance.
    verdict = verdict_of(lambda c, prompt: speeds[c] * (0.7 if c.method == "mixture" and prompt % 2 else 1.0))
    assert verdict.leader == "mixture k=5" and not verdict.dominates and verdict.comparisons[0].winner is None


def test_hf_ensemble_curve_starts_from_hf_assisted_and_is_quoted_at_round_costs() -> None:
    """transformers' hf-ensemble curve (through its weights w) starts at cost 0 from hf-assisted,
    not from exact SD; its costs come from the runs' recorded per-token costs; and the comparison
    quotes the paired ratio at 0.01, 0.02 and 0.05 nats/token."""
    hf, e1, e2 = (
        Configuration(SETUP, 1.0, "hf-assisted", 5),
        Configuration(SETUP, 1.0, "hf-ensemble", 5, None, 0.9),
        Configuration(SETUP, 1.0, "hf-ensemble", 5, None, 0.6),
    )
    costs = {CURVE_EXACT: 0.0, A1: 0.1, A2: 0.3, hf: 0.0, e1: 0.02, e2: 0.3}
    speeds = {CURVE_EXACT: 100.0, A1: 150.0, A2: 180.0, hf: 80.0, e1: 88.0, e2: 110.0}
    runs = []
    for prompt in range(7):
        for config, cost in costs.items():
            seconds = 10 / (speeds[config] * FACTORS[prompt])
            if config.method.startswith("hf-"):
                # As transformers' runs are: no step statistics, costs recorded per token (hf-ensemble).
                per_token = [cost] * 10 if config.method == "hf-ensemble" else None
                generation = Generation([0] * 10, seconds, None, ForwardTally(4), ForwardTally(), per_token)
            else:
                stats = GenerationStats(tokens=10, cost=10 * cost, target_forwards=4)
                generation = Generation([0] * 10, seconds, stats, ForwardTally(), ForwardTally())
            runs.append(Measurement(config, prompt, 0, [1], generation, 20.0, None))
    summaries = summarize(list(costs), runs)
    assert [s.quality.cost_per_token for s in summaries] == pytest.approx(list(costs.values()))
    assert [s.config.label for s in summaries][-2:] == ["hf-ensemble w=0.9 k=5", "hf-ensemble w=0.6 k=5"]
    wall = next(v for v in compare_curves(summaries, runs) if v.clock == "wall clock")
    (comparison,) = wall.comparisons
    assert (comparison.a, comparison.b) == ("mixture k=5", "hf-ensemble k=5")
    # mixture: 100 + 500·c up to 0.1; hf-ensemble: 80 + 400·c up to 0.02, then 88 + (22 / 0.28)·(c − 0.02).
    expected = {0.01: 105 / 84, 0.02: 110 / 88, 0.05: 125 / (88 + 22 * 0.03 / 0.28)}
    assert [level.cost for level in comparison.at_costs] == list(expected)
    assert [level.ratio for level in comparison.at_costs] == pytest.approx(list(expected.values()))
    assert comparison.at_costs[1].ci95 == pytest.approx((110 / 88, 110 / 88))


def test_a_curve_starts_from_exact_sd_under_its_own_draft_policy() -> None:
    """mixture under the `latency` policy starts from exact SD under `latency`, not from fixed-k exact SD."""
    exact_fixed, exact_latency = CURVE_EXACT, Configuration(SETUP, 1.0, "exact", 5, draft_policy="latency")
    mixture_fixed = Configuration(SETUP, 1.0, "mixture", 5, None, 0.02)
    mixture_latency = Configuration(SETUP, 1.0, "mixture", 5, None, 0.02, "latency")
    costs = {exact_fixed: 0.0, mixture_fixed: 0.02, exact_latency: 0.0, mixture_latency: 0.02}
    speeds = {exact_fixed: 100.0, mixture_fixed: 120.0, exact_latency: 50.0, mixture_latency: 120.0}
    runs = _constructed_runs(lambda c, prompt: speeds[c] * FACTORS[prompt], costs)
    wall = next(v for v in compare_curves(summarize(list(costs), runs), runs) if v.clock == "wall clock")
    (comparison,) = wall.comparisons
    # At 0.01, halfway from each curve's own anchor: fixed 110, latency 85.
    assert (comparison.a, comparison.b) == ("mixture k=5", "mixture k=5 latency")
    assert comparison.at_costs[0].cost == 0.01 and comparison.at_costs[0].ratio == pytest.approx(110 / 85)


def test_mean_k_is_zero_for_a_policy_that_never_drafted() -> None:
    """A run that drafted nothing (a draft policy paused throughout: a real mapped pair whose draft
    is as slow as its target) has mean k 0 and no acceptance rate; target-only decoding has no mean
    k at all."""
    goodput = Configuration(SETUP, 0.0, "exact", 3, draft_policy="goodput")
    runs = [_measurement(AUTOREGRESSIVE, prompt, 1.0, 10, 0) for prompt in range(3)] + [
        _measurement(goodput, prompt, 1.0, 10, 0) for prompt in range(3)
    ]
    autoregressive, paused = summarize([AUTOREGRESSIVE, goodput], runs)
    assert paused.draft_tokens_per_step == 0.0 and paused.acceptance_rate is None
    assert autoregressive.draft_tokens_per_step is None


def test_work_clock_times_each_draft_policy_by_its_own_forwards() -> None:
    """goodput's target-only steps are 1-token forwards (5 ms here, as target-only decoding's), fixed
    k's are verifies (10 ms): pooled at the same k, goodput's steps would be charged 7.5 ms and its
    forward-work ratio to target-only decoding would read 0.67 for equal work."""
    goodput = Configuration(SETUP, 0.0, "exact", 4, draft_policy="goodput")
    one_token = ForwardTally(11, 0.0, 10, 0.05)
    runs = []
    for prompt in range(3):
        runs += [
            _measurement(EXACT, prompt, 1.0, 4, 12),
            Measurement(
                AUTOREGRESSIVE,
                prompt,
                0,
                [1],
                Generation(
                    list(range(10)),
                    1.0,
                    GenerationStats(tokens=10, target_forwards=10),
                    one_token,
                    ForwardTally(),
                ),
                20.0,
                None,
            ),
            Measurement(
                goodput,
                prompt,
                0,
                [1],
                Generation(
                    list(range(10)),
                    1.0,
                    GenerationStats(tokens=10, target_forwards=10),
                    one_token,
                    ForwardTally(),
                ),
                20.0,
                None,
            ),
        ]
    (paused,) = summarize([AUTOREGRESSIVE, EXACT, goodput], runs)[2:]
    assert paused.work_speedup["autoregressive"] == pytest.approx(1.0)


ADVICE_AR = Configuration(SETUP, 1.0, "autoregressive")
ADVICE_EXACT = Configuration(SETUP, 1.0, "exact", 5, draft_policy="goodput")
ADVICE_CHEAP = Configuration(SETUP, 1.0, "mixture", 5, None, 0.01, "goodput")
ADVICE_COSTLY = Configuration(SETUP, 1.0, "fuzzy", 5, "js", 0.4, "goodput")
ADVICE_COSTS = {
    ADVICE_AR: 0.0,
    ADVICE_EXACT: 0.0,
    ADVICE_CHEAP: ADVICE_COST / 2,
    ADVICE_COSTLY: 4 * ADVICE_COST,
}
"""Target-only decoding, exact SD, a lossy setting within the advice's cost and one beyond it."""


def test_the_advice_is_the_fastest_setting_within_its_cost() -> None:
    speeds = {ADVICE_AR: 100.0, ADVICE_EXACT: 120.0, ADVICE_CHEAP: 150.0, ADVICE_COSTLY: 300.0}
    runs = _constructed_runs(lambda c, prompt: speeds[c] * FACTORS[prompt], ADVICE_COSTS)
    advice = advise(summarize(list(ADVICE_COSTS), runs))
    # The costly setting is twice as fast, but beyond the stated cost: the cheap one, as its row says.
    assert advice.startswith(
        "advice: run `--rule mixture -T 0.01 -k 5 --draft-policy goodput`: 1.50× [1.50–1.50]"
    )
    assert f"at {ADVICE_COST / 2:.4f} nats/token" in advice and f"within {ADVICE_COST:g})" in advice


def test_the_advice_is_the_target_alone_when_nothing_beats_it() -> None:
    speeds = {ADVICE_AR: 100.0, ADVICE_EXACT: 90.0, ADVICE_CHEAP: 95.0, ADVICE_COSTLY: 300.0}
    runs = _constructed_runs(lambda c, prompt: speeds[c] * FACTORS[prompt], ADVICE_COSTS)
    advice = advise(summarize(list(ADVICE_COSTS), runs))
    assert advice.startswith("advice: run the target alone (`--autoregressive`)")
    assert "(fastest: mixture T=0.01 k=5 goodput, 0.95×" in advice


def test_the_advice_needs_target_only_decoding() -> None:
    speeds = {ADVICE_EXACT: 120.0, ADVICE_CHEAP: 150.0}
    runs = _constructed_runs(
        lambda c, prompt: speeds[c] * FACTORS[prompt], {c: ADVICE_COSTS[c] for c in speeds}
    )
    assert advise(summarize(list(speeds), runs)).startswith("advice: none")


def test_the_terminal_table_leaves_out_columns_that_do_not_fit() -> None:
    """At 160 columns and narrower, no line is wider than the console and no figure is cut: the
    columns left out are named, the most important (method, dial, tok/s, ×AR, cost) kept."""
    runs = _speed_sweep() + _constructed_runs(
        lambda c, prompt: CURVE_SPEEDS[c] * FACTORS[prompt], CURVE_COSTS
    )
    summaries = summarize([AUTOREGRESSIVE, EXACT, FUZZY, *CURVE_COSTS], runs)
    wide, none_left_out = terminal.results_table(summaries[:3], "t", None)
    assert not none_left_out
    for width in (160, 110):
        console = Console(width=width, record=True)
        table, left_out = terminal.results_table(summaries[:3], "t", width)
        console.print(table)
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width and "…" not in text
        headers = _headers(table)
        assert {"method", "tok/s (median [q1–q3])", "×AR", "cost/tok (±95%)"} <= set(headers)
        assert left_out and not set(left_out) & set(headers)
        assert set(headers) | set(left_out) == set(_headers(wide))


def _headers(table: Table) -> list[str]:
    """A rich table's headers as shown (they are markup, escaped)."""
    return [Text.from_markup(str(column.header)).plain for column in table.columns]
