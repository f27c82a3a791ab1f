"""report.json (machine-readable, and read back by `read_json`) and report.md (for people), and the
table rows both share with the terminal. Torch-free: a report.json is summarised again without
loading torch or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsd_chat.bench.curves import Verdict
from fsd_chat.bench.metrics import SPEEDUP_BASELINES, Summary
from fsd_chat.support.text import to_json

Render = Callable[[Any, Mapping[str, Any]], str]
"""How a column writes its field's value, given the value and the whole `configs` item (for an
interval kept in another field)."""


def _at(item: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path of a report.json `configs` item, a field or a field's key
    ("quality.cost_per_token", "speedup.llama.cpp": split at the first dot only, as a baseline's
    name may hold one); a missing key of a by-baseline map, as "speedup.hf-assisted" when it did
    not run, is None."""
    name, _, key = path.partition(".")
    value = item.get(name)
    return value.get(key) if key and value is not None else value


def _num(fmt: str) -> Render:
    return lambda value, _item: "–" if value is None else format(value, fmt)


def _text(value: Any, _item: Mapping[str, Any]) -> str:
    return "–" if value is None else str(value)


def _spread(_value: Any, item: Mapping[str, Any]) -> str:
    spread = item["tokens_per_second_spread"]
    return f"{spread['median']:.1f} [{spread['q1']:.1f}–{spread['q3']:.1f}]"


def _policy(value: Any, item: Mapping[str, Any]) -> str:
    # transformers' and llama.cpp's methods and target-only decoding have no draft-length policy of
    # fsd-chat's.
    return "–" if item["method"].startswith(("hf-", "autoregressive", "llama.cpp")) else str(value)


def _speedup(intervals: str, method: str) -> Render:
    """A paired speed-up with its interval (from report.json's `intervals` map), when it has one."""

    def render(value: Any, item: Mapping[str, Any]) -> str:
        if value is None:
            return "–"
        interval = item[intervals].get(method)
        if interval is None or interval[0] == interval[1]:  # too few prompts, or the baseline itself
            return f"{value:.2f}"
        return f"{value:.2f} [{interval[0]:.2f}–{interval[1]:.2f}]"

    return render


def _plus_minus(fmt: str, half_width: str) -> Render:
    """A figure with its 95% half-width (the dotted path `half_width`) when it has one."""

    def render(value: Any, item: Mapping[str, Any]) -> str:
        if value is None:
            return "–"
        half = _at(item, half_width)
        return format(value, fmt) if half is None else f"{value:{fmt}} ±{half:{fmt.lstrip('+')}}"

    return render


def _milliseconds(value: Any, _item: Mapping[str, Any]) -> str:
    return "–" if value is None else f"{1000 * value:.1f}"


@dataclass(frozen=True, slots=True)
class Column:
    """One column of the results table, shared by report.md and the terminal.

    Attributes:
        header: Its heading.
        field: The report.json field it shows: a dotted path into a `configs` item
            ("quality.cost_per_token", "speedup.exact").
        meaning: What the figure is, for report.md's legend.
        render: How the value is written ("–" where it does not apply: None in report.json).
        terminal: Whether the terminal's narrower table shows it too.
        rank: Which columns a terminal too narrow for all of them keeps: the highest rank is left
            out first (the rightmost of equal ranks); report.md has every column.
        blank: The cell that says nothing (a figure the configuration does not have): the terminal
            leaves out a column whose every cell is blank.
    """

    header: str
    field: str
    meaning: str
    render: Render = _text
    terminal: bool = True
    rank: int = 0
    blank: str = "–"

    def cell(self, item: Mapping[str, Any]) -> str:
        """This column's cell for one report.json `configs` item."""
        return self.render(_at(item, self.field), item)


