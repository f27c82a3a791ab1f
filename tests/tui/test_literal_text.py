"""Text from outside the code — theme names, paths, error messages, links in model output — is
shown literally in the chat: never read as Textual markup, never obeyed."""

from __future__ import annotations

from pathlib import Path

from textual.app import App, ComposeResult
from textual.widgets import Markdown

from fsd_chat.conversation.session import OriginRun, ReplyRecord
from fsd_chat.decoding.events import Origin
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.widgets.conversation import ReplyView
from tests.tui.helpers import SIZE, make_app, wait_for, wait_for_chat

HOSTILE = "[@click=app.bell]x[/] [link=file:///etc]y[/link] [/]"


async def test_a_theme_name_with_markup_is_shown_as_written(pair: ModelPair, tmp_path: Path) -> None:
    app = make_app(pair, tmp_path, theme=HOSTILE)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert any(HOSTILE in n.message for n in app._notifications)


async def test_an_error_quoting_a_path_with_markup_is_shown_as_written(
    pair: ModelPair, tmp_path: Path
) -> None:
    app = make_app(pair, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.query("#export-path"))
        path = f"/proc/{HOSTILE}\x1b]0;title\x07/t.md"
        app.screen.query_one("#export-path").value = path  # type: ignore[attr-defined]
        await pilot.press("enter")
        await pilot.pause()
        messages = [n.message for n in app._notifications]
        # (The path is normalised: file:/// becomes file:/.)
        shown = next(m for m in messages if m.startswith("cannot write /proc/"))
        assert "[@click=app.bell]x[/] [link=file:/etc]y[/link] [/]␛]0;title␇/t.md" in shown
        assert not any("\x1b" in m for m in messages)


class ReplyHost(App[None]):
    """A finished reply with a link, shown as Markdown."""

    def compose(self) -> ComposeResult:
        record = ReplyRecord(
            runs=[OriginRun("See [the docs](https://example.com/x).", Origin.TARGET, 0.0, "js", "fuzzy")]
        )
        view = ReplyView(record)
        yield view


async def test_a_link_in_a_reply_is_shown_not_opened(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    opened: list[str] = []
    monkeypatch.setattr(App, "open_url", lambda self, url, **kwargs: opened.append(url))
    app = ReplyHost()
    async with app.run_test() as pilot:
        view = app.query_one(ReplyView)
        view.finish(None)
        view.show_markdown()
        await pilot.pause()
        markdown = view.query_one(Markdown)
        markdown.post_message(Markdown.LinkClicked(markdown, "https://example.com/x"))
        await pilot.pause()
        assert opened == []
        assert any("https://example.com/x" in n.message for n in app._notifications)
