"""Coalescing decoding steps for the UI: one message per frame, not one per step.

Posting every step makes the UI thread wake, re-render and re-wrap at the decoder's pace, and the
two threads then contend for the interpreter; a frame rate's worth of batches shows the same text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from fsd_chat.decoding.events import Step

BATCH_INTERVAL = 1 / 30
"""Seconds between two batches at most (about 30 updates a second)."""


def batched(
    steps: Iterable[Step], interval: float = BATCH_INTERVAL, clock: Callable[[], float] = time.monotonic
) -> Iterator[tuple[Step, ...]]:
    """Group `steps` into batches: a batch is yielded once `interval` seconds have passed since
    the previous one (the first step goes out at once), and at the reply's last step or the end of
    `steps`. Nothing is dropped or reordered."""
    batch: list[Step] = []
    last = -interval
    for step in steps:
        batch.append(step)
        now = clock()
        if step.stop_reason is not None or now - last >= interval:
            yield tuple(batch)
            batch = []
            last = now
    if batch:
        yield tuple(batch)
