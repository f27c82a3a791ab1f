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


@contextmanager
def interrupts() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise `Interrupted` (SIGTERM would otherwise end the process at
    once, losing what was measured). A signal ignored on entry stays ignored: a shell starts a
    background job with SIGINT ignored, so that Ctrl-C meant for the foreground spares it. The
    previous handlers come back after. Main thread only (`signal.signal`).
    """

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {
        signum: signal.signal(signum, interrupt)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
