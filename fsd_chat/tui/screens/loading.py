"""The screen shown while the models load: progress, then the error if loading fails."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Center, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, Static


class LoadingScreen(Screen[None]):
    """Loading progress; on failure, the error in one clear line and how to quit."""

    def __init__(self, describe: str) -> None:
        super().__init__()
        self.describe = describe

    def compose(self) -> ComposeResult:
        """Title, spinner, progress line, and a hidden error line."""
        with Center(), Vertical(id="loading-box"):
            yield Static(Content.from_markup("[b]fsd-chat[/b]"), id="loading-title")
            yield Static(Content(self.describe), id="loading-models")
            yield LoadingIndicator()
            yield Static(Content("starting"), id="loading-progress")
            yield Static("", id="loading-error")
        yield Footer()

    def show_progress(self, text: str) -> None:
        """Show the loader's current phase."""
        self.query_one("#loading-progress", Static).update(Content(text))

    def show_error(self, message: str) -> None:
        """Replace the spinner with the error."""
        self.query_one(LoadingIndicator).display = False
        self.query_one("#loading-progress", Static).update(Content("the models could not be loaded"))
        self.query_one("#loading-error", Static).update(
            Content.assemble((message, "bold $error"), "\n\nPress ctrl+q to quit.")
        )