SPEEDUP_HEADERS: dict[str, tuple[str, str]] = {
    "autoregressive": ("×AR", "target-only decoding in fsd-chat"),
    "exact": ("×exact", "exact speculative decoding in fsd-chat (same k, fixed)"),
    "hf-assisted": ("×hf-assisted", "transformers' assisted generation (same constant k)"),
    "hf-assisted-default": ("×hf-assisted-default", "transformers' assisted generation at its own defaults"),
    "hf-prompt-lookup": ("×hf-prompt-lookup", "transformers' prompt lookup decoding (same k)"),
    "hf-autoregressive": ("×hf-autoregressive", "transformers' plain generate (eager, dynamic cache)"),
    "hf-static": (
        "×hf-static",
        "transformers' generate with a static cache (its decode step compiled on CUDA)",
    ),
    "llama.cpp": ("×llama.cpp", "llama.cpp's own decoding of the GGUF file (Llama.generate)"),
    "llama.cpp-lookup": ("×llama.cpp-lookup", "llama-cpp-python's prompt lookup decoding (same k)"),
}
"""Each speed-up baseline's header (the baseline's own method name: a column says what it is
against) and name (a KeyError on import if `SPEEDUP_BASELINES` gains one without them)."""
SPEEDUP_RANKS: dict[str, int] = {
    "autoregressive": 1,
    "hf-static": 2,
    "hf-assisted": 2,
    "hf-prompt-lookup": 2,
    "exact": 3,
    "hf-autoregressive": 4,
    "hf-assisted-default": 4,
    "llama.cpp": 1,
    "llama.cpp-lookup": 2,
}
"""Which speed-up columns a narrow terminal keeps first (`Column.rank`)."""
DECODE_BASELINES = ("autoregressive", "llama.cpp")
"""The baselines whose decode-clock speed-ups have columns (report.json has them all): target-only
decoding on each engine, what the decode clock is for."""

