"""`--resume` reopens the dial where the session left it: the real CLI, the real app (driven by
Pilot instead of a terminal), the real offline pair and a real SQLite file."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding.settings import DecodingSettings
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.config import sessions_path
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.chat import ChatScreen
from fsd_chat.tui.widgets.dial import REGRET_RANGE, REGRET_STEP, ThresholdDial
from tests.test_cli_generate import run_cli
from tests.test_store import make_session
from tests.tui.helpers import SIZE, make_app, wait_for, wait_for_chat


def opened_dials(monkeypatch: pytest.MonkeyPatch) -> list[tuple[DecodingSettings, str]]:
    """Where each chat the CLI starts opens its dial: (the controls, the dial's line). The app is
    the real one, run under Pilot instead of the terminal, and quit once its chat is up."""
    opened: list[tuple[DecodingSettings, str]] = []

    def run(app: FsdChatApp) -> None:
        async def drive() -> None:
            async with app.run_test(size=SIZE) as pilot:
                await wait_for_chat(pilot)
                opened.append((app.controls.snapshot(), str(app.screen.query_one(ThresholdDial).render())))
                await pilot.press("ctrl+q")

        asyncio.run(drive())

    monkeypatch.setattr(FsdChatApp, "run", run)
    return opened


async def end_a_session_on_mixture(pair: ModelPair, tmp_path: Path) -> str:
    """One exchange, then the dial moved (fuzzy -> mixture, T up three steps) and the chat quit;
    returns the session's id."""
    app = make_app(pair, tmp_path, max_new_tokens=8, store=SessionStore(sessions_path()))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        await pilot.press(*"Once upon a time", "enter")
        await wait_for(pilot, lambda: len(screen.session.turns) == 2 and screen.streaming is None)
        await pilot.press("ctrl+g", "ctrl+up", "ctrl+up", "ctrl+up")
        return screen.session.id


# Not async: the CLI runs the app's event loop in this thread (its signal handlers need the main one).
@pytest.mark.slow
def test_resume_reopens_the_dial_the_session_ended_with(
    pair: ModelPair,
    tmp_path: Path,
    target_dir: Path,
    draft_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    session_id = asyncio.run(end_a_session_on_mixture(pair, tmp_path))
    stored = SessionStore(sessions_path()).load(session_id)
    # The story pair decodes greedily: T moves in regret steps, up to the dial's top.
    ended = min(0.1 + 3 * REGRET_STEP, REGRET_RANGE)
    assert stored.settings["rule"] == "fuzzy" and stored.settings["threshold"] == 0.1  # how it started
    assert stored.settings["dial"]["rule"] == "mixture"
    assert math.isclose(stored.settings["dial"]["threshold"], ended)

    opened = opened_dials(monkeypatch)
    args = [
        "--resume",
        session_id[:4],
        "--target",
        str(target_dir),
        "--draft",
        str(draft_dir),
        "--device",
        "cpu",
    ]
    assert run_cli(args, capsys) == (0, "", "")
    settings, line = opened[0]
    assert (
        settings.rule == "mixture" and math.isclose(settings.threshold, ended) and settings.draft_tokens == 4
    )
    assert f"T {ended:.2f}" in line and "mixture" in line
    # A flag still wins over the session's dial; what it does not name stays the session's.
    assert run_cli([*args, "--threshold", "0.3"], capsys)[0] == 0
    assert opened[1][0].threshold == 0.3 and opened[1][0].rule == "mixture"


@pytest.mark.slow
def test_a_session_saved_before_the_dial_was_kept_resumes_where_it_started(
    tmp_path: Path,
    target_dir: Path,
    draft_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Its settings hold no "dial" (fuzzy js T 0.1, k 4, as saved before this version).
    old = make_session("feedbeef")
    assert "dial" not in old.settings
    SessionStore(sessions_path()).append_turns(old, old.turns)
    opened = opened_dials(monkeypatch)
    args = ["--resume", "feedbeef", "--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu"]
    assert run_cli(args, capsys) == (0, "", "")
    settings, _ = opened[0]
    assert (settings.rule, settings.divergence, settings.threshold, settings.draft_tokens) == (
        "fuzzy",
        "js",
        0.1,
        4,
    )
