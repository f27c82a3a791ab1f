"""Target-only autoregressive decoding: the baseline, yielding the same `Step` events.

One target forward pass per token over the KV cache (no re-encoding of the context).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.events import Step
from fsd_chat.decoding.memory import frees_memory, frees_memory_on_oom
from fsd_chat.decoding.reply import begin, eos_token_ids, read_ahead, target_step
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.settings import SamplingConfig, StepRule
from fsd_chat.decoding.tokenizer import Tokenizer
from fsd_chat.decoding.whole_step import Launched, WholeStep, reply_tokens, room_ahead, whole_target_step


class AutoregressiveDecoder:
    """Target-only decoding.

    Args:
        target: The target model's runner, bound to its KV cache by its engine (the transformers
            engine's `fsd_chat.engines.torch_engine.binding.autoregressive_decoder` binds it and
            builds this decoder).
        tokenizer: Its tokenizer.
        controls: Live controls: the stop request ends a reply; the settings are only recorded in
            each step's stats.
        time_phases: Synchronise the device at each phase (see `SpeculativeDecoder`).
        reuse_prefix: Keep the KV cache between replies (see `SpeculativeDecoder`).
        context_cap: The most tokens of context the target's static KV cache holds (None: the
            target's own context bounds it alone).
        steps: Run each step as one function over static buffers (a `WholeStep`, the transformers
            engine's `fsd_chat.engines.torch_engine.step_graph`; None: a forward pass a step):
            captured as a CUDA graph on CUDA, eager elsewhere (see `SpeculativeDecoder`, also for
            the step launched before the last one is read).
    """

    rule: ClassVar[StepRule] = "autoregressive"

    def __init__(
        self,
        target: ModelRunner,
        tokenizer: Tokenizer,
        *,
        controls: Controls | None = None,
        time_phases: bool = False,
        reuse_prefix: bool = True,
        context_cap: int | None = None,
        steps: WholeStep | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.time_phases = time_phases
        self.reuse_prefix = reuse_prefix
        self.controls = controls or Controls()
        self.context = target.context
        if context_cap is not None:  # a static cache is allocated whole: its capacity caps the context
            self.context = min(self.context or context_cap, context_cap)
        self.target = target
        self._steps = steps
        self.eos_token_ids = eos_token_ids(tokenizer, target)

    @property
    def cached_models(self) -> tuple[ModelRunner, ...]:
        """The models whose KV caches this decoder fills (`begin` prefills them)."""
        return (self.target,)

    @property
    def owned_models(self) -> tuple[ModelRunner, ...]:
        """Every model whose KV cache this decoder holds (freed on out-of-memory): the target."""
        return self.cached_models

    @property
    def compile_error(self) -> str | None:
        """See `Decoder.compile_error`: the target's."""
        return self.target.compile_error

    def read_ahead(self, prompt_ids: list[int]) -> None:
        """See `Decoder.read_ahead`."""
        if self.reuse_prefix:
            if self._steps is not None:
                self._steps.prepare(len(prompt_ids) + 1)
            with frees_memory(self, "reading the conversation ahead"):
                read_ahead([self.target], prompt_ids, self.controls, self.context)

    @frees_memory_on_oom
    def generate(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop_strings: tuple[str, ...] = (),
    ) -> Iterator[Step]:
        """Yield one `Step` per generated token; the last has `stop_reason` set.

        Raises:
            ContextLengthError: the prompt does not fit the context window.
            SettingsError: max_new_tokens < 1 or an empty prompt.
            DeviceMemoryError: the device ran out of memory (the KV cache is freed).
        """
        sampling = sampling or SamplingConfig()
        steps = self._steps
        buffer = None
        if steps is not None:
            buffer = steps.prepare(reply_tokens(len(prompt_ids), max_new_tokens, self.context, 0))
        start = begin(
            [self.target],
            prompt_ids,
            tokenizer=self.tokenizer,
            controls=self.controls,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            context=self.context,
            headroom=0,
            eos_token_ids=self.eos_token_ids,
            stop_strings=stop_strings,
            time_phases=self.time_phases,
            reuse_prefix=self.reuse_prefix,
            buffer=buffer,
        )
        prefill_seconds = start.prefill_seconds
        reply, generator, clock = start.reply, start.generator, start.clock
        if steps is not None:
            generator = steps.start(reply, sampling, generator)
        # A whole step launched before the last one was read (`WholeStep.ahead`).
        ahead: Launched | None = None
        while True:
            settings = self.controls.snapshot()
            if steps is None or reply.unread:
                step = target_step(
                    self.target,
                    reply,
                    sampling=sampling,
                    generator=generator,
                    clock=clock,
                    settings=settings,
                    rule=self.rule,
                    prefill_seconds=prefill_seconds,
                )
            else:
                launched = steps.target_only(sampling.greedy, generator) if ahead is None else ahead
                go_ahead = room_ahead(steps, reply, 0) is not None
                ahead = steps.target_only(sampling.greedy, generator) if go_ahead else None
                step = whole_target_step(
                    steps,
                    launched,
                    reply,
                    clock=clock,
                    settings=settings,
                    rule=self.rule,
                    greedy=sampling.greedy,
                    prefill_seconds=prefill_seconds,
                )
            prefill_seconds = 0.0
            yield step
            if step.stop_reason is not None:
                return
