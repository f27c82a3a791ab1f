"""Streaming at decoding speed: the work per UI update does not grow with the reply or with the
turns on screen (asserted structurally: the text re-assembled per update, the widgets touched);
the timings are in scripts/bench_chat.py. Real pair, real app."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.app import App, ComposeResult
from textual.content import Content
from textual.widgets import Button, Markdown, Static

from fsd_chat.conversation.session import ReplyBuilder, Session, Turn, now
from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.decoding.events import Origin
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.screens.chat import SHOWN_TURNS, ChatScreen
from fsd_chat.tui.screens.help import colours_content
from fsd_chat.tui.widgets.conversation import LIVE_LIMIT, ReplyView, update_in_place
from fsd_chat.tui.widgets.legend import Legend
from tests.tui.helpers import SIZE, GatedDecoder, make_app, wait_for, wait_for_chat

PROMPT = "Once upon a time"


async def stream_long_reply(
    pilot, gate: list[GatedDecoder]
) -> tuple[ChatScreen, ReplyView, list[int], list[int]]:  # type: ignore[no-untyped-def]
    """Send PROMPT and stream the whole reply; returns the screen, the reply, and per update the
    characters re-assembled and the reply's length so far."""
    await wait_for_chat(pilot)
    await pilot.press(*PROMPT, "enter")
    screen: ChatScreen = pilot.app.screen
    reply = screen.streaming
    assert reply is not None
    live: list[int] = []
    lengths: list[int] = []
    add_steps = reply.add_steps

    def recording(steps):  # type: ignore[no-untyped-def]
        add_steps(steps)
        live.append(reply.live_chars)
        assert len(reply.children) == 3  # frozen lines, live line, statistics: no more widgets
        lengths.append(sum(len(r.text) for r in reply.record.runs))

    reply.add_steps = recording  # type: ignore[method-assign]
    gate[0].allow(1000)
    await wait_for(pilot, lambda: screen.streaming is None, timeout=60)
    return screen, reply, live, lengths


def engine_text(decoder: GatedDecoder) -> str:
    return "".join(step.text for step in decoder.steps)


@pytest.mark.slow
async def test_a_long_reply_re_renders_only_its_last_line(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        _, reply, live, lengths = await stream_long_reply(pilot, gate)
        text = engine_text(gate[0])
        assert len(text) > 800 and text.count("\n") >= 3, text
        # Batched: fewer updates than steps, and what is shown equals what the engine emitted.
        assert 1 < len(live) <= len(gate[0].steps)
        shown = reply.query_one(".provenance", Static).content.plain
        assert shown == text == reply.record.text
        # Each update re-assembled the live line only: never more than the longest paragraph,
        # far less than the reply.
        longest_paragraph = max(len(p) for p in text.split("\n"))
        assert max(live) <= min(longest_paragraph, LIVE_LIMIT)
        # At every update, no more than the paragraph being written (the reply's text so far after
        # its last line break), however the reply's paragraphs fall.
        current = [len(text[:n].rsplit("\n", 1)[-1]) for n in lengths]
        assert all(size <= line for size, line in zip(live, current, strict=True)), (live, current)
        assert current[-1] < lengths[-1]  # the last update came after line breaks: less than all
        # Finished: one full render, the frozen lines are put away.
        assert not reply.query_one(".provenance-frozen").display


@pytest.mark.slow
async def test_a_hundred_turn_session_keeps_the_work_per_update_flat(pair: ModelPair, tmp_path: Path) -> None:
    builder = ReplyBuilder()
    decoder = pair.speculative(Controls(DecodingSettings(threshold=0.1)))
    for step in decoder.generate(pair.tokenizer(PROMPT).input_ids, max_new_tokens=60):
        builder.add(step)
    turns: list[Turn] = []
    for i in range(50):
        turns += [Turn("user", f"Question {i}"), Turn("assistant", builder.record.text, reply=builder.record)]
    session = Session("many0000", now(), {}, {}, None, turns)
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=400, resume=session)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        # Only the last turns are mounted (Textual lays out every mounted widget each frame).
        old = list(app.screen.query(ReplyView))
        assert len(old) == SHOWN_TURNS // 2 and not app.screen.query(Markdown)  # no Markdown built
        before = [r.query_one(".provenance", Static).content for r in old]
        _, _, live, _ = await stream_long_reply(pilot, gate)
        after = [r.query_one(".provenance", Static).content for r in old]
        assert all(a is b for a, b in zip(after, before, strict=True))  # not re-rendered
        # Each update re-assembled the new reply's live line only, never the turns above it. (The
        # reply's own paragraphs depend on the sampled text, so the bound is the longest of them.)
        text = engine_text(gate[0])
        assert max(live) <= min(max(len(p) for p in text.split("\n")), LIVE_LIMIT)
        assert max(live) < len(builder.record.text) * 50 / 10
        # Every earlier turn is one press away.
        earlier = app.screen.query_one("#earlier", Button)
        assert str(earlier.label) == f"Show {100 - SHOWN_TURNS} earlier turns"
        earlier.press()
        await wait_for(
            pilot, lambda: len(app.screen.query(ReplyView)) == 51 and not app.screen.query("#earlier")
        )
        assert [r.record.text for r in app.screen.query(ReplyView)][:50] == [builder.record.text] * 50


def test_the_legend_and_help_list_the_target_origin() -> None:
    assert "■ target  " in Legend(autoregressive=False).content.plain
    assert "■ target " in colours_content().plain
    assert set(Origin) <= {o for o in Origin if o.value in colours_content().plain}


@pytest.mark.slow
async def test_a_long_live_chat_puts_its_oldest_turns_away(pair: ModelPair, tmp_path: Path) -> None:
    app = make_app(pair, tmp_path, max_new_tokens=2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        screen: ChatScreen = app.screen  # type: ignore[assignment]
        for i in range(SHOWN_TURNS + 1):  # 2 * SHOWN_TURNS + 2 turns: over the limit
            await pilot.press(*f"Q{i}", "enter")
            await wait_for(
                pilot, lambda i=i: screen.streaming is None and len(screen.session.turns) == 2 * i + 2
            )  # type: ignore[misc]
        await wait_for(pilot, lambda: len(screen.query(".turn")) == SHOWN_TURNS)
        assert str(screen.query_one("#earlier", Button).label) == f"Show {SHOWN_TURNS + 2} earlier turns"
        assert len(screen.session.turns) == 2 * SHOWN_TURNS + 2  # put away from the screen only


class OneLine(App[None]):
    def compose(self) -> ComposeResult:
        yield Static(id="line")


async def test_an_update_within_the_last_line_asks_for_no_layout() -> None:
    # `_layout_updates` counts Textual's layout requests (a private counter: what the screen-wide
    # re-arrangement per update would show up as).
    async with OneLine().run_test(size=(40, 10)) as pilot:
        line = pilot.app.query_one("#line", Static)
        update_in_place(line, Content("Once upon"))
        await pilot.pause()
        asked = line._layout_updates
        update_in_place(line, Content("Once upon a time"))  # still one line: a repaint
        await pilot.pause()
        assert line._layout_updates == asked
        assert line.render_line(0).text.startswith("Once upon a time")
        update_in_place(line, Content("Once upon a time " * 5))  # 85 cells: three lines at 40
        await pilot.pause()
        assert line._layout_updates > asked
        assert line.size.height == 3
