"""Pilot tests of the chat with the real offline model pair and a real SQLite file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from textual.widgets import Markdown, Static

from fsd_chat.conversation.session import ReplyRecord
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding.events import Origin, StopReason
from fsd_chat.decoding.settings import DecodingSettings, SamplingRequest
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.screens.chat import ChatScreen
from fsd_chat.tui.widgets.conversation import ReplyView, UserMessage
from fsd_chat.tui.widgets.dial import REGRET_RANGE, REGRET_STEP, THRESHOLD_STEP, ThresholdDial
from fsd_chat.tui.widgets.prompt import PromptInput
from tests.tui.helpers import SIZE, GatedDecoder, make_app, wait_for, wait_for_chat

PROMPT = "Once upon a time"

SAMPLED = SamplingRequest(temperature=1.0, seed=0)
"""Sampling, where T is in the divergence's units (the story pair itself decodes greedily)."""


def engine_runs(decoder: GatedDecoder) -> list[tuple[str, Origin]]:
    """(text, origin) per token the engine emitted, merged where the origin repeats."""
    runs: list[tuple[str, Origin]] = []
    for step in decoder.steps:
        for token in step.tokens:
            if runs and runs[-1][1] == token.origin:
                runs[-1] = (runs[-1][0] + token.text, token.origin)
            elif token.text:
                runs.append((token.text, token.origin))
    return runs


def shown_runs(record: ReplyRecord) -> list[tuple[str, Origin]]:
    """The same, from what the reply widget holds (runs split by settings merged back)."""
    runs: list[tuple[str, Origin]] = []
    for run in record.runs:
        if runs and runs[-1][1] == run.origin:
            runs[-1] = (runs[-1][0] + run.text, run.origin)
        else:
            runs.append((run.text, run.origin))
    return runs


async def start(pilot, text: str = PROMPT) -> ChatScreen:  # type: ignore[no-untyped-def]
    """Wait for the chat screen, type `text` and press Enter."""
    app = pilot.app
    await wait_for_chat(pilot)
    await pilot.press(*text, "enter")
    return app.screen  # type: ignore[return-value]


