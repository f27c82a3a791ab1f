"""Hostile input in the chat (round 2), through the real app: damaged or hostile theme files,
Textual's own marked-up notice, a tokenizer larger than the models' vocabulary, a store that is not
private, a crafted session id, and the data folder deleted mid-reply. Real pair, real SQLite file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from textual.command import CommandList, CommandPalette

from fsd_chat.conversation.session import Session, Turn
from fsd_chat.conversation.store import SessionStore
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.test_hostile_input import _add_token
from tests.tui.helpers import SIZE, GatedDecoder, make_app, wait_for, wait_for_chat
from tests.tui.test_sessions import send
from tests.tui.test_startup import USER_THEME

OTHER_USER = 4242


async def test_a_theme_nested_5000_deep_is_reported_and_the_default_used(
    pair: ModelPair, tmp_path: Path
) -> None:
    themes = tmp_path / "themes"
    themes.mkdir()
    (themes / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    app = make_app(pair, tmp_path, theme="deep", user_themes_dir=themes)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        assert app.theme == "fsd-dark"
        messages = [n.message for n in app._notifications]
        assert "theme deep.toml: invalid TOML (nested too deeply)" in messages


async def test_theme_names_are_shown_as_text_in_the_picker(pair: ModelPair, tmp_path: Path) -> None:
    themes = tmp_path / "themes"
    themes.mkdir()
    for file, name in (("osc", "ctl\\u001b]0;PWNED\\u0007x"), ("markup", "[b]bold[/b]")):
        (themes / f"{file}.toml").write_text(USER_THEME.replace('"my-theme"', f'"{name}"'))
    app = make_app(pair, tmp_path, user_themes_dir=themes)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        app.action_change_theme()
        await wait_for(
            pilot, lambda: isinstance(app.screen, CommandPalette) and app.screen.query(CommandList)
        )
        results = app.screen.query_one(CommandList)
        await wait_for(pilot, lambda: results.option_count > 0)
        shown = [str(results.get_option_at_index(i).prompt) for i in range(results.option_count)]
        assert "ctl␛]0;PWNED␇x" in shown and "[b]bold[/b]" in shown  # as written, escapes made visible
        assert not any("\x1b" in text or "\x07" in text for text in shown)


async def test_ctrl_c_says_how_to_quit_without_markup(pair: ModelPair, tmp_path: Path) -> None:
    app = make_app(pair, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        app.set_focus(None)  # in the prompt, ctrl+c copies
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert [n.message for n in app._notifications] == ["Press ctrl+q to quit the app"]


@pytest.fixture(scope="module")
def larger_pair(tmp_path_factory: pytest.TempPathFactory, target_dir: Path, draft_dir: Path) -> ModelPair:
    """The offline pair whose tokenizers hold one token more than the models' 512-row embeddings."""
    root = tmp_path_factory.mktemp("larger")
    folders = [root / "target", root / "draft"]
    for source, folder in zip((target_dir, draft_dir), folders, strict=True):
        shutil.copytree(source, folder)
        _add_token(folder, "zzqq")
    return load_pair(ModelSpec(str(folders[0])), ModelSpec(str(folders[1])), LoadOptions(device="cpu"))


@pytest.mark.slow
async def test_a_token_beyond_the_vocabulary_leaves_the_session_usable(
    larger_pair: ModelPair, tmp_path: Path
) -> None:
    app = make_app(larger_pair, tmp_path, max_new_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Once zzqq")
        (note,) = [n for n in app._notifications if n.title == "Message not sent"]
        assert "the prompt holds the token 'zzqq' (id 512)" in note.message
        assert screen.session.turns == []  # not kept: later prompts do not carry it
        screen.query_one("#prompt").clear()  # type: ignore[attr-defined]
        await send(pilot, "Once upon")
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 2)
        session_id = screen.session.id
    store = SessionStore(tmp_path / "sessions.sqlite3")
    resumed = make_app(larger_pair, tmp_path, max_new_tokens=6, resume=store.load(session_id))
    async with resumed.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "The end")
        await wait_for(pilot, lambda: screen.streaming is None and len(screen.session.turns) == 4)
        assert not [n for n in resumed._notifications if n.severity == "error"]
        reply = screen.session.turns[3].reply
        assert reply is not None and reply.text and reply.stop_reason != "error"


def _other_users_file(path: Path) -> None:
    path.parent.mkdir(mode=0o700)
    path.write_bytes(b"")
    path.chmod(0o666)
    os.chown(path, OTHER_USER, OTHER_USER)


