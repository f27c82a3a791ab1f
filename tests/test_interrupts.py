"""`fsd_chat.support.interrupts` with real signals sent to this process (main thread)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fsd_chat.support.interrupts import Interrupted, interrupts


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


def test_the_previous_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with interrupts():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
