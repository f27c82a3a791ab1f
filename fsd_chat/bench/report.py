"""report.json (machine-readable, and read back by `read_json`) and report.md (for people), and the
table rows both share with the terminal. Torch-free: a report.json is summarised again without
loading torch or transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fsd_chat.bench.curves import Verdict
from fsd_chat.bench.metrics import SPEEDUP_BASELINES, Quality, Summary
from fsd_chat.support.text import to_json

HEADERS = (
    "setup",
    "sampling",
    "method",
    "div",
    "T",
    "k",
    "policy",
    "tok/s (median [q1–q3])",
    "×AR",
    "×exact",
    "×HF",
    "×HF-def",
    "×exact work",
    "limit tok/s",
    "τ",
    "mean k",
    "accept",
    "fuzzy",
    "cost/tok (±95%)",
    "NLL",
    "ΔNLL (±95%)",
    "greedy agree",
    "accuracy",
    "fwd ms t/d",
    "outside fwd",
)


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
    """

    environment: dict[str, object]
    sweep: dict[str, object]
    interrupted: bool
    summaries: list[Summary]
    verdicts: list[Verdict]


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
    )


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def _speedup(summary: Summary, method: str, *, work: bool = False) -> str:
    """The paired speed-up against `method` with its interval, on the wall clock or (`work`) the
    forward-work clock."""
    value = (summary.work_speedup if work else summary.speedup).get(method)
    if value is None:
        return "–"
    interval = (summary.work_speedup_ci95 if work else summary.speedup_ci95).get(method)
    if interval is None or interval[0] == interval[1]:  # too few prompts, or the baseline itself
        return f"{value:.2f}"
    return f"{value:.2f} [{interval[0]:.2f}–{interval[1]:.2f}]"


def _cost(quality: Quality) -> str:
    """Cost per token in nats with its 95% half-width; 4 decimals, since costs of 0.001 matter."""
    if quality.cost_per_token is None:
        return "–"
    if quality.cost_per_token_ci95 is None:
        return f"{quality.cost_per_token:.4f}"
    return f"{quality.cost_per_token:.4f} ±{quality.cost_per_token_ci95:.4f}"


def table_rows(summaries: list[Summary]) -> list[tuple[str, ...]]:
    """One row of `HEADERS` cells per summary."""
    rows = []
    for s in summaries:
        c, q, tps = s.config, s.quality, s.tokens_per_second
        change = "–"
        if q.target_nll_change is not None:
            change = f"{q.target_nll_change:+.1%}"
            if q.target_nll_change_ci95 is not None:
                change += f" ±{q.target_nll_change_ci95:.1%}"
        ms = [
            _num(None if t is None else 1000 * t, ".1f")
            for t in (s.target_forward_seconds, s.draft_forward_seconds)
        ]
        rows.append(
            (
                c.setup.label,
                c.sampling.removeprefix("temperature "),
                c.method,
                c.divergence or "–",
                "–" if c.threshold is None else f"{c.threshold:g}",
                "–" if c.draft_tokens is None else str(c.draft_tokens),
                "–" if c.method.startswith(("hf-", "autoregressive")) else c.draft_policy,
                f"{tps.median:.1f} [{tps.q1:.1f}–{tps.q3:.1f}]",
                *(_speedup(s, method) for method in SPEEDUP_BASELINES),
                _speedup(s, "exact", work=True),
                _num(s.limit_tokens_per_second, ".1f"),
                f"{s.mean_accepted_length:.2f}",
                _num(s.draft_tokens_per_step),
                _num(s.acceptance_rate, ".0%"),
                f"{s.fuzzy_share:.0%}",
                _cost(q),
                _num(q.target_nll, ".3f"),
                change,
                _num(q.greedy_agreement, ".0%"),
                _num(q.accuracy, ".0%"),
                "/".join(ms),
                f"{s.outside_forward_share:.1%}",
            )
        )
    return rows


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
    if report.interrupted:
        lines.append("- **interrupted**: the sweep was stopped early; these are the runs measured so far")
    lines += ["", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report.summaries)]
    lines += [
        "",
        "tok/s: generated tokens / wall-clock seconds of the whole call, over prompts. ×AR, ×exact, ×HF, "
        "×HF-def: paired median speed-up against target-only decoding, exact speculative decoding (same k, "
        "fixed), transformers' assisted generation (same constant k) and the same at transformers' "
        "defaults, with its distribution-free 95% confidence interval from 6 prompts up. "
        "×exact work: the same against exact SD on the forward-work clock (each run's forward counts × the "
        "median per-forward times of its setup, temperature and k: immune to other processes, blind to "
        "time outside forward passes). limit: tokens/s with zero overhead from the measured forward times. "
        "T: hf-ensemble's is transformers' assistant_ensemble_weight w. "
        "policy: fsd-chat's draft-length policy. τ: tokens per target forward. mean k: drafted tokens per "
        "target forward. accept: accepted / drafted. fuzzy: share of tokens accepted only by "
        "D ≤ T. cost/tok: mean over prompts of the cost per token in nats (KL divergence of each token's law "
        "from the target's, exact at each position; greedy: log-probability regret) with its 95% interval; "
        "0 for lossless methods. NLL: target negative log-likelihood per generated token (nats). ΔNLL: relative to "
        "autoregressive decoding. greedy agree: share of the reply equal to target-only greedy output "
        "before the first difference. fwd ms: mean target / draft forward (prefill excluded). outside fwd: "
        "share of wall-clock time outside the models' forward passes (sampling, acceptance, cache "
        "rollback, detokenisation, framework). report.json has every figure, with fsd-chat's own "
        "overhead_share (other_seconds / decode seconds).",
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
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
