"""The colour legend of token origins (colours from the theme's `$origin-*` variables)."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from fsd_chat.decoding.events import Origin
from fsd_chat.tui.themes import origin_style

# Speculative decoding emits plain `target` tokens too: the last token of a reply, when no room is
# left to draft.
SPECULATIVE_ORIGINS = tuple(Origin)


def legend_content(origins: tuple[Origin, ...]) -> Content:
    """`■ draft-exact  ■ draft-fuzzy ...`, each square in its origin's colour."""
    parts: list[Content | tuple[str, str] | str] = []
    for origin in origins:
        parts += [("■ ", origin_style(origin)), (origin.value, origin_style(origin)), "  "]
    return Content.assemble(*parts)


class Legend(Static):
    """One line naming the colour of each origin in use, after the kind of draft when it is not a
    draft model (`draft_label`, e.g. "prompt lookup (n ≤ 3)": then "draft" tokens were copied)."""

    def __init__(
        self, autoregressive: bool, *, draft_label: str | None = None, id: str | None = None
    ) -> None:
        content = legend_content((Origin.TARGET,) if autoregressive else SPECULATIVE_ORIGINS)
        if draft_label is not None and not autoregressive:
            content = Content.assemble((f"{draft_label}: ", "$text-muted"), content)
        super().__init__(content, id=id)
