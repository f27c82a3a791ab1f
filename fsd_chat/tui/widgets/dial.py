"""The threshold dial: `T 0.30 ▕████▍    ▏ js · fuzzy · k 5` (Textual has no slider widget).

It shows the `DecodingSettings` in force; left/right (when focused) and the chat keys move T
through the chat screen's actions, which update the shared `Controls`.
"""

from __future__ import annotations

from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from fsd_chat.decoding.divergence import DIAL_RANGE
from fsd_chat.decoding.settings import DecodingSettings
from fsd_chat.tui.keys import DIAL_BINDINGS

BAR_CELLS = 10
DRAFT_LENGTH = {"fixed": "k {k}", "adaptive": "k {k} adaptive", "cost": "k ≤ {k} cost"}
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

    BINDINGS = DIAL_BINDINGS

    settings: reactive[DecodingSettings] = reactive(DecodingSettings)
    autoregressive: reactive[bool] = reactive(False)

    def render(self) -> Content:
        """The dial line."""
        s = self.settings
        if self.autoregressive:
            return Content.assemble(("T  —  ", "$text-muted"), ("autoregressive: no drafting", "$text-muted"))
        top = DIAL_RANGE[s.divergence]
        return Content.assemble(
            (f"T {s.threshold:.2f} ", "bold"),
            ("▕", "$text-muted"),
            (bar(s.threshold / top), "$accent"),
            ("▏", "$text-muted"),
            f" {s.divergence} · {s.rule}",
            (f" · {DRAFT_LENGTH[s.draft_policy].format(k=s.draft_tokens)}", "$text-muted"),
        )
