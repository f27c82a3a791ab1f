"""The chat decodes as its options ask: target-only with `autoregressive`, else speculatively, in
whole steps by default on the CPU (`whole_step`), the models or the steps compiled under `compiled`
(the app's own decoder factory, `ModelPair.decoder`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from textual.widgets import Static

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.store import SessionStore
from fsd_chat.conversation.transcript import render_markdown
from fsd_chat.decoding import AutoregressiveDecoder, SpeculativeDecoder
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.engines.torch_engine.kv_cache import CachedModel, CompiledModel, StaticModel
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.chat import ChatScreen
from tests.tui.helpers import SIZE, wait_for, wait_for_chat


@pytest.mark.parametrize(
    ("autoregressive", "compile", "whole_step", "decoder_type", "runner_type"),
    [
        (True, True, False, AutoregressiveDecoder, CompiledModel),  # per-forward steps, compiled
        (False, False, False, SpeculativeDecoder, CachedModel),  # per-forward steps, eager
        (False, False, None, SpeculativeDecoder, StaticModel),  # the CPU's default: whole steps
        (False, True, None, SpeculativeDecoder, StaticModel),  # whole steps, their functions compiled
    ],
)
@pytest.mark.slow
async def test_the_chat_builds_the_decoder_its_options_ask_for(
    pair: ModelPair,
    tmp_path: Path,
    autoregressive: bool,
    compile: bool,
    whole_step: bool | None,
    decoder_type: type,
    runner_type: type,
) -> None:
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(tmp_path / "sessions.sqlite3"),
        autoregressive=autoregressive,
        compiled=compile,
        whole_step=whole_step,
    )
    app = FsdChatApp(options, loader=lambda progress: pair)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert isinstance(app.screen, ChatScreen)
        decoder = app.screen.chat.decoder
        assert type(decoder) is decoder_type
        assert decoder.controls is app.controls  # type: ignore[attr-defined]
        assert type(decoder.cached_models[-1]) is runner_type  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_a_target_alone_chats_with_prompt_lookup_and_says_so(target_dir: Path, tmp_path: Path) -> None:
    pair = load_pair(ModelSpec(str(target_dir)), ModelSpec(LOOKUP), LoadOptions(device="cpu"))
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(tmp_path / "sessions.sqlite3"),
        max_new_tokens=30,
    )
    app = FsdChatApp(options, loader=lambda progress: pair)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        assert isinstance(screen.chat.decoder, SpeculativeDecoder)
        assert isinstance(screen.chat.decoder.proposer, PromptLookup)
        header = screen.query_one("#header", Static).render()
        assert "draft: prompt lookup (n ≤ 3), no draft model" in str(header)
        legend = screen.query_one("#legend", Static).render()
        assert str(legend).startswith("prompt lookup (n ≤ 3): ■ draft-exact")
        await pilot.press(*"Lily had a red ball. Lily had a red ball. Lily had", "enter")
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2, 120)
        assert screen.session.models["draft"] == LOOKUP
        assert "lookup hits" in render_markdown(screen.session)


@pytest.mark.slow
async def test_a_failed_compilation_is_told_once_and_the_chat_goes_on(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real failure: no C++ compiler, and no compiled code to reuse. It is found before anything
    # is traced (`kv_cache.compiler_refusal`), so the chat starts eagerly at once. The chat loads
    # in its worker threads, where the settings a test makes (`config.cpp.cxx = ...`) do not
    # reach: torch keeps them per thread. Their defaults are shared, so those are changed.
    entries = torch._inductor.config._config
    monkeypatch.setattr(entries["cpp.cxx"], "default", (None, "/nonexistent/c++"))
    monkeypatch.setattr(entries["fx_graph_cache"], "default", False)
    torch._dynamo.reset()
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(tmp_path / "sessions.sqlite3"),
        compiled=True,
        max_new_tokens=20,
    )
    app = FsdChatApp(options, loader=lambda progress: pair)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            for turns in (2, 4):
                await pilot.press(*"Once upon a time", "enter")
                await wait_for(
                    pilot, lambda n=turns: screen.streaming is None and len(screen.session.turns) == n, 120
                )
            told = [n for n in app._notifications if n.title == "--compile failed"]
            assert len(told) == 1 and "C++ compiler" in told[0].message
            # The draft ran eagerly: both replies are whole.
            assert all(turn.content for turn in screen.session.turns)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
async def test_target_only_is_named_as_such(target_dir: Path, tmp_path: Path) -> None:
    # No draft given (prompt lookup is loaded) and --autoregressive: nothing is drafted, and no
    # screen or file speaks of a draft, an acceptance rate or τ.
    pair = load_pair(ModelSpec(str(target_dir)), ModelSpec(LOOKUP), LoadOptions(device="cpu"))
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(tmp_path / "sessions.sqlite3"),
        max_new_tokens=20,
        autoregressive=True,
    )
    app = FsdChatApp(options, loader=lambda progress: pair)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        header = str(screen.query_one("#header", Static).render())
        assert "target only (autoregressive), no draft" in header and "lookup" not in header
        await pilot.press(*"Once upon a time", "enter")
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2, 120)
        strip = str(screen.query_one("#figures", Static).render())
        assert "target only" in strip and "acc" not in strip and "τ" not in strip
        stats_line = str(screen.query(".reply-stats").last().render())
        assert "20 tokens" in stats_line and "acceptance" not in stats_line
    transcript = render_markdown(screen.session)
    assert "| Draft | none (target only) |" in transcript
    assert "| Decoding | autoregressive (target only) |" in transcript
    assert "lookup" not in transcript and "acceptance" not in transcript