async def test_reply_streams_with_the_engines_origins(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        screen = await start(pilot)
        decoder = gate[0]
        decoder.allow(1)
        await wait_for(pilot, lambda: screen.streaming is not None and screen.streaming.record.runs)
        # Mid-reply: the first step is shown, the reply is not finished.
        assert screen.streaming is not None
        assert shown_runs(screen.streaming.record) == engine_runs(decoder)
        decoder.allow(100)
        await wait_for(pilot, lambda: screen.streaming is None)
        reply = screen.query(ReplyView).last()
        assert reply.record.stop_reason == StopReason.MAX_NEW_TOKENS
        assert shown_runs(reply.record) == engine_runs(decoder)
        assert {o for _, o in shown_runs(reply.record)} >= {Origin.DRAFT_EXACT, Origin.TARGET_BONUS}
        assert reply.record.stats["tokens"] == 40
        # Colours come from the theme's variables: the first run's cells have its origin colour.
        first_text, first_origin = shown_runs(reply.record)[0]
        segments = list(reply.query_one(".provenance", Static).render_line(0))
        cell = next(s for s in segments if s.text.strip() and s.text in first_text)
        assert cell.style.color is not None
        assert cell.style.color.triplet.hex.lower() == app.theme_variables[f"origin-{first_origin}"].lower()
        assert screen.query_one(UserMessage).content.plain == PROMPT  # type: ignore[attr-defined]
    # Autosaved: the user's turn and the finished reply are in the SQLite file.
    saved = SessionStore(tmp_path / "sessions.sqlite3").load(screen.session.id)
    assert [t.role for t in saved.turns] == ["user", "assistant"]
    assert saved.turns[1].content == "".join(t for t, _ in engine_runs(decoder))
    assert saved.turns[1].reply is not None and saved.turns[1].reply.runs == reply.record.runs


@pytest.mark.slow
async def test_the_dial_mid_reply_is_told_as_it_happened(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    # Sampling: the dial steps through the divergence's units (greedy: regret nats, see test_widgets).
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=60, sampling=SAMPLED)
    async with app.run_test(size=SIZE) as pilot:
        screen = await start(pilot)
        decoder = gate[0]
        decoder.allow(2)
        await wait_for(pilot, lambda: len(decoder.steps) == 2)
        await pilot.press("ctrl+up")
        assert math.isclose(screen.query_one(ThresholdDial).settings.threshold, 0.1 + THRESHOLD_STEP["js"])
        decoder.allow(1)
        await wait_for(pilot, lambda: len(decoder.steps) == 3)
        assert [s.stats.threshold for s in decoder.steps] == [0.1, 0.1, 0.12]
        # fuzzy -> mixture, then js -> tv, which mixture does not use: one step each.
        await pilot.press("ctrl+g")
        decoder.allow(1)
        await wait_for(pilot, lambda: len(decoder.steps) == 4)
        await pilot.press("ctrl+t")
        decoder.allow(100)
        await wait_for(pilot, lambda: screen.streaming is None)
        assert [s.stats.rule for s in decoder.steps[2:5]] == ["fuzzy", "mixture", "mixture"]
        assert decoder.steps[4].stats.divergence == "tv"
        reply = screen.query(ReplyView).last()
        assert reply.record.stats["thresholds"] == [0.1, 0.12]
        # The reply marks what changed, in words: T, then the rule (with its T); the divergence
        # mixture ignores is never named.
        text = reply.query_one(".provenance", Static).content.plain  # type: ignore[attr-defined]
        marks = [m.split("⟩")[0] for m in text.split("⟨")[1:]]
        assert marks == ["T 0.12", "mixture T 0.12"]
        # The stats line and the stored reply give each setting's span in tokens.
        emitted = [s.stats.emitted for s in decoder.steps]
        a, b, c = sum(emitted[:2]), emitted[2], sum(emitted[3:])
        assert (
            f"under fuzzy js T 0.100 for {a} tokens → T 0.120 for {b} tokens → mixture T 0.120 for {c} tokens"
            in reply.query_one(".reply-stats", Static).content.plain  # type: ignore[attr-defined]
        )
    saved = SessionStore(tmp_path / "sessions.sqlite3").load(screen.session.id).turns[1].reply
    assert saved is not None
    assert [(s["rule"], s["divergence"], s["threshold"], s["tokens"]) for s in saved.stats["spans"]] == [
        ("fuzzy", "js", 0.1, a),
        ("fuzzy", "js", 0.12, b),
        ("mixture", "js", 0.12, emitted[3]),
        ("mixture", "tv", 0.12, sum(emitted[4:])),
    ]


@pytest.mark.slow
async def test_escape_stops_and_keeps_the_partial_reply(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        screen = await start(pilot)
        decoder = gate[0]
        decoder.allow(2)
        await wait_for(pilot, lambda: len(decoder.steps) == 2)
        await pilot.press("escape")
        decoder.allow(5)
        await wait_for(pilot, lambda: screen.streaming is None)
        assert len(decoder.steps) == 3  # the step in progress ends the reply
        assert decoder.steps[-1].stop_reason == StopReason.STOPPED
        reply = screen.query(ReplyView).last()
        assert reply.record.stop_reason == "stopped"
        assert reply.record.text == "".join(t.text for s in decoder.steps for t in s.tokens)
        assert reply.query_one(".provenance", Static).content.plain.endswith("⏹ stopped")  # type: ignore[attr-defined]
        # The prompt is usable again.
        await pilot.press(*"The end", "enter")
        gate[0].allow(100)
        await wait_for(pilot, lambda: len(screen.session.turns) == 4 and screen.streaming is None)
    saved = SessionStore(tmp_path / "sessions.sqlite3").load(screen.session.id)
    assert saved.turns[1].reply is not None and saved.turns[1].reply.stop_reason == "stopped"


async def test_dial_keys_and_keymap(pair: ModelPair, tmp_path: Path) -> None:
    app = make_app(pair, tmp_path, keymap={"raise-threshold": "ctrl+k"}, sampling=SAMPLED)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        dial = app.screen.query_one(ThresholdDial)
        await pilot.press("ctrl+k", "ctrl+k")  # remapped raise (TextArea's own ctrl+k loses)
        assert math.isclose(app.controls.snapshot().threshold, 0.14)
        await pilot.press("ctrl+up")  # no longer bound
        assert math.isclose(app.controls.snapshot().threshold, 0.14)
        await pilot.press("ctrl+down")
        assert math.isclose(app.controls.snapshot().threshold, 0.12)
        await pilot.press("ctrl+t")  # js -> tv: T kept
        assert app.controls.snapshot().divergence == "tv"
        await pilot.press("ctrl+r")
        assert app.controls.snapshot().threshold == 0.0
        await pilot.press("ctrl+down")  # not below 0
        assert app.controls.snapshot().threshold == 0.0
        dial.focus()
        await pilot.press("right", "right")  # focused dial: one tv step each
        assert math.isclose(app.controls.snapshot().threshold, 2 * THRESHOLD_STEP["tv"])
        assert "T 0.10" in str(dial.render()) and "tv fuzzy" in str(dial.render())


async def test_a_greedy_chat_dials_regret_nats(pair: ModelPair, tmp_path: Path) -> None:
    """The story pair decodes greedily: T is a regret bound, and each key moves it a regret step."""
    app = make_app(pair, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        dial = app.screen.query_one(ThresholdDial)
        await pilot.press("ctrl+up")
        assert math.isclose(app.controls.snapshot().threshold, 0.1 + REGRET_STEP)
        for _ in range(10):
            await pilot.press("ctrl+up")
        assert app.controls.snapshot().threshold == REGRET_RANGE
        assert "regret nats/tok fuzzy" in dial.render().plain
        assert dial.settings == app.controls.snapshot()


@pytest.mark.slow
async def test_export_writes_the_transcript(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=30, system="Tell a story.")
    async with app.run_test(size=SIZE) as pilot:
        screen = await start(pilot)
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.query("#export-path"))
        field = app.screen.query_one("#export-path")
        suggested = Path(field.value)  # type: ignore[attr-defined]
        assert suggested.parent == tmp_path / "transcripts" and suggested.suffix == ".md"
        # An unwritable path: a notification, the dialog stays, nothing crashes.
        field.value = "/proc/fsd-chat/transcript.md"  # type: ignore[attr-defined]
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen.query("#export-path")
        assert any("cannot write /proc/fsd-chat/transcript.md" in n.message for n in app._notifications)
        field.value = str(suggested)  # type: ignore[attr-defined]
        await pilot.press("enter")
        await wait_for_chat(pilot)
        assert any(n.message == str(suggested) for n in app._notifications)
        # A bare name typed over the suggestion stays in its folder and gets .md.
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.query("#export-path"))
        app.screen.query_one("#export-path").value = "notes"  # type: ignore[attr-defined]
        await pilot.press("enter")
        await wait_for_chat(pilot)
        assert (tmp_path / "transcripts" / "notes.md").read_text(encoding="utf-8") == suggested.read_text(
            encoding="utf-8"
        )
    text = suggested.read_text(encoding="utf-8")
    reply = screen.session.turns[1].reply
    assert reply is not None
    assert f"# fsd-chat session {screen.session.id}" in text
    assert "| Target | `" in text and "stories260K` |" in text
    assert "| Device | cpu float32 |" in text
    # Greedy decoding reads no divergence: the session and each reply name what T bounds.
    assert "| Decoding | fuzzy · regret · T 0.100 · k 4 |" in text
    assert {span["divergence"] for span in reply.stats["spans"]} == {"regret"}
    assert " · under fuzzy regret T 0.100 · " in text
    assert "## System\n\n```text\nTell a story.\n```\n" in text
    assert f"## User\n\n```text\n{PROMPT}\n```\n" in text
    assert f"## Assistant\n\n```text\n{reply.text}\n```\n" in text
    stats = reply.stats
    assert (
        f"> 30 tokens · {stats['tokens_per_second']:.1f} tokens/s · "
        f"first token {stats['first_token_seconds']:.2f} s · acceptance"
    ) in text
    assert "<details><summary>Provenance</summary>" in text
    assert not list(suggested.parent.glob(".*.tmp"))  # the atomic write left no temporary file


@pytest.mark.slow
async def test_resumed_session_shows_the_earlier_turns(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    first = make_app(pair, tmp_path, gate=gate, max_new_tokens=20)
    async with first.run_test(size=SIZE) as pilot:
        screen = await start(pilot)
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2)
    session = SessionStore(tmp_path / "sessions.sqlite3").load(screen.session.id[:5])
    earlier_reply = session.turns[1].content

    gate.clear()
    resumed = make_app(pair, tmp_path, gate=gate, max_new_tokens=20, resume=session)
    async with resumed.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        chat = resumed.screen
        assert chat.query_one(UserMessage).content.plain == PROMPT  # type: ignore[attr-defined]
        old = chat.query_one(ReplyView)
        assert old.record.text == earlier_reply and old.has_class("-finished")
        await pilot.press(*"The dog", "enter")
        gate[0].allow(100)
        await wait_for(pilot, lambda: chat.streaming is None and len(chat.session.turns) == 4)
    saved = SessionStore(tmp_path / "sessions.sqlite3").load(session.id)
    assert [t.content for t in saved.turns[:3]] == [PROMPT, earlier_reply, "The dog"]


@pytest.mark.slow
async def test_toggle_markdown_view_and_new_chat(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=20)
    async with app.run_test(size=SIZE) as pilot:
        screen = await start(pilot)
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2)
        reply = screen.query_one(ReplyView)
        assert not reply.query(Markdown)  # built on first use only
        assert reply.query_one(".provenance").display is True
        await pilot.press("ctrl+o")
        await pilot.pause()
        markdown = reply.query_one(Markdown)
        assert markdown.display and not reply.query_one(".provenance").display
        await pilot.press("ctrl+o")
        assert not markdown.display and reply.query_one(".provenance").display
        old_id = screen.session.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert screen.session.id != old_id and not screen.session.turns
        assert not screen.query(ReplyView)
    assert len(SessionStore(tmp_path / "sessions.sqlite3").summaries()) == 1  # empty chats are not saved


