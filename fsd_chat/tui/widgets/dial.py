"""The threshold dial: `T 0.30 ▕████▍    ▏ js nats fuzzy · k 5` (Textual has no slider widget), its
range and step for each rule and divergence, and the arithmetic of its keys.

It shows the `DecodingSettings` in force; left/right (when focused) and the chat keys move T
through the chat screen's actions, which apply the changes the pure functions here return
(`raise_threshold`, `lower_threshold`, `cycle_divergence`, `cycle_rule`) to the shared `Controls`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar, TypedDict

from textual.binding import BindingType
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from fsd_chat.decoding.settings import DIVERGENCE_NAMES, DecodingSettings, DivergenceName, Rule
from fsd_chat.tui.keys import DIAL_BINDINGS

DIAL_RANGE: dict[DivergenceName, float] = {
    "kl": 2.0,
    "reverse-kl": 2.0,
    "js": math.log(2.0),
    "tv": 1.0,
}
"""Top of the dial for each divergence (fuzzy / pure): beyond it nearly every draft token is accepted."""

THRESHOLD_STEP: dict[DivergenceName, float] = {
    "kl": 0.05,
    "reverse-kl": 0.05,
    "js": 0.02,
    "tv": 0.05,
}
"""One nudge of T, sized to the divergence's typical spread between a draft and a target."""

MIXTURE_RANGE = 0.5
"""Top of the dial under the mixture rule when sampling, in nats per token (a per-token KL budget)."""
MIXTURE_STEP = 0.01
"""One nudge of the mixture rule's budget: its useful costs are 0.01–0.1 nats per token."""

REGRET_RANGE = 1.0
"""Top of the dial under greedy decoding, where every relaxed rule accepts a draft token whose
log-probability is within T nats of the target's argmax (`fsd_chat.decoding.acceptance`, Greedy):
the largest step measured to keep replies whole on MT-Bench and tinystories-retell with the default
chat model (20 prompts each, 256 tokens, where the target alone loops on 8 and 9 of 20: at 1, 10
and 7 replies loop; at 1.5, 14 retells do) and on TinyStories with the story pair (no new loop up to
2), at 0.02 nats per token or less (docs/bench-dial-smollm2-256.json, docs/bench-dial-story.json; docs/benchmarks.md,
"The dial on the default chat"). It is also the default (`DEFAULT_GREEDY_THRESHOLD`)."""
REGRET_STEP = 0.5
"""One nudge of the regret bound (a factor e^0.5 ≈ 1.65 in how much less likely than the argmax a
kept draft token may be): each step raised acceptance or τ on both sets of the default chat and on
the story pair (0.25 steps moved neither measurably on the retell)."""


def dial_scale(settings: DecodingSettings, greedy: bool = False) -> tuple[float, float]:
    """(top, step) of the dial for the rule, divergence and decoding in force, in T's units."""
    if greedy:
        return REGRET_RANGE, REGRET_STEP
    if settings.rule == "mixture":
        return MIXTURE_RANGE, MIXTURE_STEP
    return DIAL_RANGE[settings.divergence], THRESHOLD_STEP[settings.divergence]


def threshold_unit(settings: DecodingSettings, greedy: bool = False) -> str:
    """What T measures, as the dial names it: "regret nats/tok" (greedy, every rule), "KL
    nats/tok" (the mixture rule's budget), "tv" (a probability), else the divergence in nats."""
    if greedy:
        return "regret nats/tok"
    if settings.rule == "mixture":
        return "KL nats/tok"
    return "tv" if settings.divergence == "tv" else f"{settings.divergence} nats"


RULE_CYCLE: tuple[Rule, ...] = ("fuzzy", "mixture", "pure", "exact")
"""The order ctrl+g steps through the acceptance rules."""


class DialChange(TypedDict, total=False):
    """Changes to the `DecodingSettings` (keyword arguments of `Controls.update`)."""

    threshold: float
    divergence: DivergenceName
    rule: Rule


