"""Chat sessions saved in SQLite (stdlib sqlite3), one row per session and one per turn.

Writes append: an exchange (the user's turn and the reply it asks for) is inserted after the
session's last stored turn, and the reply's row is updated while it streams. Two chats writing one
session therefore interleave their exchanges instead of overwriting each other's. The file carries
its schema version (`PRAGMA user_version`); older files are migrated when first written. The data
folder is private (0700) and so is the file (0600); readers open it read-only and change nothing.
Rows are checked field by field when read (`fsd_chat.conversation.session.checked_fields`): an edited or damaged
row is refused with its reason, and left out of the list of sessions.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from fsd_chat.conversation.session import (
    MalformedSessionError,
    Session,
    Turn,
    models_from_dict,
    repair_turns,
    reply_from_dict,
    settings_from_dict,
)
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import some

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
    draft: str | None
    """The draft as loaded; None for a session decoded target-only (`--autoregressive`)."""
    title: str


def _timestamp() -> str:
    # Microseconds: sessions saved within one second still sort by recency.
    return datetime.now().astimezone().isoformat()


def _reply_json(turn: Turn) -> str | None:
    return None if turn.reply is None else json.dumps(asdict(turn.reply))


class SessionStore:
    """Sessions in one SQLite file (created with its folder on first write).

    A connection is opened per call: the store is used from the session writer's thread and from
    the CLI, and SQLite connections must not cross threads. Reading (`load`, `summaries`) opens the
    file read-only (SQLite's `mode=ro`): it needs no write access and never changes the file.
    Writing needs a private store of the user's own: a regular file (not a link) that the user
    owns, in a folder that other users cannot write. A file that others may read or write has its
    modes fixed (0600) when the user owns it; anything else is refused, with what to fix.

    Args:
        path: The SQLite file.
        busy_timeout: Seconds a call waits for a lock held by another connection.
    """

    def __init__(self, path: Path, *, busy_timeout: float = BUSY_TIMEOUT) -> None:
        self.path = path
        self.busy_timeout = busy_timeout

    @contextmanager
    def _connect(self, *, write: bool = True) -> Iterator[sqlite3.Connection]:
        """A connection in one transaction; `write=False` (readers) opens the file read-only and
        refuses a missing or empty file with `NoSessionsError` rather than create it."""
        try:
            if write:
                self._prepare_for_writing()
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout)
            else:
                self._check_readable()
                uri = f"{self.path.absolute().as_uri()}?mode=ro"
                conn = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout)
        except (OSError, sqlite3.Error) as exc:
            raise SessionStoreError(f"cannot open the session store {self.path}: {_reason(exc)}") from None
        try:
            self._migrate(conn, write=write)
            with conn:  # one transaction: committed on success, rolled back on error
                yield conn
        except sqlite3.Error as exc:
            raise SessionStoreError(f"session store {self.path}: {exc}") from None
        finally:
            conn.close()

    def _check_readable(self) -> None:
        """Refuse what is not a regular file (a link, a folder); a missing or empty file holds no
        sessions.

        Raises:
            NoSessionsError, SessionStoreError, OSError.
        """
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            raise NoSessionsError(f"no saved sessions yet ({self.path} does not exist)") from None
        self._check_kind(info)
        if info.st_size == 0:
            raise NoSessionsError(f"no saved sessions yet ({self.path} is empty)")

    def _check_kind(self, info: os.stat_result) -> None:
        if stat.S_ISLNK(info.st_mode):
            raise SessionStoreError(
                f"{self.path} is a symbolic link: fsd-chat keeps sessions only in a regular file (put "
                "the file itself there, or point FSD_CHAT_DATA_DIR at its folder)"
            )
        if not stat.S_ISREG(info.st_mode):
            raise SessionStoreError(f"{self.path} is not a regular file: move it away")

    def _prepare_for_writing(self) -> None:
        """Create the folder (0700) and the file (0600) if needed, and check that both are private.

        Raises:
            SessionStoreError: a link, not a regular file, a file of another user, or a folder that
                other users may write.
            OSError: the folder or the file cannot be created or opened.
        """
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(folder)
        if info.st_mode & 0o022 and info.st_uid != os.geteuid():
            raise SessionStoreError(
                f"the data folder {folder} belongs to another user and others can write in it: point "
                "FSD_CHAT_DATA_DIR at a folder of your own"
            )
        if info.st_mode & 0o022:
            # Others could replace the file or plant SQLite's journal beside it: the folder is made
            # the user's alone, as fsd-chat creates it.
            os.chmod(folder, stat.S_IMODE(info.st_mode) & ~0o077)
        try:
            # Created private: conversations are their owner's alone. O_NOFOLLOW: a link is refused
            # rather than followed to wherever it points.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._check_kind(os.lstat(self.path))
            raise
        try:
            info = os.fstat(fd)
            self._check_kind(info)
            if info.st_uid != os.geteuid():
                raise SessionStoreError(
                    f"{self.path} belongs to another user (uid {info.st_uid}): fsd-chat writes "
                    "conversations only into a file of your own (move it away)"
                )
            if info.st_mode & 0o077:
                os.fchmod(fd, 0o600)  # the user's own file, readable by others: made private
        finally:
            os.close(fd)

    def _migrate(self, conn: sqlite3.Connection, *, write: bool) -> None:
        """Refuse a newer schema; bring an older one up to date when writing (readers read the old
        tables as they are, and repair sessions in memory)."""
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise SessionStoreError(
                f"{self.path} was written by a newer fsd-chat (schema {version}; this one reads up to "
                f"{SCHEMA_VERSION})"
            )
        if not write:
            tables = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'sessions'").fetchone()
            if tables == (0,):
                raise NoSessionsError(f"no saved sessions yet ({self.path} holds none)")
            return
        with conn:
            conn.executescript("BEGIN IMMEDIATE;" + SCHEMA)
            # 0 -> 1: sessions an interrupted reply left malformed are repaired once, in place.
            for (session_id,) in conn.execute("SELECT id FROM sessions").fetchall():
                try:
                    turns, repairs = repair_turns(self._turns(conn, session_id))
                except (MalformedSessionError, ValueError):
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
        turns = []
        for role, content, created, reply in rows:
            if not isinstance(content, str) or not isinstance(created, str):
                raise MalformedSessionError("a turn's content or time is not text")
            turns.append(
                Turn(role, content, created, None if reply is None else reply_from_dict(json.loads(reply)))
            )
        return turns

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
                "VALUES (?, ?, ?, ?, ?, ?, ?) "
                # The settings too: they carry the dial as it is now (`Session.settings["dial"]`).
                "ON CONFLICT(id) DO UPDATE SET updated = excluded.updated, settings = excluded.settings",
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

    def update_turn(self, session_id: str, position: int, turn: Turn) -> bool:
        """Replace the content and reply of the stored turn at `position` (a streaming reply).

        Returns:
            Whether the turn was there to update: False when its row is gone (the data folder was
            deleted, the file replaced), so that the caller saves the session again.

        Raises:
            SessionStoreError: the file cannot be opened or written.
        """
        with self._connect() as conn:
            changed = conn.execute(
                "UPDATE turns SET content = ?, reply = ? WHERE session_id = ? AND position = ?",
                (turn.content, _reply_json(turn), session_id, position),
            ).rowcount
            conn.execute("UPDATE sessions SET updated = ? WHERE id = ?", (_timestamp(), session_id))
        return changed == 1

    def update_settings(self, session_id: str, settings: dict[str, object]) -> None:
        """Replace the stored settings of a session (the dial moved); nothing happens to a session
        not stored yet (its first append stores them).

        Raises:
            SessionStoreError: the file cannot be opened or written.
        """
        with self._connect() as conn:
            conn.execute(
                "UPDATE sessions SET settings = ?, updated = ? WHERE id = ?",
                (json.dumps(settings), _timestamp(), session_id),
            )

    def resolve(self, key: str) -> str:
        """The full id of the session whose id is `key` or starts with it.

        Raises:
            NoSessionsError: the store's file does not exist or is empty.
            SessionStoreError: no session, or several, match.
        """
        with self._connect(write=False) as conn:
            rows = conn.execute(
                "SELECT id FROM sessions WHERE substr(id, 1, ?) = ? ORDER BY id", (len(key), key)
            ).fetchall()
        ids = [str(r[0]) for r in rows]
        if key in ids:
            return key
        if not ids:
            raise SessionStoreError(f"no saved session {key!r}; `fsd-chat history` lists them")
        if len(ids) > 1:
            raise SessionStoreError(
                f"session {key!r} is ambiguous: {len(ids):,} sessions start with it ({some(ids)})"
            )
        return ids[0]

    def load(self, key: str) -> Session:
        """The session with id `key` (or the one id starting with `key`), checked field by field
        and repaired into a valid conversation if it is not one (see `repair_turns`; the repair
        is in memory: reading does not write).

        Raises:
            NoSessionsError: the store's file does not exist or is empty.
            SessionStoreError: no session, or several, match; or it is damaged beyond repair.
        """
        session_id = self.resolve(key)
        with self._connect(write=False) as conn:
            row = conn.execute(
                "SELECT id, created, models, settings, system FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            try:
                turns, _ = repair_turns(self._turns(conn, session_id))
                return _session(row, turns)
            except (MalformedSessionError, ValueError) as exc:
                raise SessionStoreError(f"session {session_id} cannot be read: {exc}") from None

    def summaries(self, on_damaged: Callable[[str], object] = lambda _reason: None) -> list[SessionSummary]:
        """All sessions, most recently updated first (none when the store's file does not exist).

        Args:
            on_damaged: Called with one line per session left out because its row is damaged
                (one edited row does not hide the others).
        """
        try:
            with self._connect(write=False) as conn:
                rows = conn.execute(
                    "SELECT s.id, s.created, s.updated, s.title, s.models, s.settings, "
                    "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) "
                    "FROM sessions s ORDER BY s.updated DESC, s.created DESC"
                ).fetchall()
        except NoSessionsError:
            return []
        summaries = []
        for session_id, created, updated, title, models, settings, count in rows:
            try:
                if not all(
                    isinstance(v, str) for v in (session_id, created, updated, title, models, settings)
                ):
                    raise MalformedSessionError("its row holds a value that is not text")
                m = models_from_dict(json.loads(models))
                target_only = settings_from_dict(json.loads(settings)).get("mode") == "autoregressive"
            except (MalformedSessionError, ValueError) as exc:
                on_damaged(f"session {session_id} left out, its row is damaged: {exc}")
                continue
            summaries.append(
                SessionSummary(
                    session_id,
                    created,
                    updated,
                    count,
                    m.get("target", ""),
                    None if target_only else m.get("draft", ""),
                    title,
                )
            )
        return summaries


def _session(row: tuple[object, ...], turns: list[Turn]) -> Session:
    """A session from its stored row (id, created, models, settings, system) and turns.

    Raises:
        MalformedSessionError, ValueError: a field is not valid JSON, or not what it should be.
    """
    session_id, created, models, settings, system = row
    if not isinstance(session_id, str) or not isinstance(created, str) or not isinstance(models, str):
        raise MalformedSessionError("its row holds a value that is not text")
    if not isinstance(settings, str) or not isinstance(system, str | None):
        raise MalformedSessionError("its row holds a value that is not text")
    return Session(
        id=session_id,
        created=created,
        models=models_from_dict(json.loads(models)),
        settings=settings_from_dict(json.loads(settings)),
        system=system,
        turns=turns,
    )


def _reason(exc: BaseException) -> str:
    """An OSError's reason without its "[Errno N]" prefix (the path is in the message already)."""
    return (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
