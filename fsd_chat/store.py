"""Chat sessions saved in SQLite (stdlib sqlite3), one row per session and one per turn.

Writes append: an exchange (the user's turn and the reply it asks for) is inserted after the
session's last stored turn, and the reply's row is updated while it streams. Two chats writing one
session therefore interleave their exchanges instead of overwriting each other's. The file carries
its schema version (`PRAGMA user_version`); older files are migrated when opened. The data folder
is private (0700) and so is the file (0600).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from fsd_chat.errors import FsdChatError
from fsd_chat.session import MalformedSessionError, Session, Turn, repair_turns, reply_from_dict

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

SCHEMA_VERSION = 1
"""Version 0: files of fsd-chat before versioning (same tables; sessions could be left with a user
turn without its reply). Version 1: every stored session is a valid alternation of turns."""

BUSY_TIMEOUT = 2.0
"""Seconds a write waits for another process's lock before it fails (and is retried later)."""


class SessionStoreError(FsdChatError):
    """The session store cannot be opened or written, or a session id matches nothing (or several)."""


class NoSessionsError(SessionStoreError):
    """The store's file does not exist: nothing was ever saved (reading does not create it)."""


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


def _timestamp() -> str:
    # Microseconds: sessions saved within one second still sort by recency.
    return datetime.now().astimezone().isoformat()


def _reply_json(turn: Turn) -> str | None:
    return None if turn.reply is None else json.dumps(asdict(turn.reply))


