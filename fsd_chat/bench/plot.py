"""tradeoff.png: quality against tokens/s, one panel per (setup, temperature).

In each panel: one curve per FSD (rule, divergence, k) through its thresholds, the baselines as
marked points, and the Pareto front (the points no other point beats on both speed and quality)
joined by a wide dashed grey line.
Quality is accuracy where the prompt set has answers, else target NLL per token (lower is better,
so that axis is inverted: up is better everywhere).
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a terminal machine
import matplotlib.pyplot as plt

from fsd_chat.bench.metrics import Summary
from fsd_chat.bench.sweep import FSD_RULES

BASELINE_MARKERS = {"autoregressive": "s", "exact": "D", "hf-assisted": "^", "hf-assisted-default": "v"}


def quality_axis(summaries: list[Summary]) -> tuple[str, bool]:
    """("accuracy" or "target_nll", higher is better?) for a set of summaries."""
    if any(s.quality.accuracy is not None for s in summaries):
        return "accuracy", True
    return "target_nll", False


def quality_value(summary: Summary, axis: str) -> float | None:
    """The summary's value on the quality axis."""
    return summary.quality.accuracy if axis == "accuracy" else summary.quality.target_nll


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the points (speed, quality) no other point beats on both, fastest first."""
    order = sorted(range(len(points)), key=lambda i: -points[i][0])
    front: list[int] = []
    for i in order:
        quality = points[i][1] if higher_is_better else -points[i][1]
        if not front or quality > (points[front[-1]][1] if higher_is_better else -points[front[-1]][1]):
            front.append(i)
    return front


def write_plot(path: Path, summaries: list[Summary], *, title: str) -> None:
    """Draw the trade-off of `summaries` into a PNG at `path`."""
    axis, higher = quality_axis(summaries)
    groups: dict[str, list[Summary]] = defaultdict(list)
    for s in summaries:
        groups[f"{s.config.setup.label} · temperature {s.config.temperature:g}"].append(s)
    fig, axes = plt.subplots(1, len(groups), figsize=(6.4 * len(groups), 4.8), squeeze=False)
    for ax, (name, members) in zip(axes[0], groups.items(), strict=True):
        points = [(s, quality_value(s, axis)) for s in members]
        points = [(s, q) for s, q in points if q is not None]
        curves: dict[str, list[tuple[Summary, float]]] = defaultdict(list)
        for s, q in points:
            c = s.config
            if c.method in FSD_RULES:
                curves[
                    f"{c.method} {c.divergence} k={c.draft_tokens}"
                    + ("" if c.draft_policy == "fixed" else f" {c.draft_policy}")
                ].append((s, q))
            else:
                ax.scatter(
                    s.tokens_per_second.median,
                    q,
                    marker=BASELINE_MARKERS[c.method],
                    s=70,
                    zorder=3,
                    label=c.label,
                    edgecolors="black",
                )
        for label, curve in curves.items():
            curve.sort(key=lambda item: item[0].config.threshold or 0.0)
            xs = [s.tokens_per_second.median for s, _ in curve]
            ys = [q for _, q in curve]
            ax.plot(xs, ys, marker="o", label=label, zorder=2)
            for s, q in curve:
                ax.annotate(
                    f"{s.config.threshold:g}",
                    (s.tokens_per_second.median, q),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
        if points:
            coords = [(s.tokens_per_second.median, q) for s, q in points]
            front = sorted((coords[i] for i in pareto_front(coords, higher)), key=lambda xy: xy[0])
            ax.plot(
                [x for x, _ in front],
                [y for _, y in front],
                linestyle="--",
                linewidth=4,
                alpha=0.3,
                color="grey",
                label="Pareto front",
                zorder=1,
            )
        if not higher:
            ax.invert_yaxis()
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("tokens/s (median over prompts)")
        ax.set_ylabel("accuracy" if axis == "accuracy" else "target NLL per token, nats (↑ better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
