"""The results on the terminal: the report's table (rich) and a small character plot per group."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fsd_chat.bench.metrics import Summary, trade_off_points
from fsd_chat.bench.report import COLUMNS, table_rows
from fsd_chat.bench.stats import pareto_front

BASELINE_GLYPHS = {
    "autoregressive": "A",
    "exact": "E",
    "hf-assisted": "H",
    "hf-assisted-default": "D",
    "hf-prompt-lookup": "L",
    "hf-autoregressive": "R",
    "hf-static": "S",
    "llama.cpp": "C",
    "llama.cpp-lookup": "K",
}
WIDTH, HEIGHT = 56, 12
TERMINAL_COLUMNS = tuple(column for column in COLUMNS if column.terminal)
"""The columns that fit a terminal; setup and sampling go into each group's title."""


def _table(rows: list[tuple[str, ...]], shown: list[int], title: str) -> Table:
    # escape: "[q1–q3]" and the like would otherwise be read as rich markup tags
    table = Table(title=escape(title), header_style="bold", title_justify="left")
    for i in shown:
        # no_wrap: a figure is never broken over lines; columns that do not fit are left out instead.
        table.add_column(escape(TERMINAL_COLUMNS[i].header), no_wrap=True)
    for row in rows:
        table.add_row(*(escape(row[i]) for i in shown))
    return table


def results_table(summaries: list[Summary], title: str, width: int | None = None) -> tuple[Table, list[str]]:
    """The report's table in the terminal's columns, as a rich Table, and the headers left out for
    the `width` (None: any width): a column with no figure in any row (a baseline the sweep did not
    run) is left out, then, while the table is wider than `width`, the column of the highest
    `Column.rank` (the rightmost of equal ranks; never one of rank 0)."""
    rows = table_rows(summaries, TERMINAL_COLUMNS)
    shown = [i for i, column in enumerate(TERMINAL_COLUMNS) if any(row[i] != column.blank for row in rows)]
    left_out: list[str] = []
    table = _table(rows, shown, title)
    while width is not None and _width(table) > width:
        drop = max(shown, key=lambda i: (TERMINAL_COLUMNS[i].rank, i))
        if TERMINAL_COLUMNS[drop].rank == 0:
            break
        shown.remove(drop)
        left_out.insert(0, TERMINAL_COLUMNS[drop].header)
        table = _table(rows, shown, title)
    return table, left_out


def _width(table: Table) -> int:
    """The table's width with every cell on one line."""
    return Console(width=100_000).measure(table).maximum


def _scale(value: float, low: float, high: float, cells: int) -> int:
    return 0 if high <= low else round((value - low) / (high - low) * (cells - 1))


def text_plot(summaries: list[Summary], title: str) -> Group:
    """tokens/s (up = faster) against cost per token (right = costlier) in characters: A, E, H for
    the baselines, 1–9 for the lossy rules' curves (legend below); Pareto-front points in bold."""
    points = trade_off_points(summaries)
    series: dict[str, str] = {}
    grid = [[(" ", "")] * WIDTH for _ in range(HEIGHT)]
    speeds = [speed for _, speed, _ in points]
    costs = [cost for _, _, cost in points]
    if points:
        front = set(pareto_front(list(zip(speeds, costs, strict=True)), False))
        for i, (s, speed, cost) in enumerate(points):
            if s.config.curve is not None:
                glyph = series.setdefault(s.config.curve, str(len(series) % 9 + 1))
            else:
                glyph = BASELINE_GLYPHS[s.config.method]
            col = _scale(cost, min(costs), max(costs), WIDTH)
            row = HEIGHT - 1 - _scale(speed, min(speeds), max(speeds), HEIGHT)
            grid[row][col] = (glyph, "bold reverse" if i in front else "")
    lines: list[Text] = [Text(title, style="bold")]
    if points:
        lines.append(Text(f"↑ tokens/s ({min(speeds):.1f}–{max(speeds):.1f})"))
    for cells in grid:
        lines.append(Text("│").append_text(Text.assemble(*cells)))
    if points:
        lines.append(Text("└" + "─" * WIDTH))
        lines.append(
            Text(f" {min(costs):.3f}".ljust(WIDTH - 24) + f"{max(costs):.3f} cost per token (nats) →")
        )
    plotted = {s.config.method for s, _, _ in points}
    legend = "  ".join(
        [f"{g} {m}" for m, g in BASELINE_GLYPHS.items() if m in plotted]
        + [f"{g} {n}" for n, g in series.items()]
    )
    lines.append(Text(legend + "  (reverse: Pareto front)", style="dim"))
    return Group(*lines)


def show(console: Console, summaries: list[Summary]) -> None:
    """Print a table and a small plot per (setup, temperature)."""
    groups: dict[str, list[Summary]] = defaultdict(list)
    for s in summaries:
        groups[f"{s.config.setup.label} · {s.config.sampling}"].append(s)
    for name, members in groups.items():
        table, left_out = results_table(members, name, console.width)
        console.print(table)
        if left_out:
            console.print(Text(f"in report.md, not shown at this width: {', '.join(left_out)}", style="dim"))
        console.print(text_plot(members, name))
