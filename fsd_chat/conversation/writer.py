"""Saving a chat session off the UI thread: one writer thread applies the saves in order.

A save that fails (the file locked past the busy timeout, a full disk) stays at the head of the
queue: it is reported once, and retried with everything after it on the next save, so nothing is
lost while the chat goes on; `close` retries until its time is up. A streaming reply's rows are
written as snapshots; only the latest pending snapshot of a turn is kept. An update that finds its
row gone (the data folder deleted mid-reply) saves the session's written turns again instead of
counting as done.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fsd_chat.conversation.session import Session, Turn
from fsd_chat.conversation.store import SessionStore
from fsd_chat.support.errors import FsdChatError

RETRY_SECONDS = 0.25
"""Pause between two tries of a failed save while closing (each try also waits the store's busy
timeout)."""


@dataclass(slots=True)
class _Append:
    session: Session
    turns: list[Turn]
    """The turns given: they identify the stored rows."""
    rows: list[Turn]
    """What to write: the turns as they were when given (`snapshot`)."""


@dataclass(slots=True)
class _Update:
    session_id: str
    turn: Turn
    """The turn given to an earlier append: it identifies the stored row."""
    snapshot: Turn
    """What to write."""
    in_flight: bool = False


@dataclass(slots=True)
class _Settings:
    session_id: str
    settings: dict[str, object]


def snapshot(turn: Turn) -> Turn:
    """`turn` as it is now, for the writer thread to serialise while the decoding thread goes on:
    a reply's record copied (one still streaming marked so, `ReplyRecord.snapshot`); a message,
    never changed once made, as it is."""
    if turn.reply is None:
        return turn
    return Turn(turn.role, turn.reply.text, turn.created, turn.reply.snapshot())


class SessionWriter:
    """A thread that writes appends and updates of sessions to `store`, in order.

    Args:
        store: Where sessions are saved.
        on_error: Called (in the writer thread) with a one-line reason when a save fails, once per
            run of failures.
        on_recovered: Called (in the writer thread) when saving works again after a failure.
    """

    def __init__(
        self,
        store: SessionStore,
        *,
        on_error: Callable[[str], object],
        on_recovered: Callable[[], object] = lambda: None,
    ) -> None:
        self.store = store
        self._on_error = on_error
        self._on_recovered = on_recovered
        self._queue: deque[_Append | _Update | _Settings] = deque()
        self._positions: dict[int, tuple[Turn, int]] = {}
        """id(turn) -> (turn, stored position), for the turns this writer appended (the turn is
        kept so that its id is not reused)."""
        self._sessions: dict[str, Session] = {}
        """The sessions this writer appended to, by id (to save one again whose rows are gone)."""
        self._puts = 0
        self._failing = False
        self._closing = False
        self._close_deadline = 0.0
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="session-writer", daemon=True)
        self._thread.start()

    def append(self, session: Session, turns: list[Turn]) -> None:
        """Store `turns` (already appended to `session.turns`) after the session's stored ones, as
        they are now: a reply the decoding thread goes on growing is written as it was given, still
        streaming (the rows that follow are `update_reply`'s)."""
        self._put(_Append(session, list(turns), [snapshot(turn) for turn in turns]))

    def update_reply(self, session_id: str, turn: Turn) -> None:
        """Store the reply turn `turn` (given to `append` before) as it is now; a reply still
        streaming is stored as such (see `ReplyRecord.snapshot`)."""
        assert turn.reply is not None
        frozen = snapshot(turn)
        with self._wake:
            for op in self._queue:
                # A newer snapshot replaces a pending one: throttled streaming writes never pile
                # up behind a lock.
                if isinstance(op, _Update) and op.turn is turn and not op.in_flight:
                    op.snapshot = frozen
                    self._puts += 1
                    self._wake.notify()
                    return
        self._put(_Update(session_id, turn, frozen))

    def update_settings(self, session: Session) -> None:
        """Store the session's settings as they are now (the dial moved); a newer pending save of
        them replaces an older one."""
        op = _Settings(session.id, session.settings)
        with self._wake:
            for i, pending in enumerate(self._queue):
                if i and isinstance(pending, _Settings) and pending.session_id == session.id:
                    pending.settings = op.settings  # not the head: that one may be being written
                    self._puts += 1
                    self._wake.notify()
                    return
        self._put(op)

    def _put(self, op: _Append | _Update | _Settings) -> None:
        with self._wake:
            self._queue.append(op)
            self._puts += 1
            self._wake.notify()

    def pending(self) -> int:
        """Saves not yet written."""
        with self._wake:
            return len(self._queue)

    def close(self, timeout: float) -> bool:
        """Write what is pending, retrying failed saves for at most `timeout` seconds, and stop the
        thread.

        Returns:
            Whether everything was written.
        """
        with self._wake:
            if not self._closing:
                self._closing = True
                self._close_deadline = time.monotonic() + timeout
            self._wake.notify()
        self._thread.join(timeout)
        return self.pending() == 0

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if not self._queue:
                    return
                op = self._queue[0]
                if isinstance(op, _Update):
                    op.in_flight = True
                puts = self._puts
            try:
                self._write(op)
            except FsdChatError as exc:
                if not self._failing:
                    self._failing = True
                    self._on_error(str(exc))
                with self._wake:
                    if isinstance(op, _Update):
                        op.in_flight = False
                    if self._closing:
                        left = self._close_deadline - time.monotonic()
                        if left <= 0:
                            return
                        self._wake.wait(min(left, RETRY_SECONDS))
                        continue
                    # Retried on the next save (or close), not in a busy loop.
                    while self._puts == puts and not self._closing:
                        self._wake.wait()
                continue
            with self._wake:
                self._queue.popleft()
            if self._failing:
                self._failing = False
                self._on_recovered()

    def _write(self, op: _Append | _Update | _Settings) -> None:
        if isinstance(op, _Append):
            self._sessions[op.session.id] = op.session
            self._append(op.session, op.turns, op.rows)
        elif isinstance(op, _Settings):
            self.store.update_settings(op.session_id, op.settings)
        elif not self.store.update_turn(op.session_id, self._positions[id(op.turn)][1], op.snapshot):
            # The reply's row is gone (the data folder was deleted mid-reply, the file replaced):
            # the turns written so far are saved again, the reply as it is now, rather than lost.
            session = self._sessions[op.session_id]
            written = [t for t in session.turns if id(t) in self._positions]
            self._append(session, written, [op.snapshot if t is op.turn else t for t in written])

    def _append(self, session: Session, turns: list[Turn], rows: list[Turn]) -> None:
        """Store `rows` (what to write of `turns`, in order) and remember where each turn went."""
        positions = self.store.append_turns(session, rows)
        for turn, position in zip(turns, positions, strict=True):
            self._positions[id(turn)] = (turn, position)
