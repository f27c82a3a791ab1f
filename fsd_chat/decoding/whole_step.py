"""The whole step (`WholeStep`): what the decoders ask of an engine that runs each decoding step as
one function over static buffers, launched, then read once; and what they do with it alike
(`room_ahead`, `whole_target_step`, `reply_tokens`).

The transformers engine's steps (`fsd_chat.engines.torch_engine.step_graph`: eager on the CPU,
captured as CUDA graphs on CUDA) meet it; a decoder given none runs a forward pass at a time. A
speculative step's block is `acceptance.decide`'s (read by `acceptance.read_verdict`), a
target-only step's [check, token]. On CUDA a step may be launched before the last one is read
(`WholeStep.ahead`; the engine's module docstring, "One step in flight"): `room_ahead` says when.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from fsd_chat.decoding.events import Step
from fsd_chat.decoding.reply import Reply, commit_target
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.sampling import non_finite_error
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS, DecodingSettings, Rule, SamplingConfig, StepRule
from fsd_chat.decoding.timing import PhaseClock


class Launched(Protocol):
    """A launched step: its block on its way to the host."""

    def read(self) -> torch.Tensor:
        """The block, 1-D float64 on the host, once it has arrived (the one wait of a step)."""
        ...


class WholeStep(Protocol):
    """Each step as one function over static buffers, over a target and a draft model (or prompt
    lookup's copies) bound to static KV caches.

    Attributes:
        target: The target's runner.
        draft: The draft model's runner (None: prompt lookup, or target-only decoding).
        lengths: The draft lengths k it runs (None: any).
        ahead: Whether a decoder launches the next step before it reads this one (steps that
            queue on a device).
        compile_error: Why the step functions run uncompiled although compiling was asked for.
    """

    @property
    def target(self) -> ModelRunner: ...

    @property
    def draft(self) -> ModelRunner | None: ...

    @property
    def lengths(self) -> tuple[int, ...] | None: ...

    @property
    def ahead(self) -> bool: ...

    @property
    def compile_error(self) -> str | None: ...

    def prepare(self, tokens: int) -> torch.Tensor | None:
        """Before `reply.begin` (or a read-ahead) of a sequence of up to `tokens` tokens: the
        caches fitted to it; the buffer, shape [1, capacity] int64, the reply is to decode in
        (None: the reply has its own)."""
        ...

    def start(self, reply: Reply, sampling: SamplingConfig, generator: torch.Generator) -> torch.Generator:
        """A prefilled reply's first step is next: the buffers set for it; the generator of its
        draws."""
        ...

    def write(self, settings: DecodingSettings, rule: Rule, source: int) -> None:
        """The settings of the next speculative step, its rule, and with prompt lookup the index
        in the reply's buffer of the copy's source (tokens)."""
        ...

    def speculative(self, k: int, greedy: bool, generator: torch.Generator) -> Launched:
        """Launch a speculative step of draft length k: its block is `acceptance.decide`'s."""
        ...

    def target_only(self, greedy: bool, generator: torch.Generator) -> Launched:
        """Launch a target-only step: its block is [check, token] (check not finite: the
        target's logits were not)."""
        ...

    def clear(self) -> None:
        """Empty and zero the caches, after a step gave non-finite logits."""
        ...


def reply_tokens(prompt: int, max_new_tokens: int, context: int | None, headroom: int) -> int:
    """The most tokens a reply's buffer holds (as `reply.Reply` sizes it): the caches' need."""
    budget = max_new_tokens if context is None else min(max_new_tokens, context)
    return prompt + budget + headroom + 1


def room_ahead(steps: WholeStep, reply: Reply, k: int) -> int | None:
    """The room (`Reply.room`) of the step after a launched step of draft length k (0:
    target-only) that has not been read, whatever that step emits, when the next step may be
    launched now; None when it may not: the steps do not queue (`WholeStep.ahead`), or the reply
    may end at the launched step by its length (the token limit, the context window), or the room
    could cut the next step's k, which then might not be the k the policy gives once the launched
    step is read."""
    if not steps.ahead:
        return None
    room = reply.room() - (k + 1)
    longest = MAX_DRAFT_TOKENS if steps.lengths is None else max(steps.lengths, default=0)
    return room if room >= longest else None


def whole_target_step(
    steps: WholeStep,
    launched: Launched,
    reply: Reply,
    *,
    clock: PhaseClock,
    settings: DecodingSettings,
    rule: StepRule,
    greedy: bool,
    prefill_seconds: float,
) -> Step:
    """`reply.target_step` as one launched step function: one read of its block.

    Raises:
        NonFiniteError: the target's logits are not finite (the reply ends before this token).
    """
    check, token = launched.read().tolist()
    steps.target.seen = reply.length
    if not math.isfinite(check):
        steps.clear()
        raise non_finite_error("target")
    ids = [int(token)]
    reply.record(ids)
    return commit_target(
        reply,
        ids,
        clock=clock,
        settings=settings,
        rule=rule,
        greedy=greedy,
        prefill_seconds=prefill_seconds,
    )
