"""The decoders over transformers models (`speculative_decoder`, `autoregressive_decoder`): the
models bound to their KV caches (`bind_pair`: the runners, `CachedModel` or its static and compiled
kinds, the cap a static cache puts on the context, and the whole step over them, `step_graph`),
which the decoders take as they are.

Which kind a model gets: a `StaticModel` for the whole step (`--whole-step`: each step one function
over static buffers, captured as CUDA graphs on CUDA), a `CompiledModel` when compiling is asked
for (`--compile`; by default on CUDA only) and admitted (`compile_refusal`, `compiler_refusal`),
else a `CachedModel` over transformers' `DynamicCache` (see `kv_cache.bind`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fsd_chat.decoding.autoregressive import AutoregressiveDecoder
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.proposal import Proposer
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.speculative import SpeculativeDecoder
from fsd_chat.decoding.tokenizer import Tokenizer
from fsd_chat.decoding.vocab_map import VocabularyMap
from fsd_chat.engines.torch_engine import step_graph
from fsd_chat.engines.torch_engine.kv_cache import (
    COMPILED_CONTEXT,
    DRAFT_WIDTHS,
    CachedModel,
    CompiledModel,
    StaticModel,
    bind,
    compiled_capacity,
    context_length,
)

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel


@dataclass(frozen=True, slots=True)
class BoundPair:
    """A target and its draft model bound for one decoder.

    Attributes:
        target: The target's runner.
        draft: The draft model's runner (None: prompt lookup, or target-only decoding).
        context_cap: The most tokens of context the static caches hold (COMPILED_CONTEXT), when a
            model runs over one (None: no cap beyond the models' own contexts).
        draft_context: A mapped draft's context in its own tokens (None: its runner's `context`):
            a compiled draft's static cache holds `compiled_capacity` tokens.
        steps: The whole step over static buffers (None: per-forward steps).
        compiled_rule: Compile the acceptance rule too (`CompiledDecision`): the target is
            compiled.
    """

    target: ModelRunner
    draft: ModelRunner | None
    context_cap: int | None
    draft_context: int | None
    steps: step_graph.EagerSteps | None
    compiled_rule: bool


def bind_pair(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    *,
    vocab_size: int,
    draft_vocab: int | None = None,
    mapped: bool = False,
    lookup: bool = False,
    target_only: bool = False,
    compiled: bool | None = None,
    whole_step: bool = False,
    capture_progress: Callable[[int, int], None] | None = None,
) -> BoundPair:
    """Bind `target` and `draft` to their KV caches for a speculative decoder, or `target` alone
    for a target-only one (`target_only`).

    Args:
        target: The target model.
        draft: The draft model (None: prompt lookup, or target-only decoding).
        vocab_size: The target's vocabulary size in tokens (logits beyond it are dropped).
        draft_vocab: The draft's (default: `vocab_size`, one shared vocabulary).
        mapped: The draft has a tokenizer of its own (`MappedProposer`): it counts its context in
            its own tokens, and runs no whole step.
        lookup: Prompt lookup proposes (the whole step verifies its copies).
        target_only: For an `AutoregressiveDecoder`.
        compiled: Compile the models' short forward passes over static caches (`CompiledModel`):
            True, False, or None for on a CUDA device only; with `whole_step`, compile the step
            functions (`step_graph.make_steps`).
        whole_step: Run each step as one function over static buffers (`step_graph`), for a draft
            model of the target's vocabulary, prompt lookup or target-only decoding.
        capture_progress: Called with (graphs captured, graphs in all) while the whole step's
            graphs are captured (CUDA).

    Raises:
        UnsupportedCacheError: a model's cache cannot be rolled back (`CachedModel`).
    """
    # Models that read the target's ids: a mapped draft counts its context in its own tokens.
    shared = [m for m in (target, draft) if m is not None and (m is target or not mapped)]
    contexts = [c for c in map(context_length, shared) if c is not None]
    # A static cache is allocated whole: its capacity caps the context. Sized alike for every
    # decoder of a model (`compiled_capacity`), so that they share its compiled graphs.
    capped = min(min(contexts, default=COMPILED_CONTEXT), COMPILED_CONTEXT)
    capacity = compiled_capacity(capped)
    whole_step = whole_step and not mapped and (target_only or draft is not None or lookup)
    # Eagerly a static cache grows to what a reply needs (`EagerSteps.fit`).
    cuda = target.device.type == "cuda"
    if whole_step and not cuda:
        capacity = step_graph.MIN_CAPACITY
    target_runner = bind(target, vocab_size, compiled=compiled, capacity=capacity, static=whole_step)
    draft_runner = None
    if draft is not None:
        draft_runner = bind(
            draft,
            vocab_size if draft_vocab is None else draft_vocab,
            compiled=compiled,
            capacity=capacity,
            widths=DRAFT_WIDTHS,
            static=whole_step,
        )
    steps = None
    if whole_step:
        assert isinstance(target_runner, CachedModel)  # bound from a transformers model
        assert draft_runner is None or isinstance(draft_runner, CachedModel)
        steps = step_graph.make_steps(
            target_runner, draft_runner, compile=compiled, lookup=lookup, progress=capture_progress
        )
    runners = [r for r in (target_runner, draft_runner) if r is not None]
    static = any(isinstance(r, StaticModel) for r in runners)
    return BoundPair(
        target=target_runner,
        draft=draft_runner,
        context_cap=COMPILED_CONTEXT if static else None,
        draft_context=capacity if mapped and isinstance(draft_runner, CompiledModel) else None,
        steps=steps,
        compiled_rule=isinstance(target_runner, CompiledModel),
    )


def speculative_decoder(
    target: PreTrainedModel,
    draft: PreTrainedModel | Proposer,
    tokenizer: Tokenizer,
    *,
    timings: Callable[[], ForwardTimings],
    controls: Controls | None = None,
    vocab_size: int | None = None,
    vocab_map: VocabularyMap | None = None,
    time_phases: bool = False,
    reuse_prefix: bool = True,
    compiled: bool | None = None,
    whole_step: bool = False,
    capture_progress: Callable[[int, int], None] | None = None,
) -> SpeculativeDecoder:
    """A `SpeculativeDecoder` over transformers models, bound to their KV caches (`bind_pair`).

    Args:
        target, tokenizer, timings, controls, vocab_map, time_phases, reuse_prefix: See
            `SpeculativeDecoder`.
        draft: The draft model, or any `Proposer` (e.g. `PromptLookup`).
        vocab_size: Shared vocabulary size; logits beyond it are dropped (default: len(tokenizer)).
        compiled: Run both models' steps compiled over static KV caches (`CompiledModel`: the
            target's verify and target-only passes, the draft's passes) and the acceptance rule
            (`CompiledDecision`), with CUDA graphs on CUDA: True, False, or None (the default) for
            on a CUDA device only. The context is then capped at COMPILED_CONTEXT tokens. A model
            that cannot be compiled (`compile_refusal`) runs eagerly, and the decoder's
            `compile_error` says why. With `whole_step`: compile the step functions (inductor, each
            decoder layer one region: `step_graph.make_steps`), before they are captured on CUDA
            (None: on CUDA only; False: never; True: on the CPU too), its artifacts kept in the
            user's cache.
        whole_step: Run each step as one function over static buffers (`step_graph`; see
            `SpeculativeDecoder`'s `steps`), for a draft model of the target's vocabulary or
            prompt lookup (other proposers keep their usual steps).
        capture_progress: Called with (graphs captured, graphs in all) while the whole step's
            graphs are captured (on CUDA, at construction; the loading screen shows it).

    Raises:
        UnsupportedCacheError: a model's cache cannot be rolled back.
    """
    vocab_size = vocab_size or len(tokenizer)
    # A transformers model is a torch module (checked so, without importing the modeling stack).
    model = draft if isinstance(draft, torch.nn.Module) else None
    bound = bind_pair(
        target,
        model,
        vocab_size=vocab_size,
        draft_vocab=None if vocab_map is None else vocab_map.draft_vocab,
        mapped=vocab_map is not None,
        lookup=isinstance(draft, PromptLookup),
        compiled=compiled,
        whole_step=whole_step,
        capture_progress=capture_progress,
    )
    proposer: ModelRunner | Proposer
    if bound.draft is None:
        assert not isinstance(draft, torch.nn.Module)  # narrowed for mypy: a model was bound
        proposer = draft
    else:
        proposer = bound.draft
    return SpeculativeDecoder(
        bound.target,
        proposer,
        tokenizer,
        timings=timings,
        controls=controls,
        time_phases=time_phases,
        reuse_prefix=reuse_prefix,
        vocab_map=vocab_map,
        context_cap=bound.context_cap,
        draft_context=bound.draft_context,
        steps=bound.steps,
        compiled_rule=bound.compiled_rule,
    )


def autoregressive_decoder(
    target: PreTrainedModel,
    tokenizer: Tokenizer,
    *,
    controls: Controls | None = None,
    vocab_size: int | None = None,
    time_phases: bool = False,
    reuse_prefix: bool = True,
    compiled: bool | None = None,
    whole_step: bool = False,
    capture_progress: Callable[[int, int], None] | None = None,
) -> AutoregressiveDecoder:
    """An `AutoregressiveDecoder` over a transformers model, bound to its KV cache (`bind_pair`).

    Args:
        target, tokenizer, controls, time_phases, reuse_prefix: See `AutoregressiveDecoder`.
        vocab_size: Size of the vocabulary to sample from (default: len(tokenizer)).
        compiled: Run the target's one-token forward passes compiled over a static KV cache, or
            with `whole_step` its step function (see `speculative_decoder`; None, the default:
            on a CUDA device only).
        whole_step, capture_progress: See `speculative_decoder`.

    Raises:
        UnsupportedCacheError: the model's cache cannot be rolled back.
    """
    bound = bind_pair(
        target,
        None,
        vocab_size=vocab_size or len(tokenizer),
        target_only=True,
        compiled=compiled,
        whole_step=whole_step,
        capture_progress=capture_progress,
    )
    return AutoregressiveDecoder(
        bound.target,
        tokenizer,
        controls=controls,
        time_phases=time_phases,
        reuse_prefix=reuse_prefix,
        context_cap=bound.context_cap,
        steps=bound.steps,
    )