async def test_a_message_too_long_for_the_context_is_kept(pair: ModelPair, tmp_path: Path) -> None:
    app = make_app(pair, tmp_path, max_new_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        prompt = app.screen.query_one(PromptInput)
        prompt.text = "The cat sat on the mat. " * 60
        await pilot.press("end", "enter")
        await pilot.pause()
        assert any("context window is 512 tokens" in n.message for n in app._notifications)
        assert prompt.text.startswith("The cat sat")  # nothing lost
        assert not app.screen.session.turns


@pytest.mark.slow
async def test_newline_key_and_command_palette(pair: ModelPair, tmp_path: Path) -> None:
    app = make_app(pair, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        await pilot.press("a", "ctrl+j", "b")
        assert app.screen.query_one(PromptInput).text == "a\nb"
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"Raise T by one step", "Set T = 0: exact speculative decoding", "Theme"} <= titles
        await pilot.press("ctrl+p")
        await pilot.press(*"exact spec")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.controls.snapshot().threshold == 0.0)


@pytest.mark.slow
async def test_the_stats_strip_shows_the_cost_and_follows_the_dial(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    start_settings = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.0, draft_tokens=4)
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=120, settings=start_settings, sampling=SAMPLED)
    async with app.run_test(size=SIZE) as pilot:
        screen = await start(pilot)
        decoder = gate[0]
        figures = screen.query_one("#figures", Static)
        decoder.allow(4)
        await wait_for(pilot, lambda: len(decoder.steps) == 4 and "tok/s" in figures.content.plain)
        await wait_for(pilot, lambda: "cost 0" in figures.content.plain)
        assert all(t.cost == 0 for s in decoder.steps for t in s.tokens)
        for _ in range(15):  # js T 0.30: fuzzy acceptances now cost something
            await pilot.press("ctrl+up")
        decoder.allow(100)
        await wait_for(pilot, lambda: screen.streaming is None)
        assert sum(t.cost for s in decoder.steps for t in s.tokens) > 0
        shown = figures.content.plain
        assert "cost 0." in shown and "/tok" in shown, shown
        stats_line = screen.query(ReplyView).last().query_one(".reply-stats", Static).content.plain
        assert "nats" in stats_line and "/token" in stats_line
        # ctrl+g reaches the mixture rule; T is then a budget in nats per token, capped at its dial.
        await pilot.press("ctrl+g")
        settings = app.controls.snapshot()
        assert settings.rule == "mixture" and settings.threshold == 0.3
        assert "KL nats/tok mixture" in screen.query_one(ThresholdDial).render().plain
        for _ in range(30):
            await pilot.press("ctrl+up")
        assert app.controls.snapshot().threshold == 0.5
        await pilot.press("ctrl+g", "ctrl+g")  # pure, exact
        assert app.controls.snapshot().rule == "exact"
