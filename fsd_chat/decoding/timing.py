"""Wall-clock timing of decoding phases that is honest on asynchronous devices."""

from __future__ import annotations

import time

import torch


class PhaseClock:
    """Measures seconds between marks; on CUDA it synchronises first, so that a phase is charged
    for its kernels and not for the ones queued before it."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._last = self.now()

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
