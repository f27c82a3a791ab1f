"""Forward-pass counts and times of a model, measured with torch forward hooks into a `ForwardTally`
(`ForwardMeter`), or, for a model of another engine (llama.cpp's `ModelRunner`), by wrapping its
`forward` and `prefill` (`RunnerMeter`).

The hooks see every call of the model's top-level module, whoever makes it (fsd-chat's decoders
or transformers' `generate`), so every method is measured by the same clock. The first call of a
generation is its prompt prefill; it is counted but kept out of the per-forward time.

On CUDA a pass is timed by CUDA events recorded around it, read once the generation is over: a
synchronisation after every pass would stall the host's launches behind the device's work, and so
slow down the very decoding it measures (transformers' assisted generation most of all, whose
draft steps otherwise run ahead of the device).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fsd_chat.bench.records import ForwardTally
from fsd_chat.decoding.runner import ModelRunner


class ForwardMeter:
    """Times the forward passes of `model` between `start()` and `stop()` into a fresh tally
    (passes outside, such as quality scoring, are not counted).

    Args:
        model: The model whose top-level forward is timed.
        device: Its device; on CUDA passes are timed by events (module docstring).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.tally: ForwardTally | None = None
        self._model = model
        self._cuda = device.type == "cuda"
        self._device = device
        self._began = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._handles = self._hook()

    def _hook(self) -> list[torch.utils.hooks.RemovableHandle]:
        return [
            self._model.register_forward_pre_hook(self._before),
            self._model.register_forward_hook(self._after),
        ]

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _before(self, *_args: object) -> None:
        if self.tally is None:
            return
        if self._cuda:
            self._events.append((self._event(), self._event()))  # the end is recorded again after
        else:
            self._began = time.perf_counter()

    def _after(self, *_args: object) -> None:
        tally = self.tally
        if tally is None:
            return
        if self._cuda:
            self._events[-1][1].record(torch.cuda.current_stream(self._device))
            tally.calls += 1
            return
        self._add(tally, time.perf_counter() - self._began)

    @staticmethod
    def _add(tally: ForwardTally, elapsed: float) -> None:
        if tally.calls:
            tally.decode_calls += 1
            tally.decode_seconds += elapsed
        tally.calls += 1
        tally.seconds += elapsed

    def start(self) -> ForwardTally:
        """Begin a new generation's tally and return it."""
        self.tally = ForwardTally()
        self._events = []
        return self.tally

    def stop(self) -> None:
        """Stop counting (until the next `start()`); on CUDA, read the passes' events into the tally."""
        tally, self.tally = self.tally, None
        if tally is None or not self._events:
            return
        torch.cuda.synchronize(self._device)
        tally.calls = 0
        for began, ended in self._events:
            self._add(tally, began.elapsed_time(ended) / 1000)
        self._events = []

    @contextmanager
    def detached(self) -> Iterator[None]:
        """Without the hooks for the duration (a call that compiles the model's `__call__`, as
        transformers' generate with a static cache does on CUDA, would trace them into its graph)."""
        self.close()
        try:
            yield
        finally:
            self._handles = self._hook()

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RunnerMeter:
    """`ForwardMeter` for a `ModelRunner` of another engine (llama.cpp's), whose passes run no torch
    module: its `forward` and `prefill` are wrapped (instance attributes over the class's methods)
    while the meter is attached, and timed on the host clock (llama.cpp returns when its logits are
    on the host)."""

    def __init__(self, model: ModelRunner) -> None:
        self.tally: ForwardTally | None = None
        self._model = model
        self._attach()

    def _attach(self) -> None:
        for name in ("forward", "prefill"):
            setattr(self._model, name, self._timed(getattr(type(self._model), name)))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        model = self._model

        def timed(*args: Any, **kwargs: Any) -> Any:
            tally = self.tally
            if tally is None:
                return method(model, *args, **kwargs)
            began = time.perf_counter()
            result = method(model, *args, **kwargs)
            ForwardMeter._add(tally, time.perf_counter() - began)
            return result

        return timed

    def start(self) -> ForwardTally:
        """Begin a new generation's tally and return it."""
        self.tally = ForwardTally()
        return self.tally

    def stop(self) -> None:
        """Stop counting (until the next `start()`)."""
        self.tally = None

    @contextmanager
    def detached(self) -> Iterator[None]:
        """Without the wrappers for the duration."""
        self.close()
        try:
            yield
        finally:
            self._attach()

    def close(self) -> None:
        """Remove the wrappers: the class's methods again."""
        for name in ("forward", "prefill"):
            self._model.__dict__.pop(name, None)
