"""Handing decoding steps from the generation worker to the UI in batches, not one per step.

Posting every step makes the UI thread wake, re-render and re-wrap at the decoder's pace, and the
two threads then contend for the interpreter. Instead the worker adds steps to a `StepBuffer` and
wakes the UI only when the buffer was empty; the UI takes everything buffered when its
`BatchPacer` allows: about 30 times a second at most, less when drawing the screen is slow. A
step is never held longer than that interval, however slow the next step is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fsd_chat.decoding.events import Step

BATCH_INTERVAL = 1 / 30
"""Seconds between two batches at least (about 30 updates a second at most)."""


class StepBuffer:
    """Steps decoded and not yet shown: the worker thread adds, the UI thread takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: list[Step] = []

    def add(self, step: Step) -> bool:
        """Buffer `step`; returns True when the buffer was empty (the UI must be woken)."""
        with self._lock:
            self._steps.append(step)
            return len(self._steps) == 1

    def take(self) -> tuple[Step, ...]:
        """Everything buffered, in order; the buffer is empty afterwards."""
        with self._lock:
            steps, self._steps = tuple(self._steps), []
        return steps


UI_SHARE = 0.03
"""Share of the wall clock the UI thread may spend on a streaming reply. Its Python work holds the
interpreter lock that the decoding thread needs between forward passes, so every millisecond the
UI spends is taken from decoding (small models, whose steps are mostly Python, feel it most)."""
LONGEST_INTERVAL = 0.5
"""Seconds between two batches at most, however slow the screen is to draw."""


class BatchPacer:
    """When the UI may show the next batch: `BATCH_INTERVAL` after the last one, stretched so that
    the UI thread's CPU time since then (rendering included; since the pacer was made, for the
    first) stays within `UI_SHARE` of the wall clock. Make it when the reply starts, and call it
    from the UI thread only (it reads that thread's CPU clock)."""

    def __init__(
        self,
        *,
        share: float = UI_SHARE,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.share = share
        self.interval = BATCH_INTERVAL
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._last: float | None = None
        # From the start, not from the first batch: the UI's work before it (mounting the message
        # and its reply, laying them out) spaces the second batch too, instead of a second full
        # layout 1/30 s into the reply.
        self._last_cpu = cpu_clock()

    def wait(self) -> float:
        """Seconds until the next batch may be shown (0 when it may be shown now)."""
        return 0.0 if self._last is None else max(0.0, self._last + self.interval - self._clock())

    def shown(self) -> None:
        """A batch is being shown now: the interval to the next one follows the UI's recent drawing time."""
        now, cpu = self._clock(), self._cpu_clock()
        spent = cpu - self._last_cpu
        self.interval = min(LONGEST_INTERVAL, max(BATCH_INTERVAL, spent / self.share))
        self._last, self._last_cpu = now, cpu
