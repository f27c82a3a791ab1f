"""Start-up: loading view, load failure, themes (built-in, user, broken, unknown)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Static

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.store import SessionStore
from fsd_chat.engines.torch_engine import step_graph
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.loading import LoadingScreen
from tests.tui.helpers import SIZE, make_app, recording_loader, wait_for, wait_for_chat

USER_THEME = """
name = "my-theme"
dark = false
[palette]
primary = "#123456"
[origins]
draft-exact = "#010203"
draft-fuzzy = "#040506"
target-resampled = "#070809"
target-bonus = "#0a0b0c"
target = "#0d0e0f"
"""


async def test_load_failure_is_shown_on_the_loading_view(tmp_path: Path, target_dir: Path) -> None:
    options = ChatOptions(
        target=ModelSpec(str(target_dir)),
        draft=ModelSpec(str(tmp_path / "no-such-draft")),
        load=LoadOptions(device="cpu"),
        store=SessionStore(tmp_path / "s.sqlite3"),
    )
    app = FsdChatApp(options)  # the real loader: load_pair
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(
            pilot, lambda: "not found" in str(app.screen.query_one("#loading-error", Static).content)
        )
        assert isinstance(app.screen, LoadingScreen)
        error = str(app.screen.query_one("#loading-error", Static).content)
        assert f"model path not found: {tmp_path / 'no-such-draft'}" in error
        assert "ctrl+q" in error
        await pilot.press("ctrl+q")
    assert app.return_code == 0


@pytest.mark.slow
async def test_the_real_loader_reports_progress_then_opens_the_chat(
    tmp_path: Path, target_dir: Path, draft_dir: Path
) -> None:
    options = ChatOptions(
        target=ModelSpec(str(target_dir)),
        draft=ModelSpec(str(draft_dir)),
        load=LoadOptions(device="cpu", dtype="float32"),
        store=SessionStore(tmp_path / "s.sqlite3"),
    )
    seen: list[str] = []
    app = FsdChatApp(options, loader=recording_loader(options, seen))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert seen[-1] == "ready" and any("loading target model stories260K" in s for s in seen)
        header = str(app.screen.query_one("#header", Static).content)
        assert "target stories260K · draft stories260K-draft · cpu float32" in header
        # The sampling in force: the offline target's generation_config asks for none, so greedy.
        assert header.endswith(" · greedy")
        await pilot.press("f1")
        assert str(app.screen.query_one("#help-sampling", Static).content) == "greedy: built-in default"


async def test_user_theme_is_offered_and_broken_theme_falls_back(pair: ModelPair, tmp_path: Path) -> None:
    themes = tmp_path / "themes"
    themes.mkdir()
    (themes / "my-theme.toml").write_text(USER_THEME, encoding="utf-8")
    (themes / "broken.toml").write_text('name = "broken"\n[palette\nprimary = 1', encoding="utf-8")
    app = make_app(pair, tmp_path, theme="broken", user_themes_dir=themes)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert app.theme == "fsd-dark"
        messages = [n.message for n in app._notifications]
        assert any(m.startswith("theme broken.toml: invalid TOML") for m in messages)
        assert any("theme 'broken' is not available; using fsd-dark" in m for m in messages)
        assert app.theme_variables["origin-draft-fuzzy"].upper() == "#E5C07B"
        app.theme = "my-theme"  # a valid user theme, with its own origin colours
        await pilot.pause()
        assert app.theme_variables["origin-draft-fuzzy"] == "#040506"
        app.theme = "fsd-okabe-ito"
        await pilot.pause()
        assert app.theme_variables["origin-draft-exact"].upper() == "#009E73"
        app.theme = "textual-dark"  # Textual's own themes fall back to the default origin colours
        await pilot.pause()
        assert app.theme_variables["origin-target-bonus"].upper() == "#61AFEF"


async def test_whole_step_capture_progress_reaches_the_loading_screen(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `whole_step` the chat's own decoder factory builds a whole-step decoder in the loading
    thread, and the capture's progress is shown on the loading screen. On the CPU nothing is
    captured, so the progress calls `CapturedSteps` makes on CUDA are made here, around the real
    `make_steps`."""
    shown: list[str] = []
    monkeypatch.setattr(LoadingScreen, "show_progress", lambda screen, text: shown.append(text))
    make_steps = step_graph.make_steps

    def capturing(*args: Any, progress: Callable[[int, int], None] | None = None, **kwargs: Any) -> Any:
        assert progress is not None
        progress(0, 2)
        steps = make_steps(*args, progress=progress, **kwargs)
        progress(2, 2)
        return steps

    monkeypatch.setattr(step_graph, "make_steps", capturing)
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(tmp_path / "s.sqlite3"),
        transcripts_dir=tmp_path,
        whole_step=True,
    )
    app = FsdChatApp(options, loader=lambda progress: pair)  # the app's own decoder factory
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        # Compiled first by default (`compiled` None), as on CUDA; the line says so.
        first, last = (step_graph.capture_text(done, 2, compile=None) for done in (0, 2))
        assert first in shown and last in shown and first.startswith("compiling, then capturing")
        decoder = app.screen.chat.decoder  # type: ignore[attr-defined]
        assert isinstance(decoder._steps, step_graph.EagerSteps)
