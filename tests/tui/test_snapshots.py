"""Snapshots (pytest-textual-snapshot) at a fixed terminal size: the main screen with a reply
coloured by origin and retuned mid-reply, the help screen, and the export dialog.

The reply is the real engine's (greedy, so deterministic); only the step timings are fixed, so
that tokens/s does not change between runs. Update with `pytest tests/tui --snapshot-update`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.pilot import Pilot

from fsd_chat.conversation.session import Session
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.widgets.prompt import PromptInput
from tests.tui.helpers import GatedDecoder, make_app, wait_for, wait_for_chat

TERMINAL = (110, 34)


async def steady(pilot: Pilot) -> None:
    """Wait for the chat screen, and stop cursors blinking (a blink would change the picture)."""
    await wait_for_chat(pilot)
    pilot.app.screen.query_one(PromptInput).cursor_blink = False


@pytest.fixture
def snapshot_app(pair: ModelPair, tmp_path: Path) -> tuple[FsdChatApp, list[GatedDecoder]]:
    """The app with a fixed session id and date, a gated fixed-clock decoder, relative paths."""
    session = Session(
        id="5eed0001",
        created="2025-01-01T12:00:00+00:00",
        models={"target": str(pair.target_spec.source), "draft": str(pair.draft_spec.source)},
        settings={},
    )
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, fixed_clock=True, max_new_tokens=120, resume=session)
    app.options.transcripts_dir = Path("transcripts")
    return app, gate


@pytest.mark.slow
def test_main_screen_with_a_coloured_reply(snap_compare, snapshot_app) -> None:  # type: ignore[no-untyped-def]
    app, gate = snapshot_app

    async def run_before(pilot: Pilot) -> None:
        await steady(pilot)
        await pilot.press(*"Once upon a time", "enter")
        gate[0].allow(8)
        await wait_for(pilot, lambda: len(gate[0].steps) == 8)
        await pilot.press("ctrl+up", "ctrl+up", "ctrl+up", "ctrl+up", "ctrl+up")
        gate[0].allow(200)
        await wait_for(pilot, lambda: app.screen.streaming is None)  # type: ignore[attr-defined]
        await pilot.pause()

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)


@pytest.mark.slow
def test_help_screen(snap_compare, snapshot_app) -> None:  # type: ignore[no-untyped-def]
    app, _ = snapshot_app

    async def run_before(pilot: Pilot) -> None:
        await steady(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)


@pytest.mark.slow
def test_export_dialog(snap_compare, snapshot_app) -> None:  # type: ignore[no-untyped-def]
    app, _ = snapshot_app

    async def run_before(pilot: Pilot) -> None:
        await steady(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.query("#export-path"))
        app.screen.query_one("#export-path").cursor_blink = False  # type: ignore[attr-defined]
        await pilot.pause()

    assert snap_compare(app, terminal_size=TERMINAL, run_before=run_before)
