"""The chat's reply lifecycle driven without Textual: the real pair, a real SQLite store in tmp_path.

Each test does what the chat screen and its generation worker do, in one thread: `send`, then the
worker's `build_prompt` and `steps` (folded into the reply's record by the `ReplyBuilder` the
streaming view uses), `steps_shown` per batch, and `finish`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsd_chat.conversation.controller import BUSY, ChatController, ChatOptions, Notice, Sent
from fsd_chat.conversation.session import STOPPED, ReplyBuilder
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, DecodingSettings, Step
from fsd_chat.decoding.settings import SamplingRequest
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import FsdChatError

MAX_NEW_TOKENS = 16


class Saves:
    """What the controller's writer reported (from its thread)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.recoveries = 0
        self.failed = threading.Event()
        self.recovered = threading.Event()

    def fail(self, reason: str) -> None:
        self.failures.append(reason)
        self.failed.set()

    def recover(self) -> None:
        self.recoveries += 1
        self.recovered.set()


def make_chat(
    pair: ModelPair, tmp_path: Path, saves: Saves, *, store: SessionStore | None = None, **options: object
) -> ChatController:
    """A controller over the real pair's speculative decoder (greedy, fixed settings)."""
    chat_options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=store or SessionStore(tmp_path / "data" / "sessions.sqlite3"),
        settings=DecodingSettings(rule="fuzzy", divergence="js", threshold=0.1, draft_tokens=4),
        sampling=SamplingRequest(temperature=0.0),
        max_new_tokens=MAX_NEW_TOKENS,
        transcripts_dir=tmp_path / "transcripts",
        **options,  # type: ignore[arg-type]
    )
    controls = Controls(chat_options.settings)
    return ChatController(
        chat_options,
        pair,
        pair.speculative(controls),
        controls,
        on_save_failed=saves.fail,
        on_save_recovered=saves.recover,
    )


def start(chat: ChatController, text: str) -> tuple[Sent, Iterator[Step], ReplyBuilder]:
    """Send `text` and build its prompt (stored once built); returns the message, its steps
    (not yet decoded) and the fold of steps into its reply."""
    sent = chat.send(text)
    assert isinstance(sent, Sent)
    dropped, ids = chat.build_prompt(sent.messages, cancelled=lambda: False)
    assert chat.prompt_ready(dropped) is None
    fold = ReplyBuilder()
    fold.record = sent.record
    return sent, chat.steps(ids), fold


def stream(chat: ChatController, steps: Iterator[Step], fold: ReplyBuilder, limit: int | None = None) -> str:
    """Show up to `limit` steps (all when None: the reply must end with its last one), one batch
    each; returns their text."""
    text = ""
    ended = False
    for n, step in enumerate(steps, 1):
        fold.add(step)
        text += step.text
        ended = chat.steps_shown((step,), ended=False)
        if ended or n == limit:
            break
    assert ended == (limit is None and next(steps, None) is None)
    return text


def test_a_message_is_sent_streamed_finished_and_saved(pair: ModelPair, tmp_path: Path) -> None:
    saves = Saves()
    chat = make_chat(pair, tmp_path, saves)
    sent, steps, fold = start(chat, "  Once upon a time  ")
    assert sent.question.content == "Once upon a time"  # sent stripped
    assert chat.session.turns == [sent.question, sent.reply]  # in the session once the prompt is built
    text = stream(chat, steps, fold)
    finished = chat.finish()
    assert finished.stored and not finished.retry and finished.notice is None
    assert chat.close(10)
    saved = SessionStore(tmp_path / "data" / "sessions.sqlite3").load(chat.session.id)
    assert [t.content for t in saved.turns] == ["Once upon a time", text]
    reply = saved.turns[1].reply
    assert reply is not None and reply.stop_reason == "max-new-tokens"
    assert reply.stats["tokens"] == MAX_NEW_TOKENS and reply.stats["first_token_seconds"] > 0
    assert saved.models["target"] == pair.target_spec.source and saved.settings["threshold"] == 0.1
    assert saves.failures == []


def test_a_stopped_reply_keeps_what_was_generated(pair: ModelPair, tmp_path: Path) -> None:
    chat = make_chat(pair, tmp_path, Saves())
    _, steps, fold = start(chat, "Once upon a time")
    shown = stream(chat, steps, fold, limit=2)
    chat.stop()  # Esc: the decoder ends after the step in progress
    assert chat.controls.stop_requested
    shown += stream(chat, steps, fold)
    chat.finish()
    assert chat.close(10)
    reply = SessionStore(tmp_path / "data" / "sessions.sqlite3").load(chat.session.id).turns[1]
    assert reply.reply is not None and reply.reply.stop_reason == STOPPED
    assert reply.content == shown and 0 < reply.reply.stats["tokens"] < MAX_NEW_TOKENS


