"""Sessions that stay well-formed whatever happens: strict chat templates, two chats on one
session, a locked database, ctrl+n and Esc at awkward moments. Real pair, real SQLite file."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.session import ReplyRecord, Session, Turn
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding.events import Step, StopReason
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.chat import ChatScreen
from fsd_chat.tui.widgets.dial import ThresholdDial
from fsd_chat.tui.widgets.prompt import PromptInput
from tests.tui.helpers import SIZE, GatedDecoder, WrappedDecoder, make_app, wait_for, wait_for_chat

# Like the Llama 2 and Gemma templates: roles must alternate, and no system turn is accepted.
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@pytest.fixture(scope="module")
def strict_pair(tmp_path_factory: pytest.TempPathFactory, target_dir: Path, draft_dir: Path) -> ModelPair:
    """The offline pair, its target copied with a strict alternating chat template."""
    target = tmp_path_factory.mktemp("models") / "strict-target"
    shutil.copytree(target_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = STRICT_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return load_pair(
        ModelSpec(str(target)), ModelSpec(str(draft_dir)), LoadOptions(device="cpu", dtype="float32")
    )


async def send(pilot, text: str) -> ChatScreen:  # type: ignore[no-untyped-def]
    await wait_for_chat(pilot)
    await pilot.press(*text, "enter")
    return pilot.app.screen  # type: ignore[no-any-return]


@pytest.mark.slow
async def test_interrupted_reply_then_a_new_message_with_a_strict_template(
    strict_pair: ModelPair, tmp_path: Path
) -> None:
    gate: list[GatedDecoder] = []
    first = make_app(strict_pair, tmp_path, gate=gate, max_new_tokens=200)
    async with first.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Hi")
        gate[0].allow(2)
        await wait_for(pilot, lambda: len(gate[0].steps) == 2)
        await pilot.pause(0.1)
        await pilot.press("ctrl+n")  # mid-reply: the partial reply is kept, as stopped
        await pilot.pause()
    store = SessionStore(tmp_path / "sessions.sqlite3")
    (summary,) = store.summaries()
    session = store.load(summary.id)
    assert [t.role for t in session.turns] == ["user", "assistant"]
    reply = session.turns[1].reply
    assert reply is not None and reply.stop_reason == "stopped"
    assert reply.text == "".join(s.text for s in gate[0].steps[:2])

    gate.clear()
    resumed = make_app(strict_pair, tmp_path, gate=gate, max_new_tokens=10, resume=session)
    async with resumed.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Go on")
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 4)
        assert screen.session.turns[3].reply is not None
        assert screen.session.turns[3].reply.stop_reason == "max-new-tokens"
    assert [t.role for t in store.load(session.id).turns] == ["user", "assistant"] * 2


async def test_a_template_error_is_shown_and_the_message_stays(
    strict_pair: ModelPair, tmp_path: Path
) -> None:
    app = make_app(strict_pair, tmp_path, system="Be brief.")
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Hello there")
        await pilot.pause()
        (note,) = [n for n in app._notifications if n.title == "Message not sent"]
        assert note.message.startswith(f"the chat template in {strict_pair.tokenizer.name_or_path}/")
        assert "failed: TemplateError: System role not supported" in note.message
        assert screen.query_one(PromptInput).text == "Hello there"
        assert not screen.session.turns and screen.streaming is None
    assert not app.tracebacks  # the template's own error, named: not an unexpected one


@pytest.mark.slow
async def test_two_chats_on_one_session_lose_nothing(pair: ModelPair, tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "sessions.sqlite3")
    gate: list[GatedDecoder] = []
    seed = make_app(pair, tmp_path, gate=gate, max_new_tokens=8)
    async with seed.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "First")
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None)
    session_id = screen.session.id
    # Both windows resumed the session before either wrote to it.
    window_a, window_b = store.load(session_id), store.load(session_id)
    for window, text in ((window_a, "From A"), (window_b, "From B")):
        gate.clear()
        app = make_app(pair, tmp_path, gate=gate, max_new_tokens=8, resume=window)
        async with app.run_test(size=SIZE) as pilot:
            chat = await send(pilot, text)
            gate[0].allow(100)
            await wait_for(pilot, lambda chat=chat: chat.streaming is None)  # type: ignore[misc]
    turns = store.load(session_id).turns
    assert [t.content for t in turns if t.role == "user"] == ["First", "From A", "From B"]
    assert [t.role for t in turns] == ["user", "assistant"] * 3
    assert all(t.reply is not None and t.reply.stop_reason == "max-new-tokens" for t in turns[1::2])


async def test_a_locked_database_does_not_freeze_the_chat(pair: ModelPair, tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    SessionStore(path).summaries()  # create the file
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=8, store=SessionStore(path, busy_timeout=30))
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Hello")
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None)
        # The save waits for the lock in the writer thread; the UI still handles keys.
        assert screen.chat.writer.pending() > 0
        before = app.controls.snapshot().threshold
        await pilot.press("ctrl+up")
        assert screen.query_one(ThresholdDial).settings.threshold > before
        locker.execute("ROLLBACK")
        await wait_for(pilot, lambda: screen.chat.writer.pending() == 0)
    (session,) = [SessionStore(path).load(s.id) for s in SessionStore(path).summaries()]
    assert session.turns[0].content == "Hello"
    assert session.turns[1].reply is not None and session.turns[1].reply.stop_reason == "max-new-tokens"


@pytest.mark.slow
async def test_escape_before_the_first_step_stops_the_reply(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Once upon a time")
        await pilot.press("escape")  # nothing decoded yet
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None)
        assert len(gate[0].steps) == 1 and gate[0].steps[0].stop_reason == StopReason.STOPPED


@pytest.mark.slow
async def test_a_message_typed_right_after_ctrl_n_is_sent(pair: ModelPair, tmp_path: Path) -> None:
    gate: list[GatedDecoder] = []
    app = make_app(pair, tmp_path, gate=gate, max_new_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "One")
        gate[0].allow(1)
        await wait_for(pilot, lambda: gate[0].steps)
        for attempt in range(5):  # the old race lost about every other message
            await pilot.press("ctrl+n", *f"Two {attempt}", "enter")
            gate[0].allow(100)
            await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2)
            assert screen.session.turns[0].content == f"Two {attempt}"
            reply = screen.session.turns[1].reply
            assert reply is not None and reply.stop_reason == "max-new-tokens"


async def test_resuming_a_malformed_session_repairs_it(pair: ModelPair, tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "sessions.sqlite3")
    broken = Session(
        "bad00000", "2025-01-01T00:00:00+00:00", {}, {}, None, [Turn("user", "A"), Turn("user", "B")]
    )
    store.append_turns(broken, broken.turns)  # what an external edit could leave
    session = store.load("bad")
    assert [t.role for t in session.turns] == ["user", "assistant"] * 2
    assert session.turns[1].reply == ReplyRecord(stop_reason="stopped")


class FailingOnceDecoder(WrappedDecoder):
    """The real decoder, made to fail once before its first step. The fault is injected: no real
    decoder can be made to fail on demand here (on a GPU this is where a CUDA error would surface)."""

    failed = False

    def wrap(self, steps: Iterator[Step]) -> Iterator[Step]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("the device went away")
        yield from steps


@pytest.mark.slow
async def test_a_decoding_failure_ends_the_reply_and_keeps_the_message(
    pair: ModelPair, tmp_path: Path
) -> None:
    app = FsdChatApp(
        ChatOptions(
            target=pair.target_spec,
            draft=pair.draft_spec,
            store=SessionStore(tmp_path / "sessions.sqlite3"),
            max_new_tokens=5,
        ),
        loader=lambda progress: pair,
        decoder_factory=lambda p, controls: FailingOnceDecoder(p.speculative(controls)),
    )
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Hello")
        await wait_for(pilot, lambda: screen.streaming is None)
        (note,) = [n for n in app._notifications if n.title == "Generation failed"]
        assert note.message.startswith(
            "RuntimeError while decoding a reply: the device went away (details in"
        )
        assert screen.query_one(PromptInput).text == "Hello"  # nothing came of it: the message is back
        reply = screen.session.turns[1].reply
        assert reply is not None and reply.stop_reason == "error"
        await pilot.press("enter")  # the chat is still usable
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 4)
        assert screen.session.turns[3].reply is not None
        assert screen.session.turns[3].reply.stop_reason == "max-new-tokens"
    assert "RuntimeError: the device went away" in (tmp_path / "data" / "fsd-chat.log").read_text()


@pytest.mark.slow
async def test_a_broken_chat_template_is_told_when_the_chat_opens(
    tmp_path: Path, target_dir: Path, draft_dir: Path
) -> None:
    # A syntax error: `generate` refuses it before decoding; the chat says so as it opens, with
    # what --raw would do, and stays usable.
    target = tmp_path / "broken-target"
    shutil.copytree(target_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}"
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    pair = load_pair(ModelSpec(str(target)), ModelSpec(str(draft_dir)), LoadOptions(device="cpu"))
    for raw in (False, True):
        app = make_app(pair, tmp_path, raw=raw, max_new_tokens=5)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
            if raw:  # nothing to tell: the template is not used
                await wait_for(pilot, lambda a=app: not a.workers)
                assert not app._notifications
                continue
            await wait_for(pilot, lambda a=app: a._notifications)
            (notice,) = app._notifications
            assert notice.title == "The chat template fails" and notice.severity == "error"
            assert "TemplateSyntaxError: Unexpected end of template" in notice.message
            assert "With --raw the chat would send the turns as plain text" in notice.message