COLUMNS: tuple[Column, ...] = (
    Column("setup", "setup", "how the pair was loaded: dtype and quantization", terminal=False),
    Column("sampling", "sampling", "temperature and truncation, both models alike", terminal=False),
    Column("method", "method", "the decoding method"),
    Column("div", "divergence", "the divergence D of the relaxed test (fuzzy, pure)"),
    Column(
        "T",
        "threshold",
        "the dial: D ≤ T (fuzzy, pure), the per-token KL budget in nats (mixture; greedy: regret), "
        "or transformers' assistant_ensemble_weight w (hf-ensemble)",
        _num("g"),
    ),
    Column("k", "draft_tokens", "draft length k"),
    Column("policy", "draft_policy", "fsd-chat's draft-length policy", _policy),
    Column(
        "tok/s (median [q1–q3])",
        "tokens_per_second",
        "generated tokens / wall-clock seconds of the whole call, over prompts",
        _spread,
    ),
    *(
        Column(
            SPEEDUP_HEADERS[method][0],
            f"speedup.{method}",
            f"paired median speed-up against {SPEEDUP_HEADERS[method][1]}, with its distribution-free "
            "95% confidence interval from 6 prompts up",
            _speedup("speedup_ci95", method),
            rank=SPEEDUP_RANKS[method],
        )
        for method in SPEEDUP_BASELINES
    ),
    Column(
        "×exact work",
        "work_speedup.exact",
        "the same against exact SD on the forward-work clock (each run's forward counts × the median "
        "per-forward times of its setup, sampling, k and draft policy: immune to other processes, blind to time "
        "outside forward passes)",
        _speedup("work_speedup_ci95", "exact"),
        rank=6,
    ),
    *(
        Column(
            f"{SPEEDUP_HEADERS[method][0]} decode",
            f"decode_speedup.{method}",
            f"the same against {SPEEDUP_HEADERS[method][1]} on the decode clock (tokens after the first "
            "over the seconds after it: the prefill left out, so a reply's length does not move it)",
            _speedup("decode_speedup_ci95", method),
            rank=SPEEDUP_RANKS[method] + 1,
        )
        for method in DECODE_BASELINES
    ),
    Column(
        "decode tok/s",
        "decode_tokens_per_second",
        "median over prompts of the tokens after the first / wall-clock seconds after the first token",
        _num(".1f"),
        terminal=False,
    ),
    Column(
        "TTFT ms",
        "time_to_first_token",
        "median time to first token: the prompt's prefill and the first step",
        _milliseconds,
        terminal=False,
    ),
    Column(
        "limit tok/s",
        "limit_tokens_per_second",
        "tokens/s with zero overhead, from the measured forward times",
        _num(".1f"),
        terminal=False,
    ),
    Column("τ", "mean_accepted_length", "tokens per target forward", _num(".2f"), rank=3),
    Column("mean k", "draft_tokens_per_step", "drafted tokens per target forward", _num(".2f"), rank=5),
    Column("accept", "acceptance_rate", "accepted / drafted tokens", _num(".0%"), rank=4),
    Column(
        "fuzzy",
        "fuzzy_share",
        "share of tokens kept by the relaxed test at a cost > 0 (draft-fuzzy)",
        _num(".0%"),
        rank=6,
    ),
    Column(
        "cost/tok (±95%)",
        "quality.cost_per_token",
        "mean over prompts of the cost per token in nats (KL divergence of each token's law from the "
        "target's, exact at each position; greedy: log-probability regret) with its 95% interval; 0 "
        "for lossless methods",
        _plus_minus(".4f", "quality.cost_per_token_ci95"),
        rank=1,
    ),
    Column(
        "NLL",
        "quality.target_nll",
        "target negative log-likelihood per generated token (nats)",
        _num(".3f"),
        terminal=False,
    ),
    Column(
        "ΔNLL (±95%)",
        "quality.target_nll_change",
        "relative change of the NLL against autoregressive decoding (else exact SD), with its 95% interval",
        _plus_minus("+.1%", "quality.target_nll_change_ci95"),
        rank=6,
    ),
    Column(
        "greedy agree",
        "quality.greedy_agreement",
        "greedy runs: share of the reply equal to target-only greedy output before the first difference",
        _num(".0%"),
        rank=5,
    ),
    Column(
        "accuracy",
        "quality.accuracy",
        "share of right answers (prompt sets with answers)",
        _num(".0%"),
        rank=3,
    ),
    Column(
        "status",
        "status",
        "ok, or cut: the configuration ran past its time budget and was stopped, its figures from the "
        "replies it finished (report.json's cut_after_seconds: the budget)",
        rank=1,
        blank="ok",
    ),
    Column(
        "warm-up s",
        "warmup_seconds",
        "seconds of the configuration's untimed warm-up reply, compilation included (kept apart from its "
        "measured runs)",
        _num(".1f"),
        terminal=False,
    ),
    Column(
        "graphs",
        "compiled_graphs",
        "graphs torch.compile compiled during the measured runs (torch._dynamo's counters): 0 when "
        "compilation stayed in the warm-up",
        terminal=False,
    ),
    Column(
        "target fwd ms",
        "target_forward_seconds",
        "mean target forward (prefill excluded)",
        _milliseconds,
        terminal=False,
    ),
    Column(
        "draft fwd ms",
        "draft_forward_seconds",
        "mean draft forward (prefill excluded)",
        _milliseconds,
        terminal=False,
    ),
    Column(
        "outside fwd",
        "outside_forward_share",
        "share of wall-clock time outside the models' forward passes (sampling, acceptance, cache "
        "rollback, detokenisation, framework)",
        _num(".1%"),
        terminal=False,
    ),
)
"""The results table: one column a report.json field, in report.md all of them, on the terminal
those marked `terminal`."""


@dataclass(frozen=True, slots=True)
class Report:
    """What report.json holds.

    Attributes:
        environment: Versions, device, threads and the loaded setups (`environment.environment`).
        sweep: What was asked for: prompts, counts, seed and the sweep's lists as given.
        interrupted: Whether Ctrl-C cut the sweep short.
        summaries: One per configuration measured (report.json's `configs`).
        verdicts: Per (setup, temperature) and clock, the lossy rules' curves compared at matched
            cost (report.json's `curves`).
        cut: The configurations cut for time before they finished a reply (they have no row), as
            "setup · sampling · label" (report.json's `cut`).
        advice: The last line: what to run on this pair (`advice.advise`).
    """

    environment: dict[str, object]
    sweep: dict[str, object]
    interrupted: bool
    summaries: list[Summary]
    verdicts: list[Verdict]
    cut: list[str] = field(default_factory=list)
    advice: str = ""


def write_json(path: Path, report: Report) -> None:
    """Write report.json: `environment`, `sweep` (what was asked), `interrupted`, `configs` and
    `curves`.

    Raises:
        OSError: the file cannot be written.
    """
    data = {
        "environment": report.environment,
        "sweep": report.sweep,
        "interrupted": report.interrupted,
        "configs": [s.to_dict() for s in report.summaries],
        "curves": [v.to_dict() for v in report.verdicts],
        "cut": report.cut,
        "advice": report.advice,
    }
    path.write_text(to_json(data, indent=2) + "\n", encoding="utf-8")


