"""The SQLite session store, on a real file in tmp_path."""

from __future__ import annotations

import json
import shutil
import sqlite3
import stat
import threading
import time
from pathlib import Path

import pytest

from fsd_chat.conversation.session import OriginRun, ReplyRecord, Session, Turn
from fsd_chat.conversation.store import SCHEMA, NoSessionsError, SessionStore, SessionStoreError
from fsd_chat.conversation.transcript import render_markdown
from fsd_chat.conversation.writer import SessionWriter
from fsd_chat.decoding.events import GenerationStats, Origin


def make_session(session_id: str = "abcd1234") -> Session:
    """A session with one exchange whose reply has two runs under two thresholds."""
    reply = ReplyRecord(
        runs=[
            OriginRun("Once", Origin.DRAFT_EXACT, 0.1, "js", "fuzzy"),
            OriginRun(" there", Origin.DRAFT_FUZZY, 0.2, "js", "fuzzy"),
        ],
        stats={**GenerationStats().to_dict(), "tokens": 2, "thresholds": [0.1, 0.2]},
        stop_reason="stopped",
    )
    return Session(
        id=session_id,
        created="2025-01-01T10:00:00+00:00",
        models={"target": "/m/t", "draft": "/m/d"},
        settings={
            "rule": "fuzzy",
            "divergence": "js",
            "threshold": 0.1,
            "draft_tokens": 4,
            "temperature": 0.0,
            "max_new_tokens": 64,
        },
        system="Be brief.",
        turns=[Turn("user", "Hello"), Turn("assistant", "Once there", reply=reply)],
    )


def saved(store: SessionStore, session: Session) -> None:
    store.append_turns(session, session.turns)


def test_save_and_load_round_trip_with_a_private_file(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "deep" / "sessions.sqlite3")  # the folder is created
    session = make_session()
    saved(store, session)
    assert store.load("abcd1234") == session
    assert stat.S_IMODE((tmp_path / "deep").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "deep" / "sessions.sqlite3").stat().st_mode) == 0o600


