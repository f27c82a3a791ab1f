"""`fsd_chat.support.interrupts` with real signals sent to this process (main thread)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from fsd_chat.support.interrupts import STOP_SIGNALS, Interrupted, interrupts


@pytest.fixture(autouse=True)
def default_handlers() -> Iterator[None]:
    """The stop signals at their default handlers, as in a command run from a shell: pytest-xdist's
    workers ignore SIGINT (Ctrl-C is the controller's), and `interrupts` keeps an ignored signal
    ignored."""
    before = {signum: signal.signal(signum, signal.SIG_DFL) for signum in STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_a_signal_raises_at_once_outside_a_held_block() -> None:
    with interrupts(), pytest.raises(Interrupted) as caught:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # ended by the signal's exception, long before 5 s
    assert caught.value.signum == signal.SIGINT


def test_a_signal_in_a_held_block_waits_for_its_end() -> None:
    """The block runs to its end (a step counted and written whole), then the signal is raised."""
    done = []
    with interrupts() as signals:
        with pytest.raises(Interrupted) as caught, signals.held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run by now: it only noted the signal
            done.append("the rest of the block")
        assert caught.value.signum == signal.SIGTERM
        with signals.held():  # the signal was raised once, not kept for the next block
            done.append("the next block")
    assert done == ["the rest of the block", "the next block"]


def test_the_previous_handlers_come_back_and_an_ignored_signal_stays_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's
    with interrupts():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
