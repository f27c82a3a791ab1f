"""The chat decodes as its options ask: target-only with `autoregressive`, else speculatively, with
the draft compiled under `compile_draft` (the app's own decoder factory, `ModelPair.decoder`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsd_chat.decoding import AutoregressiveDecoder, SpeculativeDecoder
from fsd_chat.decoding.kv_cache import CompiledModel
from fsd_chat.models import ModelPair
from fsd_chat.store import SessionStore
from fsd_chat.tui.app import ChatOptions, FsdChatApp
from fsd_chat.tui.screens.chat import ChatScreen
from tests.tui.helpers import SIZE, wait_for_chat


@pytest.mark.parametrize(
    ("autoregressive", "compile_draft", "decoder_type", "compiled"),
    [
        (True, True, AutoregressiveDecoder, False),  # no draft to compile
        (False, False, SpeculativeDecoder, False),
        (False, True, SpeculativeDecoder, True),
    ],
)
async def test_the_chat_builds_the_decoder_its_options_ask_for(
    pair: ModelPair,
    tmp_path: Path,
    autoregressive: bool,
    compile_draft: bool,
    decoder_type: type,
    compiled: bool,
) -> None:
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(tmp_path / "sessions.sqlite3"),
        autoregressive=autoregressive,
        compile_draft=compile_draft,
    )
    app = FsdChatApp(options, loader=lambda progress: pair)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert isinstance(app.screen, ChatScreen)
        decoder = app.screen.setup.decoder
        assert type(decoder) is decoder_type
        assert decoder.controls is app.controls  # type: ignore[attr-defined]
        assert isinstance(getattr(decoder, "draft", None), CompiledModel) == compiled
