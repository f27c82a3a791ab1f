"""Ctrl-C and SIGTERM alike, for the commands that keep what they measured when stopped (`generate`,
`bench`): within `interrupts()`, either raises `Interrupted`, a KeyboardInterrupt that knows its
signal, so the command can end its output and exit 128 + the signal's number (130, 143), the shell's
convention for a process ended by a signal.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM arrived.

    Attributes:
        signum: The signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal's number: 130 for Ctrl-C (a plain KeyboardInterrupt too), 143 for SIGTERM."""
    return 128 + (interrupt.signum if isinstance(interrupt, Interrupted) else signal.SIGINT)


class Interrupts:
    """The signals `interrupts()` turns into `Interrupted`, with a way to hold them off (`held`)."""

    def __init__(self) -> None:
        self._holding = False
        self._pending: int | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        """The signal handler: raise `Interrupted` now, or at the end of the `held` block within."""
        if self._holding:
            self._pending = signum
            return
        raise Interrupted(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Within: a signal is kept until the block ends, then raised as `Interrupted`, so that
        work that must be whole (a step counted in the summary and written out) is not cut between
        its parts. Only for short blocks: the user waits for the block's end."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        # Not reached when the block raised: its exception goes on, and a signal with it is dropped.
        if self._pending is not None:
            signum, self._pending = self._pending, None
            raise Interrupted(signum)


@contextmanager
def interrupts() -> Iterator[Interrupts]:
    """Within: SIGINT and SIGTERM raise `Interrupted` (SIGTERM would otherwise end the process at
    once, losing what was measured), outside the yielded object's `held` blocks. A signal ignored on
    entry stays ignored: a shell starts a background job with SIGINT ignored, so that Ctrl-C meant
    for the foreground spares it. The previous handlers come back after. Main thread only
    (`signal.signal`).
    """
    signals = Interrupts()
    previous = {
        signum: signal.signal(signum, signals.handle)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield signals
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
