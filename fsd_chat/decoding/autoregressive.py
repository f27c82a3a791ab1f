"""Target-only autoregressive decoding: the baseline, yielding the same `Step` events.

One target forward pass per token over the KV cache (no re-encoding of the context).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, ClassVar

from fsd_chat.decoding import step_graph
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.events import Step
from fsd_chat.decoding.kv_cache import (
    COMPILED_CONTEXT,
    CachedModel,
    CompiledModel,
    bind,
    compiled_capacity,
    context_length,
)
from fsd_chat.decoding.memory import frees_memory, frees_memory_on_oom
from fsd_chat.decoding.reply import begin, eos_token_ids, read_ahead, target_step
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.settings import SamplingConfig, StepRule
from fsd_chat.decoding.tokenizer import Tokenizer

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel


class AutoregressiveDecoder:
    """Target-only decoding.

    Args:
        target: The target model: a transformers model, bound here to its KV cache
            (`kv_cache.bind`), or a `ModelRunner` of another engine (llama.cpp's).
        tokenizer: Its tokenizer.
        controls: Live controls: the stop request ends a reply; the settings are only recorded in
            each step's stats.
        vocab_size: Size of the vocabulary to sample from (default: len(tokenizer)).
        time_phases: Synchronise the device at each phase (see `SpeculativeDecoder`).
        reuse_prefix: Keep the KV cache between replies (see `SpeculativeDecoder`).
        compiled: Run the target's one-token forward passes compiled over a static KV cache
            (see `SpeculativeDecoder`; None, the default: on a CUDA device only).
        whole_step: Run each step as one function over static buffers
            (`fsd_chat.decoding.step_graph`): captured as a CUDA graph at construction on CUDA,
            eager elsewhere (see `SpeculativeDecoder`, also for `compiled` then, and for the step
            launched before the last one is read); transformers models only.
        capture_progress: See `SpeculativeDecoder`.
    """

    rule: ClassVar[StepRule] = "autoregressive"

    def __init__(
        self,
        target: PreTrainedModel | ModelRunner,
        tokenizer: Tokenizer,
        *,
        controls: Controls | None = None,
        vocab_size: int | None = None,
        time_phases: bool = False,
        reuse_prefix: bool = True,
        compiled: bool | None = None,
        whole_step: bool = False,
        capture_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.time_phases = time_phases
        self.reuse_prefix = reuse_prefix
        self.controls = controls or Controls()
        self.context = context_length(target)
        # A static cache is allocated whole: its capacity caps the context. Sized as a speculative
        # decoder's (`compiled_capacity`), so that the two share the target's compiled graph.
        capped = min(self.context or COMPILED_CONTEXT, COMPILED_CONTEXT)
        whole_step = whole_step and not isinstance(target, ModelRunner)
        cuda = target.device.type == "cuda"
        self.target = bind(
            target,
            vocab_size or len(tokenizer),
            compiled=compiled,
            # Eagerly the cache grows to what a reply needs (`EagerSteps.fit`).
            capacity=compiled_capacity(capped) if cuda or not whole_step else step_graph.MIN_CAPACITY,
            static=whole_step,
        )
        self._steps = (
            step_graph.make_steps(self.target, None, compile=compiled, progress=capture_progress)
            if whole_step and isinstance(self.target, CachedModel)
            else None
        )
        if isinstance(self.target, CompiledModel) or self._steps is not None:
            self.context = capped
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
                step_graph.prepare(self._steps, len(prompt_ids) + 1)
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
            buffer = step_graph.prepare(
                steps, step_graph.reply_tokens(len(prompt_ids), max_new_tokens, self.context, 0)
            )
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
            generator = step_graph.start(steps, reply, sampling, generator)
        # A whole step launched before the last one was read (`step_graph`, "One step in flight").
        ahead: step_graph.Launched | None = None
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
                go_ahead = step_graph.room_ahead(steps, reply, 0) is not None
                ahead = steps.target_only(sampling.greedy, generator) if go_ahead else None
                step = step_graph.whole_target_step(
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
