"""Theme files: a Textual palette plus the colours of the token origins, in TOML.

Built-in themes ship in `themes/` (inside the package once installed); users add their own as
`*.toml` in the config dir's `themes/` folder. A file looks like::

    name = "my-theme"
    dark = true
    [palette]        # Textual `Theme` colours: primary (required), secondary, accent, foreground,
                     # background, surface, panel, success, warning, error
    primary = "#5E9FE0"
    [origins]        # one colour per token origin (all five required)
    draft-exact = "#7FB069"
    draft-fuzzy = "#E5C07B"
    target-resampled = "#E06C75"
    target-bonus = "#61AFEF"
    target = "#D8DEE9"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from rich.color import Color, ColorParseError

from fsd_chat.decoding.events import Origin
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import read_settings_file

DEFAULT_THEME = "fsd-dark"
PALETTE_KEYS = (
    "primary",
    "secondary",
    "accent",
    "foreground",
    "background",
    "surface",
    "panel",
    "success",
    "warning",
    "error",
)


class ThemeError(FsdChatError):
    """A theme file cannot be used (bad TOML, missing or malformed colours)."""


@dataclass(frozen=True, slots=True)
class ThemeSpec:
    """A parsed theme file."""

    name: str
    dark: bool
    palette: dict[str, str]
    origins: dict[Origin, str]
    path: Path


def builtin_theme_dir() -> Path:
    """Where the built-in themes are: inside the installed package, or the repository's themes/."""
    package = Path(__file__).parents[1]  # fsd_chat/
    packaged = package / "themes"
    return packaged if packaged.is_dir() else package.parent / "themes"


def _colour(path: Path, key: str, value: object) -> str:
    try:
        Color.parse(str(value))
    except ColorParseError:
        raise ThemeError(f"theme {path.name}: {key} = {value!r} is not a colour") from None
    return str(value)


def parse_theme(path: Path) -> ThemeSpec:
    """Read one theme file.

    Raises:
        ThemeError: unreadable file, invalid TOML, or a missing/invalid field (one-line message).
    """
    try:
        data = read_settings_file(path)
    except OSError as exc:
        raise ThemeError(
            f"theme {path.name}: cannot read it ({exc.strerror or exc.__class__.__name__})"
        ) from None
    except UnicodeDecodeError as exc:
        raise ThemeError(f"theme {path.name}: cannot read it ({exc.__class__.__name__})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ThemeError(f"theme {path.name}: invalid TOML ({exc})") from None
    except RecursionError:
        raise ThemeError(f"theme {path.name}: invalid TOML (nested too deeply)") from None
    name = data.get("name", path.stem)
    palette = data.get("palette")
    origins = data.get("origins")
    if not isinstance(name, str) or not name:
        raise ThemeError(f"theme {path.name}: name must be a non-empty string")
    if not isinstance(palette, dict) or "primary" not in palette:
        raise ThemeError(f"theme {path.name}: needs a [palette] table with at least primary")
    if not isinstance(origins, dict):
        raise ThemeError(f"theme {path.name}: needs an [origins] table")
    unknown = set(palette) - set(PALETTE_KEYS)
    if unknown:
        raise ThemeError(f"theme {path.name}: unknown palette key(s) {', '.join(sorted(unknown))}")
    missing = [o.value for o in Origin if o.value not in origins]
    if missing:
        raise ThemeError(f"theme {path.name}: [origins] lacks {', '.join(missing)}")
    return ThemeSpec(
        name=name,
        dark=bool(data.get("dark", True)),
        palette={k: _colour(path, k, v) for k, v in palette.items()},
        origins={o: _colour(path, o.value, origins[o.value]) for o in Origin},
        path=path,
    )


def load_themes(user_dir: Path | None = None) -> tuple[dict[str, ThemeSpec], list[str]]:
    """All usable themes by name (built-ins first; a user theme may replace one), and one message
    per theme file that could not be used."""
    themes: dict[str, ThemeSpec] = {}
    errors: list[str] = []
    dirs = [builtin_theme_dir()] + ([user_dir] if user_dir is not None and user_dir.is_dir() else [])
    for directory in dirs:
        for path in sorted(directory.glob("*.toml")):
            try:
                spec = parse_theme(path)
            except ThemeError as exc:
                errors.append(str(exc))
            else:
                themes[spec.name] = spec
    return themes, errors


def default_origin_styles() -> dict[Origin, str]:
    """Origin colours of the default theme (for rich output outside the TUI)."""
    return parse_theme(builtin_theme_dir() / f"{DEFAULT_THEME}.toml").origins
