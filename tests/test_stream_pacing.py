"""Handing steps to the UI: the buffer keeps every step in order and asks for one wake-up per
batch; the pacer spaces batches by the UI's own CPU cost, within fixed bounds."""

from __future__ import annotations

from fsd_chat.decoding.events import Step, StepStats
from fsd_chat.tui.stream import BATCH_INTERVAL, LONGEST_INTERVAL, BatchPacer, StepBuffer


def step(n: int) -> Step:
    return Step((), StepStats(n, 0, 0, 0, 1, n, 0.0, 0.0, 0.0, 0.0, "js", "fuzzy"))


def test_the_buffer_wakes_once_per_batch_and_keeps_the_order() -> None:
    buffer = StepBuffer()
    assert buffer.add(step(1)) is True  # was empty: wake the UI
    assert buffer.add(step(2)) is False  # a wake-up is already on its way
    assert [s.stats.drafted for s in buffer.take()] == [1, 2]
    assert buffer.take() == ()
    assert buffer.add(step(3)) is True


def test_the_pacer_follows_the_uis_cost_within_bounds() -> None:
    wall, cpu = [0.0], [0.0]
    pacer = BatchPacer(share=0.05, clock=lambda: wall[0], cpu_clock=lambda: cpu[0])
    assert pacer.wait() == 0.0  # the first batch goes out at once
    pacer.shown()
    cpu[0] += 0.001  # cheap drawing: the shortest interval
    pacer.shown()
    assert pacer.interval == BATCH_INTERVAL
    wall[0] += 0.01
    assert abs(pacer.wait() - (BATCH_INTERVAL - 0.01)) < 1e-9
    cpu[0] += 0.005  # 5 ms of UI work since the last batch: 5 ms / 5% = 0.1 s to the next
    pacer.shown()
    assert abs(pacer.interval - 0.1) < 1e-9
    cpu[0] += 1.0  # very costly drawing: still at least a batch every LONGEST_INTERVAL
    pacer.shown()
    assert pacer.interval == LONGEST_INTERVAL


def test_the_work_before_the_first_batch_spaces_the_second() -> None:
    wall, cpu = [0.0], [0.0]
    pacer = BatchPacer(share=0.05, clock=lambda: wall[0], cpu_clock=lambda: cpu[0])
    cpu[0] += 0.010  # sending: mounting the message and its reply, laying them out
    assert pacer.wait() == 0.0  # the first batch still goes out at once
    pacer.shown()
    # 10 ms / 5% = 0.2 s, not BATCH_INTERVAL: no second full layout right at the reply's start.
    assert abs(pacer.interval - 0.2) < 1e-9
