"""Wall-clock timing of decoding phases that is honest on asynchronous devices."""

from __future__ import annotations

import time

import torch


class PhaseClock:
    """Measures seconds between marks.

    With `synchronize` (the default) it waits for the device first on CUDA, so that a phase is
    charged for its kernels and not for the ones queued before it: exact phase times for a
    benchmark, at the price of stalling the pipeline at every mark. Without it a mark takes no time
    on the device; the laps then add up to the right wall-clock time only at points where the host
    already waited (a decoding step's end), and kernel time shows in the lap where that wait falls.
    """

    def __init__(self, device: torch.device, *, synchronize: bool = True) -> None:
        self._cuda = device.type == "cuda" and synchronize
        self._device = device
        # Asked every step: a device's type is a new string each time it is read.
        self._exact = self._cuda or device.type != "cuda"
        self._last = self.now()

    @property
    def exact(self) -> bool:
        """Whether each lap is the seconds of its own phase: on the CPU (whose work is done when
        the call returns) or when marks synchronise; on CUDA without them, only sums up to a host
        wait are."""
        return self._exact

    def now(self) -> float:
        """Current time in seconds, after the device has finished its queued work."""
        if self._cuda:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or construction)."""
        now = self.now()
        elapsed, self._last = now - self._last, now
        return elapsed
