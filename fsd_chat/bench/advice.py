"""The bench's last line: what to run on the pair measured, read off its own table.

The fastest of fsd-chat's speculative settings (exact SD and the lossy rules, under each draft
policy measured) whose cost per token is within `ADVICE_COST`, by its paired median speed-up over
target-only decoding (the ×AR column); the target alone when none of them beats it (×AR ≤ 1).
transformers' methods are baselines, not settings of the chat, and a configuration cut for time
is not advised. Torch-free, like the rest of the analysis.
"""

from __future__ import annotations

from fsd_chat.bench.metrics import Summary
from fsd_chat.bench.records import FSD_RULES, Configuration

ADVICE_COST = 0.02
"""The cost per token (nats; greedy: log-probability regret) the advice stays within: about what
transformers' static ensemble costs at w = 0.9 on the offline pair, sampled."""
SPECULATIVE = ("exact", *FSD_RULES)
"""fsd-chat's own speculative methods: the settings the advice chooses among."""


def flags(config: Configuration) -> str:
    """The chat's options for `config`'s decoding, e.g. "--rule fuzzy --divergence js -T 0.1 -k 5
    --draft-policy goodput"."""
    parts = [f"--rule {config.method}"]
    if config.divergence is not None:
        parts.append(f"--divergence {config.divergence}")
    if config.threshold is not None:
        parts.append(f"-T {config.threshold:g}")
    if config.draft_tokens is not None:
        parts.append(f"-k {config.draft_tokens}")
    parts.append(f"--draft-policy {config.draft_policy}")
    return " ".join(parts)


def _speedup(summary: Summary) -> str:
    value = summary.speedup["autoregressive"]
    interval = summary.speedup_ci95.get("autoregressive")
    return f"{value:.2f}×" + (f" [{interval[0]:.2f}–{interval[1]:.2f}]" if interval else "")


def advise(summaries: list[Summary]) -> str:
    """One line: the setting to run on this pair, or the target alone (see the module docstring)."""
    measured = [
        s
        for s in summaries
        if s.config.method in SPECULATIVE and "autoregressive" in s.speedup and s.status == "ok"
    ]
    if not measured:
        return "advice: none (no speculative setting was measured against target-only decoding)"
    groups = {(s.config.setup, s.config.sampling) for s in summaries}
    affordable = [s for s in measured if (s.quality.cost_per_token or 0.0) <= ADVICE_COST]
    best = max(affordable, key=lambda s: s.speedup["autoregressive"], default=None)
    where = f" ({best.config.setup.label} · {best.config.sampling})" if best and len(groups) > 1 else ""
    # Short enough for one line of 160 columns (the longest options, an interval, a group).
    if best is not None and best.speedup["autoregressive"] > 1.0:
        return (
            f"advice: run `{flags(best.config)}`{where}: {_speedup(best)} the target alone at "
            f"{best.quality.cost_per_token or 0.0:.4f} nats/token (fastest within {ADVICE_COST:g})"
        )
    fastest = best or max(measured, key=lambda s: s.speedup["autoregressive"])
    return (
        f"advice: run the target alone (`--autoregressive`): none within {ADVICE_COST:g} nats/token "
        f"beat it (fastest: {fastest.config.label}, {_speedup(fastest)})"
    )