def _link(path: Path) -> None:
    path.parent.mkdir(mode=0o700)
    (path.parent / "elsewhere.sqlite3").write_bytes(b"")
    path.symlink_to("elsewhere.sqlite3")


def _others_folder(path: Path) -> None:
    path.parent.mkdir()
    path.parent.chmod(0o777)
    os.chown(path.parent, OTHER_USER, OTHER_USER)


@pytest.mark.parametrize(
    ("make", "refusal"),
    [
        (_other_users_file, "sessions.sqlite3 belongs to another user (uid 4242)"),
        (_link, "sessions.sqlite3 is a symbolic link"),
        (_others_folder, "belongs to another user and others can write in it"),
    ],
    ids=["file-of-another-user", "symlink", "open-folder-of-another-user"],
)
@pytest.mark.slow
async def test_a_store_that_is_not_private_is_refused(
    make: object, refusal: str, pair: ModelPair, tmp_path: Path
) -> None:
    path = tmp_path / "data" / "sessions.sqlite3"
    make(path)  # type: ignore[operator]
    before = {p: (p.lstat().st_size, p.lstat().st_mode) for p in path.parent.iterdir()}
    app = make_app(pair, tmp_path, max_new_tokens=4, store=SessionStore(path))
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Once")
        await wait_for(pilot, lambda: screen.streaming is None)
        await wait_for(pilot, lambda: any(n.title == "Session not saved" for n in app._notifications))
        (note,) = [n for n in app._notifications if n.title == "Session not saved"]
        assert refusal in note.message
        assert screen.query("ReplyView")  # the chat goes on
    assert {p: (p.lstat().st_size, p.lstat().st_mode) for p in path.parent.iterdir()} == before


async def test_a_store_of_ones_own_that_others_may_read_is_made_private(
    pair: ModelPair, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    (data / "sessions.sqlite3").write_bytes(b"")
    (data / "sessions.sqlite3").chmod(0o666)
    app = make_app(pair, tmp_path, max_new_tokens=4, store=SessionStore(data / "sessions.sqlite3"))
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Once")
        await wait_for(pilot, lambda: screen.streaming is None and screen.chat.writer.pending() == 0)
        assert not [n for n in app._notifications if n.severity == "error"]
    assert data.stat().st_mode & 0o777 == 0o700
    assert (data / "sessions.sqlite3").stat().st_mode & 0o777 == 0o600
    saved = SessionStore(data / "sessions.sqlite3").load(screen.session.id)
    assert saved.turns[0].content == "Once"


@pytest.mark.slow
async def test_a_crafted_session_id_exports_inside_the_transcripts_folder(
    pair: ModelPair, tmp_path: Path
) -> None:
    store = SessionStore(tmp_path / "sessions.sqlite3")
    crafted = Session("../../../x/pwn", "2025-01-01T00:00:00+00:00", {"target": "t", "draft": "d"}, {})
    crafted.turns = [Turn("user", "Hi")]
    store.append_turns(crafted, crafted.turns)  # as an edit of the database could leave it
    app = make_app(pair, tmp_path, resume=store.load(crafted.id))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_chat(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.query("#export-path"))
        suggested = Path(app.screen.query_one("#export-path").value)  # type: ignore[attr-defined]
        await pilot.press("enter")
        await wait_for_chat(pilot)
    assert suggested == tmp_path / "transcripts" / "fsd-chat-2025-01-01-0000-.._.._.._x_pwn.md"
    assert suggested.is_file() and not (tmp_path.parent / "x").exists()


@pytest.mark.slow
async def test_a_reply_is_saved_again_when_the_data_folder_is_deleted_mid_reply(
    pair: ModelPair, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    gate: list[GatedDecoder] = []
    app = make_app(
        pair, tmp_path, gate=gate, max_new_tokens=30, store=SessionStore(data / "sessions.sqlite3")
    )
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "Once")
        await wait_for(
            pilot, lambda: screen.chat.writer.pending() == 0 and (data / "sessions.sqlite3").exists()
        )
        gate[0].allow(2)
        await wait_for(pilot, lambda: len(gate[0].steps) == 2)
        shutil.rmtree(data)  # mid-reply, after the exchange was first saved
        gate[0].allow(100)
        await wait_for(pilot, lambda: screen.streaming is None and screen.chat.writer.pending() == 0)
        shown = screen.session.turns[1].reply
    assert shown is not None and shown.text
    saved = SessionStore(data / "sessions.sqlite3").load(screen.session.id)
    assert [t.content for t in saved.turns] == ["Once", shown.text]
