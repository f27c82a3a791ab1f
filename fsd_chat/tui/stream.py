"""Handing decoding steps from the generation worker to the UI in batches, not one per step.

Posting every step makes the UI thread wake, re-render and re-wrap at the decoder's pace, and the
two threads then contend for the interpreter. Instead the worker adds steps to a `StepBuffer` and
wakes the UI only when the buffer was empty; the UI takes everything buffered at most
`BATCH_INTERVAL` after the previous batch. A step is never held longer than that interval, however
slow the next step is.
"""

from __future__ import annotations

import threading

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