def test_a_reply_cut_short_is_saved_as_stopped(pair: ModelPair, tmp_path: Path) -> None:
    """A new chat or a quit finishes the reply without waiting for the decoder."""
    chat = make_chat(pair, tmp_path, Saves())
    _, steps, fold = start(chat, "Once upon a time")
    shown = stream(chat, steps, fold, limit=2)
    chat.stop()
    finished = chat.finish()
    assert finished.stored and finished.sent.record.stop_reason == STOPPED
    assert chat.close(10)
    reply = SessionStore(tmp_path / "data" / "sessions.sqlite3").load(chat.session.id).turns[1]
    assert reply.reply is not None and reply.reply.stop_reason == STOPPED and reply.content == shown


def test_steps_of_an_older_generation_are_stale(pair: ModelPair, tmp_path: Path) -> None:
    chat = make_chat(pair, tmp_path, Saves())
    first, steps, fold = start(chat, "Once upon a time")
    stream(chat, steps, fold, limit=1)
    assert chat.is_current(first.generation)
    chat.finish()
    old = chat.session
    chat.new_chat()
    assert not chat.is_current(first.generation)  # its late steps are dropped
    second = chat.send("Lily had a dog")
    assert isinstance(second, Sent) and second.generation > first.generation
    assert chat.is_current(second.generation) and not chat.is_current(first.generation)
    assert old.turns[0].content == "Once upon a time" and chat.session.turns == []


