"""Forward-pass counts and times of a model, measured with torch forward hooks into a `ForwardTally`.

The hooks see every call of the model's top-level module, whoever makes it (fsd-chat's decoders
or transformers' `generate`), so every method is measured by the same clock. The first call of a
generation is its prompt prefill; it is counted but kept out of the per-forward time.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from fsd_chat.bench.records import ForwardTally


class ForwardMeter:
    """Times the forward passes of `model` between `start()` and `stop()` into a fresh tally
    (passes outside, such as quality scoring, are not counted).

    Args:
        model: The model whose top-level forward is timed.
        device: Its device; on CUDA the clock synchronises so that a pass is charged its kernels.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.tally: ForwardTally | None = None
        self._cuda = device.type == "cuda"
        self._device = device
        self._began = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _before(self, *_args: object) -> None:
        if self.tally is not None:
            self._began = self._now()

    def _after(self, *_args: object) -> None:
        tally = self.tally
        if tally is None:
            return
        elapsed = self._now() - self._began
        if tally.calls:
            tally.decode_calls += 1
            tally.decode_seconds += elapsed
        tally.calls += 1
        tally.seconds += elapsed

    def start(self) -> ForwardTally:
        """Begin a new generation's tally and return it."""
        self.tally = ForwardTally()
        return self.tally

    def stop(self) -> None:
        """Stop counting (until the next `start()`)."""
        self.tally = None

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
