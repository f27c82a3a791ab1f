"""The multi-line prompt: Enter sends, ctrl+j inserts a newline (both remappable)."""

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
        """The user sent `text` (the widget keeps it until the chat takes it)."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def action_submit(self) -> None:
        """Send the prompt's text."""
        self.post_message(self.Submitted(self.text))

    def action_newline(self) -> None:
        """Insert a line break at the cursor."""
        self.insert("\n")
