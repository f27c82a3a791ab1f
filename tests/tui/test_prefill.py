"""A long paste shows how much of it the models have read before its first token: the real app, the
real offline pair (with a chunk small enough for its 512-token window to hold several)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Static

from fsd_chat.decoding import reply as reply_module
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.screens.chat import ChatScreen
from fsd_chat.tui.widgets.conversation import ReplyView
from tests.test_chat_prefill import CHUNK, PROMPT
from tests.tui.helpers import SIZE, make_app, tokens_read, wait_for, wait_for_chat


def held_app(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, done: int
) -> tuple[Any, threading.Event, threading.Event]:
    """The app (prompts read in CHUNK-token chunks, 10-token replies) whose decoding thread is held
    once the prefill reports `done` tokens read (10 s at most, so a failing test does not hang);
    the event set when it is held, and the one that releases it."""
    monkeypatch.setattr(reply_module, "PREFILL_CHUNK", CHUNK)
    app = make_app(pair, tmp_path, max_new_tokens=10)
    held, release = threading.Event(), threading.Event()
    report = app.controls.report_prefill

    def report_and_hold(read: int, total: int) -> None:
        report(read, total)
        if read == done:
            held.set()
            release.wait(10)

    monkeypatch.setattr(app.controls, "report_prefill", report_and_hold)
    return app, held, release


@pytest.mark.slow
async def test_a_long_prompt_shows_the_tokens_read_so_far(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Held after the second chunk, so that the screen can be read mid-prefill.
    app, held, release = held_app(pair, tmp_path, monkeypatch, 2 * CHUNK)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        screen.query_one("#prompt").insert(PROMPT)  # type: ignore[attr-defined]  # a paste
        await pilot.press("enter")
        await wait_for(pilot, lambda: held.is_set())
        reply = screen.query(ReplyView).last()
        stats = reply.query_one(".reply-stats", Static)
        await wait_for(pilot, lambda: "reading the prompt" in str(stats.render()))
        # The prompt's tokens but its last (which the first step feeds).
        total = len(prompt_ids(pair.tokenizer, [Message("user", PROMPT.strip())])) - 1
        percent = f"{2 * CHUNK / total:.0%}"
        assert str(stats.render()) == f"reading the prompt: {2 * CHUNK:,} of {total:,} tokens ({percent})"
        release.set()
        await wait_for(pilot, lambda: screen.streaming is None)
        assert str(stats.render()).startswith("10 tokens · ")  # the reply's statistics replace it


@pytest.mark.slow
async def test_escape_while_the_prompt_is_read_ends_the_reply_within_a_chunk(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Held after the first chunk while esc is pressed.
    app, held, release = held_app(pair, tmp_path, monkeypatch, CHUNK)
    with tokens_read(pair.target) as fed:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            fed.clear()  # the decoder checked at load that its KV cache rolls back (a forward pass)
            screen.query_one("#prompt").insert(PROMPT)  # type: ignore[attr-defined]  # a paste
            await pilot.press("enter")
            await wait_for(pilot, lambda: held.is_set())
            await pilot.press("escape")
            release.set()
            await wait_for(pilot, lambda: screen.streaming is None)
            # One chunk of the prompt's several was read; the message sent stays in the conversation.
            assert fed == [CHUNK]
            assert [turn.content for turn in screen.session.turns][:1] == [PROMPT.strip()]
            reply = screen.query(ReplyView).last()
            assert reply.record.stop_reason == "stopped" and reply.record.text == ""
            # The prompt is usable again: the next message gets its reply.
            fed.clear()
            await pilot.press(*"The end", "enter")
            await wait_for(pilot, lambda: len(screen.session.turns) == 4 and screen.streaming is None)
            last = screen.session.turns[3].reply
            assert last is not None and last.stop_reason == "max-new-tokens"
