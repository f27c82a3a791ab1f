"""The export dialog: a path pre-filled inside the transcripts folder; Enter writes it.

A bare name typed over the suggestion (`notes`) goes into the suggested folder, with `.md` added when
it has no extension: only a name with a folder part (`~/notes.md`, `./notes`) is taken as it is."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from fsd_chat.conversation.transcript import TranscriptError


class ExportScreen(ModalScreen[Path | None]):
    """Asks where to write the transcript; dismisses with the written path.

    Args:
        path: The suggested path.
        write: Writes the transcript to a path and returns the absolute path written.
    """

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, path: Path, write: Callable[[Path], Path]) -> None:
        super().__init__()
        self.path = path
        self.write = write

    def compose(self) -> ComposeResult:
        """Title, the path input and a hint."""
        with Vertical(id="export-box"):
            yield Label("Export the transcript (Markdown)", id="export-title")
            yield Input(str(self.path), id="export-path")
            yield Label("Enter writes it · Esc cancels", id="export-hint")

    def target(self, typed: str) -> Path:
        """The path `typed` names: a bare name goes into the suggested folder, with `.md` added
        when it has no extension."""
        path = Path(typed)
        if path.name == typed and typed != "..":  # no folder part: "notes", "notes.md"
            path = self.path.parent / (typed if path.suffix else typed + ".md")
        return path

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Write the file; on failure say why and stay open so the path can be fixed."""
        typed = event.value.strip()
        if not typed:
            self.notify("Give a file name (or press Esc).", title="Export", severity="warning")
            return
        try:
            written = self.write(self.target(typed))
        except TranscriptError as exc:
            self.notify(str(exc), title="Export failed", severity="error")
            return
        self.notify(str(written), title="Transcript written")
        self.dismiss(written)

    def action_cancel(self) -> None:
        """Close without writing."""
        self.dismiss(None)
