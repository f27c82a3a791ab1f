"""tradeoff.png: speed against cost per token, one column per (setup, temperature), one row per clock:
wall-clock tokens/s (what a user sees), and the paired speed-up over exact SD on the forward-work
clock (forward counts at shared per-forward times, which other processes on the machine cannot
disturb; see `metrics`).

In each panel: one curve per lossy rule × divergence (fuzzy, pure) or rule (mixture, transformers'
hf-ensemble) × k through its thresholds (hf-ensemble: its weights w, labelled "w=…"), each point with its cost's 95% interval as a horizontal bar, the baselines as marked
points (lossless: at cost 0), and the Pareto front (the points no other point beats on both speed
and cost) joined by a wide dashed grey line. Up and left is better.
"""

from __future__ import annotations

import itertools
import textwrap
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a terminal machine
import matplotlib.pyplot as plt

from fsd_chat.bench.metrics import Speed, Summary, trade_off_points
from fsd_chat.bench.stats import pareto_front

BASELINE_MARKERS = {
    "autoregressive": "s",
    "exact": "D",
    "hf-assisted": "^",
    "hf-assisted-default": "v",
    "hf-prompt-lookup": "P",
    "hf-autoregressive": "o",
    "hf-static": "X",
    "llama.cpp": "*",
    "llama.cpp-lookup": "p",
}

SPEEDS: dict[str, Speed] = {
    "tokens/s (median over prompts)": lambda s: s.tokens_per_second.median,
    "×exact SD, forward-work clock (paired median)": lambda s: s.work_speedup.get("exact"),
}
"""The rows of the plot: axis label → a summary's speed (None: not on this row)."""


def write_plot(path: Path, summaries: list[Summary], *, title: str) -> None:
    """Draw the trade-off of `summaries` into a PNG at `path`."""
    groups: dict[str, list[Summary]] = defaultdict(list)
    for s in summaries:
        groups[f"{s.config.setup.label} · {s.config.sampling}"].append(s)
    fig, axes = plt.subplots(len(SPEEDS), len(groups), figsize=(6.4 * len(groups), 9.6), squeeze=False)
    for (row, (ylabel, speed_of)), (column, (name, members)) in itertools.product(
        enumerate(SPEEDS.items()), enumerate(groups.items())
    ):
        ax = axes[row][column]
        points = trade_off_points(members, speed_of)
        curves: dict[str, list[tuple[Summary, float, float]]] = defaultdict(list)
        for s, speed, cost in points:
            c = s.config
            if c.curve is not None:
                curves[c.curve].append((s, speed, cost))
            else:
                ax.scatter(
                    cost,
                    speed,
                    marker=BASELINE_MARKERS[c.method],
                    s=70,
                    zorder=3,
                    label=c.label,
                    edgecolors="black",
                )
        lossless = {
            (s.config.method, s.config.draft_tokens, s.config.draft_policy): (speed, cost)
            for s, speed, cost in points
            if s.config.curve is None
        }
        for label, curve in curves.items():
            curve.sort(key=lambda item: item[0].config.relaxation)
            # Every rule at T = 0 is exact SD (hf-ensemble as w → 1 is hf-assisted): the curve starts
            # at that lossless point of the same k and draft-length policy.
            first = curve[0][0].config
            key = (first.lossless, first.draft_tokens, first.draft_policy)
            start = [lossless[key]] if key in lossless else []
            ax.errorbar(
                [cost for _, cost in start] + [cost for _, _, cost in curve],
                [speed for speed, _ in start] + [speed for _, speed, _ in curve],
                xerr=[0.0] * len(start) + [s.quality.cost_per_token_ci95 or 0.0 for s, _, _ in curve],
                marker="o",
                capsize=2,
                label=label,
                zorder=2,
            )
            for s, speed, cost in curve:
                ax.annotate(
                    f"{'w=' if s.config.method == 'hf-ensemble' else ''}{s.config.threshold:g}",
                    (cost, speed),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
        if points:
            coords = [(speed, cost) for _, speed, cost in points]
            front = sorted((coords[i] for i in pareto_front(coords, False)), key=lambda xy: xy[1])
            ax.plot(
                [cost for _, cost in front],
                [speed for speed, _ in front],
                linestyle="--",
                linewidth=4,
                alpha=0.3,
                color="grey",
                label="Pareto front",
                zorder=1,
            )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("cost per token, nats (KL from the target's law; greedy: regret), mean ± 95%")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel can be empty: the sweep ran no exact SD
            ax.legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