def test_a_late_batch_before_the_next_prompt_is_built_saves_nothing_and_loses_nothing(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch shown between a new message and its built prompt (a pacing timer of the reply before,
    firing late) must not save the new reply, which is not stored yet: once, that save reached the
    writer before the reply's append, and the writer's thread died with every later save."""
    monkeypatch.setattr("fsd_chat.conversation.controller.SAVE_INTERVAL", 0.0)  # every batch saves
    chat = make_chat(pair, tmp_path, Saves())
    _, steps, fold = start(chat, "Once upon a time")
    stream(chat, steps, fold)
    chat.finish()
    second = chat.send("Lily had a dog")
    assert isinstance(second, Sent)
    assert not chat.steps_shown((), ended=False)  # the late, empty batch
    dropped, ids = chat.build_prompt(second.messages, cancelled=lambda: False)
    assert chat.prompt_ready(dropped) is None
    fold = ReplyBuilder()
    fold.record = second.record
    text = stream(chat, chat.steps(ids), fold)
    chat.finish()
    assert chat.close(10)  # the writer is alive and wrote everything
    saved = SessionStore(tmp_path / "data" / "sessions.sqlite3").load(chat.session.id)
    assert [t.content for t in saved.turns][2:] == ["Lily had a dog", text]


def test_a_message_whose_prompt_is_not_built_is_withdrawn(pair: ModelPair, tmp_path: Path) -> None:
    chat = make_chat(pair, tmp_path, Saves())
    sent = chat.send("Once upon a time")
    assert isinstance(sent, Sent)
    assert chat.send("another") is BUSY  # one reply at a time
    assert chat.send("   ") is None
    finished = chat.finish()  # stopped before the worker built the prompt
    assert not finished.stored and finished.sent is sent
    assert chat.session.turns == [] and not chat.is_current(sent.generation)
    assert chat.close(10)
    assert not (tmp_path / "data" / "sessions.sqlite3").exists()  # nothing was stored


def test_a_prompt_failure_says_why_and_stores_nothing(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "data"))  # the error log
    chat = make_chat(pair, tmp_path, Saves())
    chat.send("Once upon a time")
    chat.controls.request_stop()  # an Esc that cut the template short
    notice = chat.prompt_failed(FsdChatError("the prompt is too long"))
    assert notice == Notice("the prompt is too long", title="Message not sent", severity="error")
    assert not chat.controls.stop_requested  # spent
    assert chat.withdraw().question.content == "Once upon a time"
    chat.send("Once upon a time")
    unexpected = chat.prompt_failed(ValueError("boom"))
    assert unexpected.text.startswith("ValueError while building the prompt: boom (details in ")
    assert len(chat.tracebacks) == 1 and "ValueError: boom" in chat.tracebacks[0]
    assert "ValueError: boom" in (tmp_path / "data" / "fsd-chat.log").read_text()
    chat.withdraw()
    assert chat.session.turns == []
    assert chat.close(10)


def test_a_failed_save_keeps_the_turns_says_so_and_recovers(pair: ModelPair, tmp_path: Path) -> None:
    path = tmp_path / "data" / "sessions.sqlite3"
    path.mkdir(parents=True)  # not a file: no save can write it (whoever runs the tests)
    saves = Saves()
    chat = make_chat(pair, tmp_path, saves, store=SessionStore(path))
    _, steps, fold = start(chat, "Once upon a time")
    text = stream(chat, steps, fold)
    chat.finish()
    assert saves.failed.wait(10)
    assert (
        len(saves.failures) == 1
        and saves.failures[0] == f"cannot open the session store {path}: Is a directory"
    )
    assert [t.content for t in chat.session.turns] == ["Once upon a time", text]  # kept
    path.rmdir()  # the user moves it away: the next save writes everything kept
    _, steps, fold = start(chat, "Lily had a dog")
    second = stream(chat, steps, fold)
    chat.finish()
    assert chat.close(10) and saves.recovered.is_set() and saves.recoveries == 1
    saved = SessionStore(path).load(chat.session.id)
    assert [t.content for t in saved.turns] == ["Once upon a time", text, "Lily had a dog", second]


def test_an_unsaved_session_is_kept_as_a_transcript(pair: ModelPair, tmp_path: Path) -> None:
    path = tmp_path / "data" / "sessions.sqlite3"
    path.mkdir(parents=True)
    chat = make_chat(pair, tmp_path, Saves(), store=SessionStore(path))
    _, steps, fold = start(chat, "Once upon a time")
    text = stream(chat, steps, fold)
    chat.finish()
    assert not chat.close(0.5)  # retried until the time is up
    note = chat.keep_unsaved()
    (written,) = (tmp_path / "data").glob("unsaved-fsd-chat-*.md")  # beside the store
    assert note == f"the unsaved session is in {written}"
    transcript = written.read_text()
    assert "Once upon a time" in transcript and text.strip().splitlines()[0] in transcript


def test_an_unsaved_session_goes_to_the_transcripts_folder_when_the_stores_is_unwritable(
    pair: ModelPair, tmp_path: Path
) -> None:
    blocked = tmp_path / "data"
    blocked.write_text("a file where the data folder should be")
    chat = make_chat(pair, tmp_path, Saves(), store=SessionStore(blocked / "sessions.sqlite3"))
    start(chat, "Once upon a time")
    chat.finish()
    assert not chat.close(0.5)
    note = chat.keep_unsaved()
    (written,) = (tmp_path / "transcripts").glob("unsaved-fsd-chat-*.md")
    assert note == f"the unsaved session is in {written}" and "Once upon a time" in written.read_text()


def test_a_new_chat_keeps_the_old_one_saved_and_starts_empty(pair: ModelPair, tmp_path: Path) -> None:
    chat = make_chat(pair, tmp_path, Saves(), system="Be brief.")
    _, steps, fold = start(chat, "Once upon a time")
    first = stream(chat, steps, fold)
    chat.finish()
    old = chat.session
    notice = chat.new_chat()
    new = chat.session
    assert notice.text == f"New chat {new.id}" and new.id != old.id and new.turns == []
    assert (new.models, new.settings, new.system) == (old.models, old.settings, "Be brief.")
    # A new chat starts where the dial stands (its start settings), with no dial moved yet.
    moved = DecodingSettings(rule="mixture", divergence="js", threshold=0.2, draft_tokens=4)
    chat.dial_moved(moved)
    newer = (chat.new_chat(), chat.session)[1]
    assert "dial" not in newer.settings and (newer.settings["rule"], newer.settings["threshold"]) == (
        "mixture",
        0.2,
    )
    assert newer.settings["temperature"] == old.settings["temperature"]
    _, steps, fold = start(chat, "Lily had a dog")
    second = stream(chat, steps, fold)
    chat.finish()
    assert chat.close(10)
    store = SessionStore(tmp_path / "data" / "sessions.sqlite3")
    assert [t.content for t in store.load(old.id).turns] == ["Once upon a time", first]
    assert [t.content for t in store.load(newer.id).turns] == ["Lily had a dog", second]
    assert len(store.summaries()) == 2


def test_the_export_writes_the_sessions_transcript(pair: ModelPair, tmp_path: Path) -> None:
    chat = make_chat(pair, tmp_path, Saves())
    _, steps, fold = start(chat, "Once upon a time")
    text = stream(chat, steps, fold)
    chat.finish()
    suggested = chat.export_path()
    assert suggested.parent == tmp_path / "transcripts" and chat.session.id in suggested.name
    written = chat.write_transcript(suggested)
    assert written == suggested and text.strip().splitlines()[0] in written.read_text()
    with pytest.raises(FsdChatError):
        chat.write_transcript(tmp_path / "data" / "sessions.sqlite3" / "x.md")  # under a file
    assert chat.close(10)


def test_a_failed_generation_ends_its_reply_with_the_error(
    pair: ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "data"))  # the error log
    chat = make_chat(pair, tmp_path, Saves())
    start(chat, "Once upon a time")
    notice = chat.generation_failed(RuntimeError("out of memory"))
    assert notice.title == "Generation failed" and notice.text.startswith(
        "RuntimeError while decoding a reply"
    )
    finished = chat.finish(error=notice.text)
    assert finished.retry  # nothing came of it: the message may be sent again
    assert finished.sent.record.stop_reason == "error" and not chat.is_current(finished.sent.generation)
    assert chat.close(10)
    saved = SessionStore(tmp_path / "data" / "sessions.sqlite3").load(chat.session.id)
    assert [t.content for t in saved.turns] == ["Once upon a time", ""]
    assert saved.turns[1].reply is not None and saved.turns[1].reply.stop_reason == "error"
