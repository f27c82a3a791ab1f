"""Conversation widgets: a user message, and an assistant reply coloured by token origin.

The reply's runs are shown as `Content` spans styled with the theme's `$origin-*` variables; a ⟨…⟩
mark shows where the settings changed mid-reply. While a reply streams, only its live tail (the
text after its last finished line) is re-assembled and re-wrapped on each update: finished lines
are frozen into a second widget, updated only when a line is finished, so the work per update
does not grow with the reply. Once the
reply ends it is rendered whole, once. The Markdown view of a finished reply is built the first
time it is shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.css.styles import RulesMap
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import Markdown, Static

from fsd_chat.conversation.session import (
    STOPPED,
    OriginRun,
    ReplyBuilder,
    ReplyRecord,
    Setting,
    marked_pieces,
)
from fsd_chat.conversation.transcript import reply_summary
from fsd_chat.decoding.events import Step
from fsd_chat.tui.themes import origin_style

LIVE_LIMIT = 1000
"""Characters the live tail may reach without a newline before it is frozen at a space (a very
long paragraph; the line break this leaves while streaming is gone in the final render)."""


def provenance_content(
    runs: Sequence[OriginRun], previous: Setting | None = None, stopped: bool = False
) -> Content:
    """`runs`' text, each run in its origin's colour, with a ⟨…⟩ mark naming what changed where
    the setting changed (from `previous`, the setting of the run before them; see
    `describe_setting`), and a stop mark if `stopped`."""
    parts: list[Content | tuple[str, str] | str] = [
        (f"⟨{piece.text}⟩", "bold reverse $accent")
        if piece.origin is None
        else (piece.text, origin_style(piece.origin))
        for piece in marked_pieces(runs, previous, digits=2)
    ]
    if stopped:
        parts.append((" ⏹ stopped", "bold $warning"))
    return Content.assemble(*parts)


def update_in_place(widget: Static, content: Content) -> None:
    """Show `content` in `widget`, laying the screen out again only when its height changes.

    `Static.update` asks for a layout by default: Textual then re-arranges every widget on the
    screen and redraws all of it, and a widget whose size changed asks for a second one. While a
    reply streams most updates leave the live tail's height as it was (the text grows within its
    last line), and a repaint of the widget alone shows them. The height is the widget's own
    measure (`Content.get_height`, what Textual's layout uses), at its current width.
    """
    size = widget.size
    # The styles as Textual's layout passes them (`Widget.get_content_height`): read by `.get`.
    rules = cast("RulesMap", widget.styles)
    same = size.width > 0 and content.get_height(rules, size.width) == size.height
    widget.update(content, layout=not same)


class TurnText(Static):
    """Text of a turn, whose change of size does not lay the screen out a second time."""

    # Textual's `virtual_size` asks for a layout of the whole screen when it changes, which it does
    # in every layout that changes a widget's size: each update that grows the streaming reply
    # (most of them, at speed) was laid out twice. The widgets of a turn do not scroll, so their
    # virtual size is their size, which the first layout has just placed: the second changed nothing.
    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)


class UserMessage(TurnText):
    """A user turn."""

    def __init__(self, text: str) -> None:
        super().__init__(Content(text), classes="user turn")


class ReplyView(Vertical):
    """An assistant reply: streams steps in, then shows its statistics.

    Args:
        record: A finished reply to show (a resumed session), or None to stream a new one.
    """

    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)
    """Not a second layout when its size changes (see `TurnText`)."""

    def __init__(self, record: ReplyRecord | None = None) -> None:
        super().__init__(classes="reply turn")
        self.builder = ReplyBuilder()
        if record is not None:
            self.builder.record = record
        self._live_run = 0
        """Index of the first run (partly) in the live tail."""
        self._live_offset = 0
        """Characters of that run already frozen."""
        self.live_chars = 0
        """Characters of the live tail at the last update (what that update re-assembled)."""
        self._frozen: list[Content] = []

    @property
    def record(self) -> ReplyRecord:
        """The reply so far."""
        return self.builder.record

    def compose(self) -> ComposeResult:
        """The frozen lines (while streaming), the coloured text (the live tail while streaming)
        and the statistics line."""
        frozen = TurnText(classes="provenance-frozen")
        frozen.display = False
        yield frozen
        yield TurnText(classes="provenance")
        yield TurnText("", classes="reply-stats")

    def on_mount(self) -> None:
        """A finished record is shown complete (as Markdown too when the chat shows Markdown)."""
        if self.record.stop_reason is not None:
            self.finish()
            if self.screen.has_class("-markdown"):
                self.show_markdown()

    def show_prefill(self, done: int, total: int) -> None:
        """Say how much of a long prompt the models have read, in the statistics line (the first
        step's statistics replace it)."""
        if not self.builder.totals.steps:
            self.query_one(".reply-stats", Static).update(
                Content(f"reading the prompt: {done:,} of {total:,} tokens ({done / total:.0%})")
            )

    def add_steps(self, steps: Iterable[Step]) -> None:
        """Append decoding steps' tokens; re-renders the live tail only."""
        if not self.builder.totals.steps:
            self.query_one(".reply-stats", Static).update("")  # the prompt is read
        for step in steps:
            self.builder.add(step)
        live = self._live_runs()
        text = "".join(run.text for run in live)
        cut = text.rfind("\n")
        if cut < 0 and len(text) > LIVE_LIMIT:
            cut = text.rfind(" ")
        if cut > 0:
            self._freeze(cut)
            live = self._live_runs()
        self.live_chars = sum(len(run.text) for run in live)
        update_in_place(
            self.query_one(".provenance", Static), provenance_content(live, self._previous_setting())
        )

    def _live_runs(self) -> list[OriginRun]:
        runs = self.record.runs[self._live_run :]
        if runs and self._live_offset:
            first = runs[0]
            runs[0] = OriginRun(
                first.text[self._live_offset :], first.origin, first.threshold, first.divergence, first.rule
            )
        return runs

    def _previous_setting(self) -> Setting | None:
        """The setting before the live tail (its first run's own when that run is partly frozen)."""
        if self._live_offset:
            return self.record.runs[self._live_run].setting
        return self.record.runs[self._live_run - 1].setting if self._live_run else None

    def _freeze(self, cut: int) -> None:
        """Move the live tail's first `cut` characters to the frozen widget; the character at
        `cut` (the newline or space that ends them) is dropped, the widget boundary breaks there."""
        frozen: list[OriginRun] = []
        previous = self._previous_setting()
        remaining = cut
        for run in self._live_runs():
            if remaining < len(run.text):
                if remaining:
                    frozen.append(
                        OriginRun(run.text[:remaining], run.origin, run.threshold, run.divergence, run.rule)
                    )
                self._live_offset += remaining + 1
                break
            frozen.append(run)
            remaining -= len(run.text)
            self._live_run += 1
            self._live_offset = 0
        # The separator may be the last character of a run: move on to the next one.
        if self._live_run < len(self.record.runs) and self._live_offset >= len(
            self.record.runs[self._live_run].text
        ):
            self._live_run += 1
            self._live_offset = 0
        self._frozen.append(provenance_content(frozen, previous))
        widget = self.query_one(".provenance-frozen", Static)
        widget.update(Content("\n").join(self._frozen))
        widget.display = True

    def finish(self, error: str | None = None) -> None:
        """The reply ended: render it whole once and show its statistics (or `error`)."""
        self._frozen.clear()
        frozen = self.query_one(".provenance-frozen", Static)
        frozen.update("")
        frozen.display = False
        stopped = self.record.stop_reason == STOPPED
        self.query_one(".provenance", Static).update(provenance_content(self.record.runs, stopped=stopped))
        summary = reply_summary(self.record) if error is None else f"error: {error}"
        self.query_one(".reply-stats", Static).update(Content(summary))
        self.add_class("-finished")

    def on_markdown_link_clicked(self, event: Markdown.LinkClicked) -> None:
        """Show a clicked link's target rather than open it: model output is not to be trusted."""
        event.stop()
        self.notify(f"Link (not opened): {event.href}", title="Link", timeout=8)

    def show_markdown(self) -> None:
        """Build the Markdown view, the first time the chat shows finished replies as Markdown."""
        if self.has_class("-finished") and not self.query(Markdown):
            # Links in model output are not followed on a click: the URL is shown instead.
            self.mount(
                Markdown(self.record.text, classes="markdown", open_links=False), before=".reply-stats"
            )
