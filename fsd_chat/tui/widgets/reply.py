"""Conversation widgets: a user message, and an assistant reply coloured by token origin.

The reply is rebuilt from its runs as `Content` spans styled with the theme's `$origin-*`
variables; a ⟨…⟩ mark shows where the settings changed mid-reply. Once finished it also holds a
Markdown rendering, shown instead of the colours when the chat screen has the `-markdown` class.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Markdown, Static

from fsd_chat.decoding.events import Step
from fsd_chat.session import ReplyBuilder, ReplyRecord
from fsd_chat.transcript import reply_summary
from fsd_chat.tui.themes import origin_style


def provenance_content(record: ReplyRecord) -> Content:
    """The reply's text, each run in its origin's colour, with ⟨divergence T⟩ where T changed."""
    parts: list[Content | tuple[str, str] | str] = []
    previous = None
    for run in record.runs:
        if previous is not None and run.setting != previous:
            parts.append((f"⟨{run.divergence} T {run.threshold:.2f}⟩", "bold reverse $accent"))
        previous = run.setting
        parts.append((run.text, origin_style(run.origin)))
    if record.stop_reason == "stopped":
        parts.append((" ⏹ stopped", "bold $warning"))
    return Content.assemble(*parts)


class UserMessage(Static):
    """A user turn."""

    def __init__(self, text: str) -> None:
        super().__init__(Content(text), classes="user")


class ReplyView(Vertical):
    """An assistant reply: streams steps in, then shows its statistics.

    Args:
        record: A finished reply to show (a resumed session), or None to stream a new one.
    """

    def __init__(self, record: ReplyRecord | None = None) -> None:
        super().__init__(classes="reply")
        self.builder = ReplyBuilder()
        if record is not None:
            self.builder.record = record

    @property
    def record(self) -> ReplyRecord:
        """The reply so far."""
        return self.builder.record

    def compose(self) -> ComposeResult:
        """The coloured text and the statistics line (Markdown is added when finished)."""
        yield Static(provenance_content(self.record), classes="provenance")
        yield Static("", classes="reply-stats")

    def on_mount(self) -> None:
        """A finished record is shown complete."""
        if self.record.stop_reason is not None:
            self.finish()

    def add_step(self, step: Step) -> None:
        """Append one decoding step's tokens."""
        self.builder.add(step)
        self.query_one(".provenance", Static).update(provenance_content(self.record))

    def finish(self, error: str | None = None) -> None:
        """The reply ended: show its statistics (or `error`) and prepare the Markdown view."""
        self.query_one(".provenance", Static).update(provenance_content(self.record))
        summary = reply_summary(self.record) if error is None else f"error: {error}"
        self.query_one(".reply-stats", Static).update(Content(summary))
        self.add_class("-finished")
        self.mount(Markdown(self.record.text, classes="markdown"), before=".reply-stats")
