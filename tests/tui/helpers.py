"""Helpers for driving the real app: decoders that wrap the real one (e.g. waiting between steps),
and polling."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from textual.pilot import Pilot

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, Decoder, DecodingSettings, SamplingConfig, Step
from fsd_chat.models.loading import load_pair
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.app import FsdChatApp

SIZE = (110, 32)


class WrappedDecoder:
    """A `Decoder` that passes everything through to `inner`; subclasses change its steps (`wrap`)."""

    def __init__(self, inner: Decoder) -> None:
        self.inner = inner

    @property
    def context(self) -> int | None:
        return self.inner.context

    @property
    def compile_error(self) -> str | None:
        return self.inner.compile_error

    def generate(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop_strings: tuple[str, ...] = (),
    ) -> Iterator[Step]:
        return self.wrap(
            self.inner.generate(
                prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings
            )
        )

    def read_ahead(self, prompt_ids: list[int]) -> None:
        self.inner.read_ahead(prompt_ids)

    def wrap(self, steps: Iterator[Step]) -> Iterator[Step]:
        """The steps this decoder yields, given the inner decoder's (unchanged here)."""
        return steps


class GatedDecoder(WrappedDecoder):
    """The real speculative decoder, made to wait for `allow()` before each step.

    Every step the real decoder yields is recorded in `steps` (in the worker thread) so tests can
    compare what the UI shows with what the engine produced.
    """

    def __init__(self, inner: Decoder, *, fixed_clock: bool = False) -> None:
        super().__init__(inner)
        self.fixed_clock = fixed_clock
        self.steps: list[Step] = []
        self._permits = threading.Semaphore(0)

    def allow(self, steps: int = 1) -> None:
        """Let the decoder run `steps` more steps."""
        for _ in range(steps):
            self._permits.release()

    def wrap(self, steps: Iterator[Step]) -> Iterator[Step]:
        """The inner decoder's steps, one permit per step (10 s at most, so a broken test cannot hang)."""
        while self._permits.acquire(timeout=10):
            step = next(steps, None)
            if step is None:
                return
            if self.fixed_clock:  # deterministic timings, for snapshots
                step = replace(
                    step,
                    stats=replace(
                        step.stats,
                        draft_seconds=0.0005 * step.stats.drafted,
                        target_seconds=0.001,
                        other_seconds=0.0002,
                        prefill_seconds=0.0,
                    ),
                )
            self.steps.append(step)
            yield step


def make_app(
    pair: ModelPair,
    tmp_path: Path,
    *,
    gate: list[GatedDecoder] | None = None,
    fixed_clock: bool = False,
    **options: object,
) -> FsdChatApp:
    """The real app over the already loaded pair, saving into tmp_path; with `gate`, the decoder
    is a `GatedDecoder` (with `fixed_clock` if asked) appended to it."""

    def factory(p: ModelPair, controls: Controls) -> Decoder:
        decoder = p.speculative(controls)
        if gate is None:
            return decoder
        gated = GatedDecoder(decoder, fixed_clock=fixed_clock)
        gate.append(gated)
        return gated

    # The tests' figures assume these starting settings, whatever the product's defaults are.
    options.setdefault(
        "settings", DecodingSettings(rule="fuzzy", divergence="js", threshold=0.1, draft_tokens=4)
    )
    options.setdefault("store", SessionStore(tmp_path / "sessions.sqlite3"))
    chat_options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        transcripts_dir=tmp_path / "transcripts",
        **options,  # type: ignore[arg-type]
    )
    return FsdChatApp(chat_options, loader=lambda progress: pair, decoder_factory=factory)


async def wait_for(pilot: Pilot, condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Let the app run until `condition()` is true (fails the test after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {condition}")
        await pilot.pause(0.02)


async def wait_for_chat(pilot: Pilot) -> None:
    """Wait until the chat screen is up and mounted (the prompt has focus)."""
    from fsd_chat.tui.screens.chat import ChatScreen
    from fsd_chat.tui.widgets.prompt import PromptInput

    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and isinstance(app.focused, PromptInput))
    await pilot.pause()


@contextmanager
def tokens_read(model: Any) -> Iterator[list[int]]:
    """Within it, a list of the tokens each forward pass of `model` (a transformers model) reads."""
    fed: list[int] = []

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        fed.append(kwargs["input_ids"].shape[1])

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield fed
    finally:
        hook.remove()


def recording_loader(options: ChatOptions, seen: list[str]) -> Callable[..., ModelPair]:
    """The chat's loader of `options`' pair (the real `load_pair`), with every progress line it
    shows also appended to `seen`."""

    def loader(progress: Callable[[str], None]) -> ModelPair:
        def report(text: str) -> None:
            seen.append(text)
            progress(text)

        return load_pair(options.target, options.draft, options.load, report)

    return loader