def test_writes_append_and_update_one_row(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    session = make_session()
    saved(store, session)
    question, answer = Turn("user", "More"), Turn("assistant", "", reply=ReplyRecord(stop_reason="streaming"))
    assert store.append_turns(session, [question, answer]) == [2, 3]
    conn = sqlite3.connect(tmp_path / "s.sqlite3")
    rowids = conn.execute("SELECT rowid FROM turns ORDER BY position").fetchall()
    answer.reply = ReplyRecord([OriginRun("Yes", Origin.TARGET_BONUS, 0.1, "js", "fuzzy")], {}, "eos")
    store.update_turn(session.id, 3, Turn("assistant", "Yes", answer.created, answer.reply))
    # The earlier rows were not deleted and rewritten: same rows, same ids.
    assert conn.execute("SELECT rowid FROM turns ORDER BY position").fetchall() == rowids
    assert [t.content for t in store.load(session.id).turns] == ["Hello", "Once there", "More", "Yes"]


def test_prefixes_and_unknown_ids(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    saved(store, make_session("abcd1234"))
    saved(store, make_session("abff0000"))
    assert store.load("abc").id == "abcd1234"
    with pytest.raises(SessionStoreError, match="ambiguous"):
        store.load("ab")
    with pytest.raises(SessionStoreError, match="no saved session 'zz'; `fsd-chat history` lists them"):
        store.load("zz")
    with pytest.raises(SessionStoreError):
        store.load("a%")  # LIKE wildcards are not wildcards here


def test_reading_a_store_that_was_never_written_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "data" / "sessions.sqlite3"
    store = SessionStore(path)
    assert store.summaries() == []
    with pytest.raises(NoSessionsError, match="no saved sessions yet"):
        store.load("abcd")
    assert not path.parent.exists()
    session = make_session("abcd1234")
    store.append_turns(session, session.turns)  # writing creates it
    assert store.load("abcd").id == "abcd1234"


def test_summaries_most_recent_first(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    saved(store, make_session("first000"))
    second = make_session("second00")
    second.turns[0] = Turn("user", "A much later question")
    saved(store, second)
    summaries = store.summaries()
    assert summaries[0].id == "second00" and summaries[0].title == "A much later question"
    assert summaries[0].turns == 2 and summaries[0].target == "/m/t"


def test_a_target_only_session_is_summarised_without_its_loaded_draft(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    target_only = make_session("alone000")
    target_only.settings["mode"] = "autoregressive"  # --autoregressive: the draft was loaded, not used
    saved(store, target_only)
    saved(store, make_session("drafted0"))
    drafts = {s.id: s.draft for s in store.summaries()}
    assert drafts == {"alone000": None, "drafted0": "/m/d"}


def test_an_unopenable_store_gives_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    session = make_session()
    with pytest.raises(SessionStoreError, match="cannot open the session store"):
        saved(SessionStore(tmp_path / "file" / "s.sqlite3"), session)


def write_v0_file(path: Path, roles_and_replies: list[tuple[str, str | None]]) -> None:
    """A session file as fsd-chat wrote it before schema versions (user_version 0)."""
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA)
    conn.execute(
        "INSERT INTO sessions VALUES ('old00000', '2025-01-01', '2025-01-01', 'Hi', '{}', '{}', NULL)"
    )
    conn.executemany(
        "INSERT INTO turns VALUES ('old00000', ?, ?, ?, '2025-01-01', ?)",
        [(i, role, f"text {i}", reply) for i, (role, reply) in enumerate(roles_and_replies)],
    )
    conn.commit()
    conn.close()


REPLY = '{"runs": [{"text": "text", "origin": "target", "threshold": 0.1, "divergence": "js", "rule": "fuzzy"}], "stats": {}, "stop_reason": "eos"}'


def test_old_files_are_migrated_and_malformed_sessions_repaired(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    # Killed mid-reply twice in an older version: two user turns in a row, and one at the end.
    write_v0_file(path, [("user", None), ("user", None), ("assistant", REPLY), ("user", None)])
    store = SessionStore(path)
    session = store.load("old")
    assert [t.role for t in session.turns] == ["user", "assistant"] * 3
    assert [t.content for t in session.turns] == ["text 0", "", "text 1", "text 2", "text 3", ""]
    assert session.turns[1].reply is not None and session.turns[1].reply.stop_reason == "stopped"
    # Reading repairs in memory and writes nothing; the first write migrates and stores the repair.
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (0,)
    store.append_turns(make_session("new00000"), [])
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (1,)
    rows = sqlite3.connect(path).execute("SELECT role FROM turns ORDER BY position").fetchall()
    assert [r for (r,) in rows] == ["user", "assistant"] * 3


def test_streaming_replies_load_as_stopped_and_consecutive_replies_join(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    streaming = REPLY.replace('"eos"', '"streaming"')
    write_v0_file(path, [("user", None), ("assistant", REPLY), ("assistant", streaming)])
    session = SessionStore(path).load("old00000")
    assert [t.role for t in session.turns] == ["user", "assistant"]
    reply = session.turns[1].reply
    assert reply is not None and reply.text == "texttext" and reply.stop_reason == "stopped"
    assert session.turns[1].content == "text 1text 2"


@pytest.mark.parametrize(
    ("stored", "policy", "shown"),
    [
        ('"draft_policy": "cost"', "latency", "| fuzzy · js · T 0.100 · k 4 (latency) |"),
        ('"draft_policy": "adaptive"', "heuristic", "| fuzzy · js · T 0.100 · k 4 (heuristic) |"),
        ('"adaptive": true', "heuristic", "| fuzzy · js · T 0.100 · k 4 (heuristic) |"),  # before policies
        ('"adaptive": false', "fixed", "| fuzzy · js · T 0.100 · k 4 |"),
        ('"draft_policy": "latency"', "latency", "| fuzzy · js · T 0.100 · k 4 (latency) |"),
    ],
)
def test_former_draft_policy_names_read_back_as_todays(
    tmp_path: Path, stored: str, policy: str, shown: str
) -> None:
    """A row saved under a draft policy's former name loads with its name now, which its
    transcript shows; reading writes nothing back."""
    path = tmp_path / "s.sqlite3"
    saved(SessionStore(path), make_session())
    # Sampled: a greedy session's divergence is not shown (`decoding_summary`).
    row = (
        '{"rule": "fuzzy", "divergence": "js", "threshold": 0.1, "temperature": 0.7, "draft_tokens": 4, '
        + stored
        + "}"
    )
    conn = sqlite3.connect(path)
    conn.execute("UPDATE sessions SET settings = ?", (row,))
    conn.commit()
    session = SessionStore(path).load("abcd1234")
    assert session.settings["draft_policy"] == policy and "adaptive" not in session.settings
    assert f"| Decoding {shown}" in render_markdown(session)
    assert conn.execute("SELECT settings FROM sessions").fetchall() == [(row,)]
    conn.close()


def test_the_dial_a_session_ended_with_is_kept_beside_its_start(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    session = make_session()
    saved(store, session)
    dial = {
        "rule": "mixture",
        "divergence": "tv",
        "threshold": 0.16,
        "draft_tokens": 4,
        "draft_policy": "fixed",
    }
    session.settings = {**session.settings, "dial": dial}
    writer = SessionWriter(store, on_error=lambda reason: None)
    writer.update_settings(session)
    assert writer.close(5)
    loaded = store.load("abcd1234")
    assert loaded.settings == session.settings  # the start kept, the dial beside it
    assert (
        "| Decoding | fuzzy · regret · T 0.100 · k 4 at the start; mixture · T 0.160 · k 4 at the end |"
        in (render_markdown(loaded))
    )
    # An edited dial is refused in one line, as any other field.
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE sessions SET settings = ?", ('{"dial": {"threshold": "high"}}',))
    conn.commit()
    conn.close()
    with pytest.raises(SessionStoreError, match=r"threshold = 'high' in its dial settings is not a number"):
        store.load("abcd1234")


def test_unrepairable_sessions_and_newer_files_are_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    write_v0_file(path, [("user", None), ("robot", None)])
    with pytest.raises(
        SessionStoreError, match=r"^session old00000 cannot be read: a turn has the role 'robot'"
    ):
        SessionStore(path).load("old00000")
    sqlite3.connect(path).execute("PRAGMA user_version = 7").connection.commit()
    with pytest.raises(SessionStoreError, match="written by a newer fsd-chat"):
        SessionStore(path).summaries()


def test_writer_waits_for_a_lock_and_retries_a_failed_save(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    store = SessionStore(path, busy_timeout=0.3)
    session = make_session()
    saved(store, session)
    errors: list[str] = []
    recovered = threading.Event()
    writer = SessionWriter(store, on_error=errors.append, on_recovered=recovered.set)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    first = [Turn("user", "One"), Turn("assistant", "", reply=ReplyRecord())]
    session.turns += first
    writer.append(session, first)
    time.sleep(0.5)  # past the busy timeout: the save fails and is reported once
    second = [Turn("user", "Two"), Turn("assistant", "", reply=ReplyRecord())]
    session.turns += second
    writer.append(session, second)  # retried, fails again: not reported again
    time.sleep(0.5)
    assert len(errors) == 1 and "database is locked" in errors[0]
    assert writer.pending() == 2
    locker.execute("ROLLBACK")
    second[1].reply = ReplyRecord([OriginRun("Done", Origin.TARGET, 0.1, "js", "fuzzy")], {}, "eos")
    writer.update_reply(session.id, second[1])  # the next save writes everything, in order
    assert recovered.wait(5)
    assert writer.close(5)
    assert [t.content for t in store.load(session.id).turns] == [
        "Hello",
        "Once there",
        "One",
        "",
        "Two",
        "Done",
    ]


def test_a_reply_is_written_as_it_was_appended_while_it_goes_on_streaming(tmp_path: Path) -> None:
    """The writer thread writes an append later than it is asked (here: behind a lock); the reply
    row it writes is the reply as appended, marked streaming, not the record the decoding thread
    has grown since (with no stop reason yet): that is `update_reply`'s to write."""
    path = tmp_path / "s.sqlite3"
    store = SessionStore(path, busy_timeout=0.3)
    session = make_session()
    saved(store, session)
    writer = SessionWriter(store, on_error=lambda reason: None)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    reply = Turn("assistant", "", reply=ReplyRecord())
    exchange = [Turn("user", "One"), reply]
    session.turns += exchange
    writer.append(session, exchange)
    assert reply.reply is not None
    reply.reply.runs.append(OriginRun("Grown", Origin.TARGET, 0.1, "js", "fuzzy"))  # the decoding thread
    locker.execute("ROLLBACK")
    assert writer.close(5)
    rows = sqlite3.connect(path).execute("SELECT reply FROM turns WHERE role = 'assistant'").fetchall()
    assert [json.loads(row)["stop_reason"] for (row,) in rows] == ["stopped", "streaming"]
    assert [t.content for t in store.load(session.id).turns][-1] == ""


def test_an_update_whose_row_is_gone_says_so(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "data" / "s.sqlite3")
    session = make_session()
    (_, reply_position) = store.append_turns(session, session.turns)
    assert store.update_turn(session.id, reply_position, session.turns[1])
    shutil.rmtree(tmp_path / "data")  # the data folder deleted: the next write starts a new file
    assert not store.update_turn(session.id, reply_position, session.turns[1])
