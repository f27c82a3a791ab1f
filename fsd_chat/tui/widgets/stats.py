"""The stats strip: both sides of the dial. Over the last few steps (so a retune shows at once):
tokens/s, acceptance rate and mean accepted length τ; since the reply's first token: the fuzzy share
and the cost in nats per token (each token's KL divergence from the target's law; see
`fsd_chat.decoding.acceptance`), a budget the whole reply spends; and why speculation is paused when
the draft policy takes target-only steps; then a sparkline of tokens per step. Where the strip is
narrower than its full line (an 80-column terminal) the figures are abbreviated, never dropped.
"""

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
FULL_WIDTH = 102
"""Cells the strip needs for its full figures (the widest, 92: a paused mapped draft's reason) and
its sparkline (app.tcss); below it the figures are abbreviated (70 at most)."""
NOTABLE_COST = 0.02
"""Cost per token (nats) from which the figure takes the theme's warning colour."""


def cost_figure(cost_per_token: float) -> Content:
    """The cost per token, coloured by the theme: success at 0 (lossless), warning when notable."""
    if cost_per_token == 0:
        return Content.styled("cost 0", "$success")
    style = "$warning" if cost_per_token >= NOTABLE_COST else ""
    return Content.styled(f"cost {cost_per_token:.3f}/tok", style)


def _reply_cost(reply: GenerationStats) -> Content:
    return cost_figure(reply.cost_per_token) if reply.steps else Content("cost –")


class StatsStrip(Horizontal):
    """Live figures of the recent decoding steps and of the reply so far.

    Args:
        target_only: Autoregressive decoding: it drafts nothing, so the strip shows no acceptance,
            τ or fuzzy share (a τ of tokens per target pass would read as a speculation that
            never happened).
    """

    def __init__(self, *, target_only: bool = False, id: str | None = None) -> None:
        super().__init__(id=id)
        self.target_only = target_only
        self._steps: deque[Step] = deque(maxlen=SPARK_STEPS)
        self._reply = GenerationStats()

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

    @property
    def reply(self) -> GenerationStats:
        """Totals since the reply's first token (`begin_reply`)."""
        return self._reply

    def _figures(self) -> Content:
        w, reply = self.window(), self._reply
        compact = 0 < self.size.width < FULL_WIDTH
        if self.target_only:
            rate = f"{w.tokens_per_second:5.0f}" if w.steps else "–"
            return Content.assemble(f"{rate} tok/s  ", _reply_cost(reply), ("  target only", "$text-muted"))
        if not w.steps:
            return Content("tok/s –   cost –   acc –   τ –   fuzzy –")
        # The cost sits beside tokens/s: the two sides of the dial, read together.
        rate = f"{w.tokens_per_second:.0f} tok/s " if compact else f"{w.tokens_per_second:5.0f} tok/s  "
        # Nothing drafted in the window (paused): no acceptance to show.
        acceptance = f"{w.acceptance_rate:4.0%}" if w.drafted else "   –"
        figures = (
            f" τ {w.mean_accepted_length:.2f} fuzzy {reply.fuzzy_share:.0%}"
            if compact
            else f"  acc {acceptance}  τ {w.mean_accepted_length:4.2f}  fuzzy {reply.fuzzy_share:4.0%}"
        )
        # Target-only steps, since drafting does not pay: why, in the policy's words.
        paused = Content.styled(f" ⏸ {w.paused}" if compact else f"  paused: {w.paused}", "$warning")
        return Content.assemble(
            rate,
            _reply_cost(reply),
            figures,
            # Prompt lookup drafts only where an n-gram matched: the share of steps it did.
            f"  lookup {w.lookup_hits}/{w.steps}" if w.lookup_hits and not compact and not w.paused else "",
            paused if w.paused else "",
        )

    def begin_reply(self) -> None:
        """A reply starts: its cost and fuzzy share count from its first token."""
        self._reply = GenerationStats()

    def add(self, steps: Iterable[Step]) -> None:
        """Take in a batch of steps and refresh once."""
        steps = list(steps)
        self._steps.extend(steps)
        for step in steps:
            self._reply.add(step)
        # One line of fixed size (see app.tcss): no layout of the screen for it.
        update_in_place(self.query_one("#figures", Static), self._figures())
        self.query_one("#spark", Sparkline).data = [s.stats.emitted for s in self._steps]

    def on_resize(self) -> None:
        """Abbreviate the figures, or spell them out, for the new width."""
        self.query_one("#figures", Static).update(self._figures())

    def clear(self) -> None:
        """Forget all steps (a new chat)."""
        self._steps.clear()
        self._reply = GenerationStats()
        self.query_one("#figures", Static).update(self._figures())
        self.query_one("#spark", Sparkline).data = []