class SessionStore:
    """Sessions in one SQLite file (created with its folder on first use).

    A connection is opened per call: the store is used from the session writer's thread and from
    the CLI, and SQLite connections must not cross threads.

    Args:
        path: The SQLite file.
        busy_timeout: Seconds a call waits for a lock held by another connection.
    """

    def __init__(self, path: Path, *, busy_timeout: float = BUSY_TIMEOUT) -> None:
        self.path = path
        self.busy_timeout = busy_timeout

    @contextmanager
    def _connect(self, *, create: bool = True) -> Iterator[sqlite3.Connection]:
        """A connection in one transaction; `create=False` (readers) refuses a missing file with
        `NoSessionsError` rather than create it on a machine that never chatted."""
        if not create and not self.path.exists():
            raise NoSessionsError(f"no saved sessions yet ({self.path} does not exist)")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Created private: conversations are their owner's alone.
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout)
        except (OSError, sqlite3.Error) as exc:
            raise SessionStoreError(f"cannot open the session store {self.path}: {exc}") from None
        try:
            self._migrate(conn)
            with conn:  # one transaction: committed on success, rolled back on error
                yield conn
        except sqlite3.Error as exc:
            raise SessionStoreError(f"session store {self.path}: {exc}") from None
        finally:
            conn.close()

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise SessionStoreError(
                f"{self.path} was written by a newer fsd-chat (schema {version}; this one reads up to "
                f"{SCHEMA_VERSION})"
            )
        with conn:
            conn.executescript("BEGIN IMMEDIATE;" + SCHEMA)
            # 0 -> 1: sessions an interrupted reply left malformed are repaired once, in place.
            for (session_id,) in conn.execute("SELECT id FROM sessions").fetchall():
                try:
                    turns, repairs = repair_turns(self._turns(conn, session_id))
                except (MalformedSessionError, ValueError, KeyError, TypeError):
                    continue  # refused with its reason when it is loaded
                if repairs:
                    self._rewrite_turns(conn, session_id, turns)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @staticmethod
    def _turns(conn: sqlite3.Connection, session_id: str) -> list[Turn]:
        rows = conn.execute(
            "SELECT role, content, created, reply FROM turns WHERE session_id = ? ORDER BY position",
            (session_id,),
        ).fetchall()
        return [
            Turn(role, content, created, None if reply is None else reply_from_dict(json.loads(reply)))
            for role, content, created, reply in rows
        ]

    @staticmethod
    def _rewrite_turns(conn: sqlite3.Connection, session_id: str, turns: list[Turn]) -> None:
        conn.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
        conn.executemany(
            "INSERT INTO turns (session_id, position, role, content, created, reply) VALUES (?, ?, ?, ?, ?, ?)",
            [(session_id, i, t.role, t.content, t.created, _reply_json(t)) for i, t in enumerate(turns)],
        )

    def append_turns(self, session: Session, turns: list[Turn]) -> list[int]:
        """Store `turns` after the session's last stored turn, in one transaction (the session's
        row is created by its first append).

        Returns:
            The stored positions of `turns` (for `update_turn`).

        Raises:
            SessionStoreError: the file cannot be opened or written (e.g. locked past the busy timeout).
        """
        with self._connect() as conn:
            conn.execute(
                "INSERT INTO sessions (id, created, updated, title, models, settings, system) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET updated = excluded.updated",
                (
                    session.id,
                    session.created,
                    _timestamp(),
                    session.title,
                    json.dumps(session.models),
                    json.dumps(session.settings),
                    session.system,
                ),
            )
            (first,) = conn.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM turns WHERE session_id = ?", (session.id,)
            ).fetchone()
            positions = list(range(first, first + len(turns)))
            conn.executemany(
                "INSERT INTO turns (session_id, position, role, content, created, reply) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (session.id, p, t.role, t.content, t.created, _reply_json(t))
                    for p, t in zip(positions, turns, strict=True)
                ],
            )
        return positions

    def update_turn(self, session_id: str, position: int, turn: Turn) -> None:
        """Replace the content and reply of the stored turn at `position` (a streaming reply).

        Raises:
            SessionStoreError: the file cannot be opened or written.
        """
        with self._connect() as conn:
            conn.execute(
                "UPDATE turns SET content = ?, reply = ? WHERE session_id = ? AND position = ?",
                (turn.content, _reply_json(turn), session_id, position),
            )
            conn.execute("UPDATE sessions SET updated = ? WHERE id = ?", (_timestamp(), session_id))

    def resolve(self, key: str) -> str:
        """The full id of the session whose id is `key` or starts with it.

        Raises:
            NoSessionsError: the store's file does not exist.
            SessionStoreError: no session, or several, match.
        """
        with self._connect(create=False) as conn:
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
        """The session with id `key` (or the one id starting with `key`), repaired into a valid
        conversation if it is not one (the repair is stored; see `repair_turns`).

        Raises:
            NoSessionsError: the store's file does not exist.
            SessionStoreError: no session, or several, match; or it cannot be repaired.
        """
        session_id = self.resolve(key)
        with self._connect(create=False) as conn:
            row = conn.execute(
                "SELECT id, created, models, settings, system FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            try:
                turns, repairs = repair_turns(self._turns(conn, session_id))
                models, settings = json.loads(row[2]), json.loads(row[3])
            except (MalformedSessionError, ValueError, KeyError, TypeError) as exc:
                raise SessionStoreError(f"session {session_id} cannot be read: {exc}") from None
            if repairs:
                self._rewrite_turns(conn, session_id, turns)
        return Session(
            id=row[0], created=row[1], models=models, settings=settings, system=row[4], turns=turns
        )

    def summaries(self) -> list[SessionSummary]:
        """All sessions, most recently updated first (none when the store's file does not exist)."""
        try:
            with self._connect(create=False) as conn:
                rows = conn.execute(
                    "SELECT s.id, s.created, s.updated, s.title, s.models, "
                    "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) "
                    "FROM sessions s ORDER BY s.updated DESC, s.created DESC"
                ).fetchall()
        except NoSessionsError:
            return []
        summaries = []
        for session_id, created, updated, title, models, count in rows:
            m = json.loads(models)
            summaries.append(
                SessionSummary(
                    session_id, created, updated, count, m.get("target", ""), m.get("draft", ""), title
                )
            )
        return summaries
