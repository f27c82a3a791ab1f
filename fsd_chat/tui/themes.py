"""fsd-chat theme files -> Textual `Theme`s whose variables carry the token-origin colours.

Widgets style tokens with `$origin-<origin>` (e.g. `$origin-draft-fuzzy`), so every colour comes
from the active theme; Textual's own themes fall back to the default theme's origin colours.
"""

from __future__ import annotations

from typing import Any

from textual.command import DiscoveryHit, Hit, Hits
from textual.content import Content
from textual.theme import Theme, ThemeProvider

from fsd_chat.decoding.events import Origin
from fsd_chat.support.text import visible
from fsd_chat.tui.theme_files import ThemeSpec, default_origin_styles


def origin_variable(origin: Origin) -> str:
    """The theme variable holding an origin's colour, e.g. "origin-draft-exact"."""
    return f"origin-{origin.value}"


def origin_style(origin: Origin) -> str:
    """A Content style string for an origin's tokens (resolved against the active theme)."""
    return f"${origin_variable(origin)}"


def origin_variables(origins: dict[Origin, str]) -> dict[str, str]:
    """Theme variables for a mapping of origin -> colour."""
    return {origin_variable(o): colour for o, colour in origins.items()}


def default_variables() -> dict[str, str]:
    """Origin variables of the default theme (for themes that do not set them)."""
    return origin_variables(default_origin_styles())


def to_textual(spec: ThemeSpec) -> Theme:
    """A Textual `Theme` from a parsed theme file."""
    # Theme's colour fields are keyword arguments named as the file's [palette] keys (checked on load).
    palette: dict[str, Any] = dict(spec.palette)
    return Theme(name=spec.name, dark=spec.dark, variables=origin_variables(spec.origins), **palette)


class LiteralThemeProvider(ThemeProvider):
    """Textual's theme picker, showing each theme's name as text: a user theme's name is data, and
    Textual's own provider reads it as markup and passes its control characters (an OSC sequence
    would set the terminal's title) to the terminal."""

    async def discover(self) -> Hits:
        """Every theme, by name."""
        for name, callback in self.commands:
            yield DiscoveryHit(Content(visible(name)), callback, text=name)

    async def search(self, query: str) -> Hits:
        """The themes whose names match `query`, best first."""
        matcher = self.matcher(query)
        for name, callback in self.commands:
            if (score := matcher.match(name)) > 0:
                yield Hit(score, Content(visible(name)), callback, text=name)
