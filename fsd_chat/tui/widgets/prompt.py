"""The multi-line prompt: Enter sends, ctrl+j inserts a newline (both remappable).

Both keys are priority bindings, which the app runs as the key arrives, while the characters typed
just before it may still wait in this widget's message queue (a burst over SSH, or from tmux). Their
actions therefore act from this widget's queue, behind those characters: what was typed is what is
sent, and what was typed after Enter stays in the box.
"""

from __future__ import annotations

from typing import ClassVar

from textual.binding import BindingType
from textual.message import Message
from textual.widgets import TextArea

from fsd_chat.tui.keys import PROMPT_BINDINGS


class PromptInput(TextArea):
    """A TextArea whose Enter key sends the text instead of breaking the line."""

    BINDINGS: ClassVar[list[BindingType]] = [*PROMPT_BINDINGS]

    class Submitted(Message):
        """The user sent `text` (taken out of the box; see `PromptInput.give_back`)."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def action_submit(self) -> None:
        """Send the prompt's text, once the keys typed before Enter are in it."""
        self.call_later(self._take_text)

    def _take_text(self) -> None:
        text = self.text
        if text.strip():
            self.clear()
            self.post_message(self.Submitted(text))

    def give_back(self, text: str) -> None:
        """Put a message that was not sent back, before anything typed since."""
        if self.text:
            self.insert(text, location=(0, 0))
        else:
            self.insert(text)

    def action_newline(self) -> None:
        """Insert a line break at the cursor, once the keys typed before it are in."""
        self.call_later(self.insert, "\n")
