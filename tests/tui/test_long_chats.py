"""Long and hurried chats: keys that arrive in one burst, a store that fails at quit, prompts built
off the UI thread. Real pair, real SQLite file, real Textual pilot."""

from __future__ import annotations

import copy
import sqlite3
import time
from pathlib import Path

import pytest
from textual import events
from textual.keys import _character_to_key

from fsd_chat.conversation.session import Session, Turn, now
from fsd_chat.conversation.store import SessionStore
from fsd_chat.models.chat_template import PromptBuilder
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.screens.chat import ChatScreen
from fsd_chat.tui.screens.help import HelpScreen
from fsd_chat.tui.widgets.prompt import PromptInput
from tests.tui.helpers import SIZE, GatedDecoder, make_app, wait_for, wait_for_chat


def post_burst(app: object, keys: list[str]) -> None:
    """Post key events to the app in one batch, as a terminal delivers a burst (SSH, tmux
    send-keys): no key is handled before the last one is queued."""
    for key in keys:
        character = key if len(key) == 1 else ("\r" if key == "enter" else None)
        name = _character_to_key(key) if len(key) == 1 else key
        app.post_message(events.Key(name, character))  # type: ignore[attr-defined]


async def test_a_burst_of_keys_sends_exactly_what_was_typed(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        messages = ["Once upon a time", "alpha beta gamma delta epsilon zeta", "theta 3"]
        for number, text in enumerate(messages, start=1):
            post_burst(app, [*text, "enter"])
            gate[0].allow(100)
            await wait_for(
                pilot, lambda n=number: screen.streaming is None and len(screen.session.turns) == 2 * n
            )  # type: ignore[misc]
        assert [t.content for t in screen.session.turns[::2]] == messages
        # Typed after Enter in the same burst: kept in the prompt, not cleared with the sent text.
        post_burst(app, [*"one", "ctrl+j", *"two", "enter", *"three"])
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 8)
        assert screen.session.turns[6].content == "one\ntwo"
        assert screen.query_one(PromptInput).text == "three"


@pytest.mark.slow
async def test_quitting_with_a_locked_store_keeps_the_exchange_in_a_transcript(
    pair: ModelPair, tmp_path: Path
) -> None:
    path = tmp_path / "data" / "sessions.sqlite3"
    store = SessionStore(path, busy_timeout=0.2)
    earlier = Session("0ld5e551", now(), {}, {}, None, [Turn("user", "Earlier")])
    store.append_turns(earlier, earlier.turns)
    app = make_app(pair, tmp_path, max_new_tokens=4, store=store)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holds the database for the whole chat
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
            await pilot.press(*"Hello there", "enter")
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            await wait_for(pilot, lambda: screen.streaming is None and screen.session.turns)
            reply = screen.session.turns[1].content
            started = time.monotonic()
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: app.return_code is not None)
            assert any(n.title == "Session not saved yet" for n in app._notifications)
    finally:
        locker.execute("ROLLBACK")
    assert time.monotonic() - started >= 2 * 0.2  # it retried
    assert app.return_code == 1
    (note,) = app.exit_notes
    assert note.startswith(
        f"fsd-chat: the last exchange could not be saved to {path}; the unsaved session is in "
    )
    (transcript,) = (tmp_path / "data").glob("unsaved-fsd-chat-*.md")
    assert str(transcript) in note
    text = transcript.read_text()
    assert "Hello there" in text and reply in text
    assert [s.id for s in SessionStore(path).summaries()] == [earlier.id]  # the store did not have it


LOOPING_TEMPLATE = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


@pytest.mark.slow
async def test_a_runaway_template_leaves_the_chat_working(pair: ModelPair, tmp_path: Path) -> None:
    app = make_app(pair, tmp_path, max_new_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        tokenizer = copy.deepcopy(pair.tokenizer)
        tokenizer.chat_template = LOOPING_TEMPLATE
        screen.chat.prompts = PromptBuilder(tokenizer, raw=False)
        await pilot.press(*"Hello", "enter")
        await pilot.pause(0.3)
        await pilot.press("f1")  # the UI answers while the template runs
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        app.pop_screen()
        await pilot.press("escape")  # cancels the render
        await wait_for(pilot, lambda: screen.streaming is None)
        (note,) = [n for n in app._notifications if n.title == "Message not sent"]
        assert note.message == "stopped while the chat template was rendering"
        assert screen.query_one(PromptInput).text == "Hello" and not screen.session.turns
        screen.chat.prompts = PromptBuilder(tokenizer, raw=False, seconds=0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.streaming is None and len(app._notifications) == 2)
        assert list(app._notifications)[-1].message == "the chat template ran past 0.3 s"
        screen.chat.prompts = PromptBuilder(pair.tokenizer, raw=False)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2)
        assert screen.session.turns[0].content == "Hello"
