"""Chat sessions saved in SQLite (stdlib sqlite3), one row per session and one per turn.

`save` is called after every user message and every finished reply; each call is one committed
transaction, so a killed process loses at most the reply that was streaming.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from fsd_chat.errors import FsdChatError
from fsd_chat.session import Session, Turn, reply_from_dict

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    updated TEXT NOT NULL,
    title TEXT NOT NULL,
    models TEXT NOT NULL,
    settings TEXT NOT NULL,
    system TEXT
);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created TEXT NOT NULL,
    reply TEXT,
    PRIMARY KEY (session_id, position)
);
"""


class SessionStoreError(FsdChatError):
    """The session store cannot be opened or written, or a session id matches nothing (or several)."""


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """One line of `fsd-chat history`."""

    id: str
    created: str
    updated: str
    turns: int
    target: str
    draft: str
    title: str


class SessionStore:
    """Sessions in one SQLite file (created with its folder on first use).

    A connection is opened per call: the store is used from the UI thread and from the CLI, and
    SQLite connections must not cross threads.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path)
        except (OSError, sqlite3.Error) as exc:
            raise SessionStoreError(f"cannot open the session store {self.path}: {exc}") from None
        try:
            conn.executescript(SCHEMA)
            with conn:  # one transaction: committed on success, rolled back on error
                yield conn
        except sqlite3.Error as exc:
            raise SessionStoreError(f"session store {self.path}: {exc}") from None
        finally:
            conn.close()

    def save(self, session: Session) -> None:
        """Write the session and all its turns (replacing what was stored under its id)."""
        with self._connect() as conn:
            conn.execute(
                "INSERT INTO sessions (id, created, updated, title, models, settings, system) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET updated = excluded.updated, "
                "title = excluded.title, models = excluded.models, settings = excluded.settings, "
                "system = excluded.system",
                (
                    session.id,
                    session.created,
                    # Microseconds: sessions saved within one second still sort by recency.
                    datetime.now().astimezone().isoformat(),
                    session.title,
                    json.dumps(session.models),
                    json.dumps(session.settings),
                    session.system,
                ),
            )
            conn.execute("DELETE FROM turns WHERE session_id = ?", (session.id,))
            conn.executemany(
                "INSERT INTO turns (session_id, position, role, content, created, reply) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (
                        session.id,
                        i,
                        t.role,
                        t.content,
                        t.created,
                        None if t.reply is None else json.dumps(asdict(t.reply)),
                    )
                    for i, t in enumerate(session.turns)
                ],
            )

    def resolve(self, key: str) -> str:
        """The full id of the session whose id is `key` or starts with it.

        Raises:
            SessionStoreError: no session, or several, match.
        """
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT id FROM sessions WHERE substr(id, 1, ?) = ? ORDER BY id", (len(key), key)
            ).fetchall()
        ids = [r[0] for r in rows]
        if key in ids:
            return key
        if not ids:
            raise SessionStoreError(f"no saved session {key!r}; `fsd-chat history` lists them")
        if len(ids) > 1:
            raise SessionStoreError(f"session {key!r} is ambiguous: it starts {', '.join(ids)}")
        return ids[0]

    def load(self, key: str) -> Session:
        """The session with id `key` (or the one id starting with `key`).

        Raises:
            SessionStoreError: no session, or several, match.
        """
        session_id = self.resolve(key)
        with self._connect() as conn:
            row = conn.execute(
                "SELECT id, created, models, settings, system FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            turns = conn.execute(
                "SELECT role, content, created, reply FROM turns WHERE session_id = ? ORDER BY position",
                (session_id,),
            ).fetchall()
        return Session(
            id=row[0],
            created=row[1],
            models=json.loads(row[2]),
            settings=json.loads(row[3]),
            system=row[4],
            turns=[
                Turn(role, content, created, None if reply is None else reply_from_dict(json.loads(reply)))
                for role, content, created, reply in turns
            ],
        )

    def summaries(self) -> list[SessionSummary]:
        """All sessions, most recently updated first."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT s.id, s.created, s.updated, s.title, s.models, "
                "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) "
                "FROM sessions s ORDER BY s.updated DESC, s.created DESC"
            ).fetchall()
        summaries = []
        for session_id, created, updated, title, models, count in rows:
            m = json.loads(models)
            summaries.append(
                SessionSummary(
                    session_id, created, updated, count, m.get("target", ""), m.get("draft", ""), title
                )
            )
        return summaries
