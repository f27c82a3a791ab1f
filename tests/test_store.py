"""The SQLite session store, on a real file in tmp_path."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fsd_chat.decoding.events import GenerationStats, Origin
from fsd_chat.session import ReplyRecord, Run, Session, Turn
from fsd_chat.store import SessionStore, SessionStoreError


def make_session(session_id: str = "abcd1234") -> Session:
    """A session with one exchange whose reply has two runs under two thresholds."""
    reply = ReplyRecord(
        runs=[
            Run("Once", Origin.DRAFT_EXACT, 0.1, "js", "fuzzy"),
            Run(" there", Origin.DRAFT_FUZZY, 0.2, "js", "fuzzy"),
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


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "deep" / "sessions.sqlite3")  # the folder is created
    session = make_session()
    store.save(session)
    loaded = store.load("abcd1234")
    assert loaded == session


def test_saving_again_replaces_the_turns(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    session = make_session()
    store.save(session)
    session.turns.append(Turn("user", "More"))
    store.save(session)
    assert [t.content for t in store.load(session.id).turns] == ["Hello", "Once there", "More"]
    rows = sqlite3.connect(tmp_path / "s.sqlite3").execute("SELECT COUNT(*) FROM turns").fetchone()
    assert rows == (3,)


def test_prefixes_and_unknown_ids(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    store.save(make_session("abcd1234"))
    store.save(make_session("abff0000"))
    assert store.load("abc").id == "abcd1234"
    with pytest.raises(SessionStoreError, match="ambiguous"):
        store.load("ab")
    with pytest.raises(SessionStoreError, match="no saved session 'zz'; `fsd-chat history` lists them"):
        store.load("zz")
    with pytest.raises(SessionStoreError):
        store.load("a%")  # LIKE wildcards are not wildcards here


def test_summaries_most_recent_first(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3")
    store.save(make_session("first000"))
    second = make_session("second00")
    second.turns[0] = Turn("user", "A much later question")
    store.save(second)
    summaries = store.summaries()
    assert summaries[0].id == "second00" and summaries[0].title == "A much later question"
    assert summaries[0].turns == 2 and summaries[0].target == "/m/t"


def test_an_unopenable_store_gives_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SessionStoreError, match="cannot open the session store"):
        SessionStore(tmp_path / "file" / "s.sqlite3").save(make_session())
