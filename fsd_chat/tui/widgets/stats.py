"""The stats strip: both sides of the dial over the last few steps (so a retune shows at once):
tokens/s, acceptance rate, mean accepted length τ and fuzzy share, and the cost in nats per token
(each token's KL divergence from the target's law; see `fsd_chat.decoding.acceptance`), and why
speculation is paused when the draft policy takes target-only steps; then a sparkline of tokens per
step."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Sparkline, Static

from fsd_chat.decoding.events import GenerationStats, Step
from fsd_chat.tui.widgets.conversation import update_in_place

WINDOW = 16
"""Steps the figures are taken over."""
SPARK_STEPS = 48
"""Steps the sparkline shows."""
NOTABLE_COST = 0.02
"""Cost per token (nats) from which the figure takes the theme's warning colour."""


def cost_figure(cost_per_token: float) -> Content:
    """The cost per token, coloured by the theme: success at 0 (lossless), warning when notable."""
    if cost_per_token == 0:
        return Content.styled("cost 0", "$success")
    style = "$warning" if cost_per_token >= NOTABLE_COST else ""
    return Content.styled(f"cost {cost_per_token:.3f}/tok", style)


class StatsStrip(Horizontal):
    """Live figures of the recent decoding steps.

    Args:
        target_only: Autoregressive decoding: it drafts nothing, so the strip shows no acceptance,
            τ or fuzzy share (a τ of tokens per target pass would read as a speculation that
            never happened).
    """

    def __init__(self, *, target_only: bool = False, id: str | None = None) -> None:
        super().__init__(id=id)
        self.target_only = target_only
        self._steps: deque[Step] = deque(maxlen=SPARK_STEPS)

    def compose(self) -> ComposeResult:
        """The figures, then the sparkline."""
        yield Static(self._figures(), id="figures")
        yield Sparkline([], id="spark")

    def window(self) -> GenerationStats:
        """Totals over the last `WINDOW` steps."""
        totals = GenerationStats()
        for step in list(self._steps)[-WINDOW:]:
            totals.add(step)
        return totals

    def _figures(self) -> Content:
        w = self.window()
        if self.target_only:
            rate = f"{w.tokens_per_second:5.0f}" if w.steps else "–"
            cost = cost_figure(w.cost_per_token) if w.steps else "cost –"
            return Content.assemble(f"{rate} tok/s  ", cost, ("  target only", "$text-muted"))
        if not w.steps:
            return Content("tok/s –   cost –   acc –   τ –   fuzzy –")
        # The cost sits beside tokens/s: the two sides of the dial, read together.
        speed = (f"{w.tokens_per_second:5.0f} tok/s  ", cost_figure(w.cost_per_token))
        if w.paused:
            # Target-only steps, since drafting does not pay: why, in the policy's words, in place
            # of the draft's figures.
            return Content.assemble(*speed, Content.styled(f"  paused: {w.paused}", "$warning"))
        return Content.assemble(
            *speed,
            f"  acc {w.acceptance_rate:4.0%}  τ {w.mean_accepted_length:4.2f}  fuzzy {w.fuzzy_share:4.0%}",
            # Prompt lookup drafts only where an n-gram matched: the share of steps it did.
            f"  lookup {w.lookup_hits}/{w.steps}" if w.lookup_hits else "",
        )

    def add(self, steps: Iterable[Step]) -> None:
        """Take in a batch of steps and refresh once."""
        self._steps.extend(steps)
        # One line of fixed size (see app.tcss): no layout of the screen for it.
        update_in_place(self.query_one("#figures", Static), self._figures())
        self.query_one("#spark", Sparkline).data = [s.stats.emitted for s in self._steps]

    def clear(self) -> None:
        """Forget all steps (a new chat)."""
        self._steps.clear()
        self.query_one("#figures", Static).update(self._figures())
        self.query_one("#spark", Sparkline).data = []
