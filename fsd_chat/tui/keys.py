"""Every key binding of the chat, with an id so `[keymap]` in config.toml can remap it.

Chat keys are priority bindings of the chat screen: they work while the prompt has focus and while
a reply streams. The help screen and the README's key table are built from these lists.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.keys import Keys, _character_to_key

from fsd_chat.support.config import ConfigError

APP_BINDINGS = [
    Binding("ctrl+q", "quit", "Quit", id="quit", priority=True, tooltip="Quit (the session is saved)"),
]
CHAT_BINDINGS = [
    Binding(
        "ctrl+up", "raise_threshold", "T+", id="raise-threshold", priority=True, tooltip="Raise T by one step"
    ),
    Binding(
        "ctrl+down",
        "lower_threshold",
        "T−",
        id="lower-threshold",
        priority=True,
        tooltip="Lower T by one step",
    ),
    Binding(
        "ctrl+r", "exact", "T=0", id="exact", priority=True, tooltip="Set T = 0: exact speculative decoding"
    ),
    Binding(
        "ctrl+t",
        "cycle_divergence",
        "Divergence",
        id="cycle-divergence",
        priority=True,
        tooltip="Cycle the divergence: kl, reverse-kl, js, tv",
    ),
    Binding(
        "ctrl+g",
        "cycle_rule",
        "Rule",
        id="cycle-rule",
        priority=True,
        tooltip="Cycle the acceptance rule: fuzzy, mixture, pure, exact",
    ),
    Binding(
        "escape",
        "stop",
        "Stop",
        id="stop",
        priority=True,
        tooltip="Stop the reply (the partial reply is kept)",
    ),
    Binding(
        "ctrl+o",
        "toggle_view",
        "Origins/MD",
        id="toggle-view",
        priority=True,
        tooltip="Toggle finished replies between origin colours and Markdown",
    ),
    Binding("ctrl+n", "new_chat", "New", id="new-chat", priority=True, tooltip="Start a new chat"),
    Binding(
        "ctrl+s", "export", "Export", id="export", priority=True, tooltip="Export the transcript as Markdown"
    ),
    Binding("f1", "help", "Help", id="help", priority=True, tooltip="Keys, colours and the dial explained"),
]
PROMPT_BINDINGS = [
    Binding("enter", "submit", "Send", id="send", priority=True, tooltip="Send the message"),
    Binding(
        "ctrl+j", "newline", "Newline", id="newline", priority=True, tooltip="Insert a newline in the prompt"
    ),
]
DIAL_BINDINGS = [
    Binding(
        "right", "screen.raise_threshold", "T+", id="dial-right", show=False, tooltip="Dial focused: raise T"
    ),
    Binding(
        "left", "screen.lower_threshold", "T−", id="dial-left", show=False, tooltip="Dial focused: lower T"
    ),
]
ALL_BINDINGS = APP_BINDINGS + PROMPT_BINDINGS + CHAT_BINDINGS + DIAL_BINDINGS


MODIFIERS = frozenset({"ctrl", "shift", "alt", "meta", "super", "hyper"})
KEY_NAMES = frozenset(
    {key.value.rsplit("+", 1)[-1] for key in Keys} | {_character_to_key(chr(code)) for code in range(33, 127)}
)
"""The keys Textual can report: its named keys (up, f1, escape, ...) and printable characters."""


def _known_key(key: str) -> bool:
    *modifiers, name = key.split("+")
    return name in KEY_NAMES and all(m in MODIFIERS for m in modifiers)


def check_keymap(keymap: dict[str, str]) -> None:
    """Reject a keymap naming a binding id that does not exist, or a key Textual never reports
    (a binding given one would silently stop working).

    Raises:
        ConfigError: an unknown id (with the list of known ones), or an unknown key name.
    """
    known = [b.id for b in ALL_BINDINGS if b.id]
    unknown = sorted(set(keymap) - set(known))
    if unknown:
        raise ConfigError(f"[keymap]: unknown binding id(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for binding_id, keys in keymap.items():
        bad = [key for key in keys.split(",") if not _known_key(key.strip())]
        if bad:
            raise ConfigError(
                f"[keymap]: {binding_id} = {keys!r}: unknown key {bad[0]!r} "
                "(keys look like ctrl+k, f5 or shift+up; several are separated by commas)"
            )


def key_rows(keymap: dict[str, str]) -> list[tuple[str, str, str]]:
    """(keys, binding id, what it does) for every binding, with the keymap applied."""
    return [(keymap.get(b.id or "", b.key), b.id or "", b.tooltip) for b in ALL_BINDINGS]