def raise_threshold(settings: DecodingSettings, greedy: bool = False) -> DialChange:
    """T up one step of the dial in use, capped at the dial's top (no change at or above it).
    T is rounded to 6 decimals so that repeated steps do not accumulate float noise."""
    top, step = dial_scale(settings, greedy)
    if settings.threshold >= top:
        return {}
    return {"threshold": round(min(settings.threshold + step, top), 6)}


def lower_threshold(settings: DecodingSettings, greedy: bool = False) -> DialChange:
    """T down one step, not below 0; from above the dial's top (a T set on the command line), to
    the top."""
    top, step = dial_scale(settings, greedy)
    return {"threshold": round(max(min(settings.threshold - step, top), 0.0), 6)}


EXACT: DialChange = {"threshold": 0.0}
"""T = 0: exact speculative decoding, whatever the rule."""


def cycle_divergence(settings: DecodingSettings, greedy: bool = False) -> DialChange:
    """The next divergence (in `DIVERGENCE_NAMES`' order, wrapping); T stays, capped at the new
    divergence's dial top."""
    names = DIVERGENCE_NAMES
    following = names[(names.index(settings.divergence) + 1) % len(names)]
    top, _ = dial_scale(replace(settings, divergence=following), greedy)
    return {"divergence": following, "threshold": min(settings.threshold, top)}


def cycle_rule(settings: DecodingSettings, greedy: bool = False) -> DialChange:
    """The next acceptance rule (`RULE_CYCLE`, wrapping); T stays, capped at its dial's top."""
    following = RULE_CYCLE[(RULE_CYCLE.index(settings.rule) + 1) % len(RULE_CYCLE)]
    top, _ = dial_scale(replace(settings, rule=following), greedy)
    return {"rule": following, "threshold": min(settings.threshold, top)}


BAR_CELLS = 8
DRAFT_LENGTH = {
    "goodput": "k ≤ {k} goodput",
    "fixed": "k {k}",
    "heuristic": "k {k} heuristic",
    "latency": "k ≤ {k} latency",
}
"""How the dial shows the draft length under each draft policy."""
EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(fraction: float, cells: int = BAR_CELLS) -> str:
    """A horizontal bar `cells` wide filled to `fraction` (clamped to 0..1), in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, fraction)) * cells * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (EIGHTHS[part] if part else "")
    return text.ljust(cells)


class ThresholdDial(Widget, can_focus=True):
    """A focusable float dial over [0, top of the divergence's range]."""

    BINDINGS: ClassVar[list[BindingType]] = [*DIAL_BINDINGS]

    settings: reactive[DecodingSettings] = reactive(DecodingSettings)
    autoregressive: reactive[bool] = reactive(False)
    paused: reactive[str | None] = reactive(None)
    """Why the draft policy takes target-only steps (`StepStats.paused`; None: it drafts)."""
    greedy: reactive[bool] = reactive(False)
    """Greedy decoding: T is a regret bound (`dial_scale`, `threshold_unit`)."""

    def render(self) -> Content:
        """The dial line."""
        s = self.settings
        if self.autoregressive:
            return Content.assemble(("T  —  ", "$text-muted"), ("autoregressive: no drafting", "$text-muted"))
        top, _ = dial_scale(s, self.greedy)
        # The unit T is in, then the rule.
        rule = f"{threshold_unit(s, self.greedy)} {s.rule}"
        return Content.assemble(
            (f"T {s.threshold:.2f} ", "bold"),
            ("▕", "$text-muted"),
            (bar(s.threshold / top), "$accent"),
            ("▏", "$text-muted"),
            f" {rule}",
            # Paused: target-only steps (k 0); the stats strip says why (the dial has no room).
            (" · k 0 paused", "$warning")
            if self.paused
            else (f" · {DRAFT_LENGTH[s.draft_policy].format(k=s.draft_tokens)}", "$text-muted"),
        )