def read_json(path: Path) -> Report:
    """Read back a report.json that `write_json` wrote, so that its table, markdown and plot can be
    made again without measuring.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON (`json.JSONDecodeError`) or not UTF-8 (`UnicodeDecodeError`).
        KeyError, TypeError: it lacks a field of the report, or a field has the wrong shape.
    """
    data = json.loads(path.read_text(encoding="utf-8"))
    return Report(
        environment=data["environment"],
        sweep=data["sweep"],
        interrupted=data["interrupted"],
        summaries=[Summary.from_dict(item) for item in data["configs"]],
        verdicts=[Verdict.from_dict(item) for item in data["curves"]],
        # Missing in a report.json written before they existed.
        cut=data.get("cut", []),
        advice=data.get("advice", ""),
    )


def table_rows(summaries: list[Summary], columns: tuple[Column, ...] = COLUMNS) -> list[tuple[str, ...]]:
    """One row of `columns`' cells per summary, each read from the summary's report.json item
    (through JSON, so what is shown is what report.json holds: an infinity is "–" in both)."""
    items = [json.loads(to_json(s.to_dict())) for s in summaries]
    return [tuple(column.cell(item) for column in columns) for item in items]


def cut_line(cut: list[str]) -> str:
    """The configurations cut for time before they finished a reply, in one line."""
    return f"cut for time before finishing a reply (no row): {'; '.join(cut)}"


def write_markdown(path: Path, report: Report, *, title: str, plot_name: str | None) -> None:
    """Write report.md: what ran where, the table, the column legend, the curves compared at
    matched cost, and the plot (the image `plot_name` beside it, if any).

    Raises:
        OSError: the file cannot be written.
    """
    environment = report.environment
    packages, devices, names = environment["packages"], environment["device"], environment["device_name"]
    assert isinstance(packages, dict) and isinstance(devices, list) and isinstance(names, list)
    lines = [
        f"# {title}",
        "",
        f"- device: {', '.join(map(str, devices))} ({', '.join(map(str, names))}), "
        f"{environment['torch_threads']} torch threads, {environment['cpu_count']} CPUs",
        f"- versions: {', '.join(f'{k} {v}' for k, v in packages.items() if v)}",
        f"- quality scored by: {environment['scorer']}",
    ]
    budget, warmup_budget = (
        report.sweep.get("cut_after_seconds"),
        report.sweep.get("warmup_cut_after_seconds"),
    )
    if isinstance(budget, float | int) and isinstance(warmup_budget, float | int):
        lines.append(
            f"- time budget: a configuration is cut past {budget:.0f} s of measured replies or "
            f"{warmup_budget:.0f} s of warm-up (status column)"
        )
    if report.interrupted:
        lines.append("- **interrupted**: the sweep was stopped early; these are the runs measured so far")
    headers = [column.header for column in COLUMNS]
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report.summaries)]
    lines += ["", *(f"- {column.header}: {column.meaning}." for column in COLUMNS)]
    lines += [
        "",
        "–: no such figure for this configuration (null in report.json). report.json has every "
        "figure, with fsd-chat's own overhead_share (other_seconds / decode seconds).",
    ]
    if report.verdicts:
        lines += [
            "",
            "## Curves at matched cost",
            "",
            "Each lossy rule's curve (through its thresholds, from exact SD at cost 0; transformers' "
            "hf-ensemble through its weights w, from hf-assisted) against each other one: per prompt, "
            "tokens/s (τ: tokens per target forward) interpolated linearly in cost at the cost levels both "
            "curves reach, the ratio's geometric mean over the levels, then its median over prompts with a "
            "distribution-free 95% interval; and the same ratio at 0.01, 0.02 and 0.05 nats/token where "
            "both curves reach them (fsd_chat/bench/curves.py).",
        ]
        for verdict in report.verdicts:
            lines += ["", *verdict.lines()]
    if plot_name:
        lines += ["", f"![tokens/s against cost per token]({plot_name})"]
    if report.cut:
        lines += ["", cut_line(report.cut)]
    if report.advice:
        lines += ["", report.advice]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
