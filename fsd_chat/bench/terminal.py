"""The results on the terminal: the report's table (rich) and a small character plot per group."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fsd_chat.bench.metrics import Summary
from fsd_chat.bench.plot import pareto_front, quality_axis, quality_value
from fsd_chat.bench.report import HEADERS, table_rows
from fsd_chat.bench.sweep import FSD_RULES

BASELINE_GLYPHS = {"autoregressive": "A", "exact": "E", "hf-assisted": "H", "hf-assisted-default": "D"}
WIDTH, HEIGHT = 56, 12
# The columns that fit a terminal; setup and temperature go into each group's title.
COLUMNS = tuple(
    HEADERS.index(name)
    for name in (
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
        "τ",
        "mean k",
        "accept",
        "fuzzy",
        "ΔNLL (±95%)",
        "greedy agree",
        "accuracy",
    )
)


def results_table(summaries: list[Summary], title: str) -> Table:
    """The report's table, in the columns that fit a terminal, as a rich Table."""
    # escape: "[q1–q3]" and the like would otherwise be read as rich markup tags
    table = Table(
        *(escape(HEADERS[i]) for i in COLUMNS), title=escape(title), header_style="bold", title_justify="left"
    )
    for row in table_rows(summaries):
        table.add_row(*(escape(row[i]) for i in COLUMNS))
    return table


def _scale(value: float, low: float, high: float, cells: int) -> int:
    return 0 if high <= low else round((value - low) / (high - low) * (cells - 1))


def text_plot(summaries: list[Summary], title: str) -> Group:
    """Quality (up = better) against tokens/s (right = faster) in characters: A, E, H for the
    baselines, 1–9 for the FSD curves (legend below); Pareto-front points in bold."""
    axis, higher = quality_axis(summaries)
    points = [(s, q) for s in summaries if (q := quality_value(s, axis)) is not None]
    series: dict[str, str] = {}
    grid = [[(" ", "")] * WIDTH for _ in range(HEIGHT)]
    if points:
        xs = [s.tokens_per_second.median for s, _ in points]
        ys = [q if higher else -q for _, q in points]
        front = set(pareto_front(list(zip(xs, ys, strict=True)), True))
        for i, (s, _) in enumerate(points):
            c = s.config
            if c.method in FSD_RULES:
                name = f"{c.method} {c.divergence} k={c.draft_tokens}" + (
                    "" if c.draft_policy == "fixed" else f" {c.draft_policy}"
                )
                glyph = series.setdefault(name, str(len(series) % 9 + 1))
            else:
                glyph = BASELINE_GLYPHS[c.method]
            col = _scale(xs[i], min(xs), max(xs), WIDTH)
            row = HEIGHT - 1 - _scale(ys[i], min(ys), max(ys), HEIGHT)
            grid[row][col] = (glyph, "bold reverse" if i in front else "")
    lines: list[Text] = [Text(title, style="bold")]
    label = "accuracy" if axis == "accuracy" else "target NLL (↑ better)"
    lines.append(Text(f"↑ {label}"))
    for cells in grid:
        lines.append(Text("│").append_text(Text.assemble(*cells)))
    if points:
        xs = [s.tokens_per_second.median for s, _ in points]
        lines.append(Text("└" + "─" * WIDTH))
        lines.append(Text(f" {min(xs):.1f}".ljust(WIDTH - 12) + f"{max(xs):.1f} tok/s →"))
    legend = "  ".join(
        [f"{g} {m}" for m, g in BASELINE_GLYPHS.items()] + [f"{g} {n}" for n, g in series.items()]
    )
    lines.append(Text(legend + "  (reverse: Pareto front)", style="dim"))
    return Group(*lines)


def show(console: Console, summaries: list[Summary]) -> None:
    """Print a table and a small plot per (setup, temperature)."""
    groups: dict[str, list[Summary]] = defaultdict(list)
    for s in summaries:
        groups[f"{s.config.setup.label} · temperature {s.config.temperature:g}"].append(s)
    for name, members in groups.items():
        console.print(results_table(members, name))
        console.print(text_plot(members, name))
