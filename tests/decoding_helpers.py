"""Small helpers for decoding tests: run a decoder to the end and collect what it emitted; count the
tokens a model is fed per forward pass."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache, partial
from typing import TYPE_CHECKING

import torch

from fsd_chat.decoding import Controls, GenerationStats, Step
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.speculative import SpeculativeDecoder
from fsd_chat.engines.torch_engine.binding import speculative_decoder
from fsd_chat.engines.torch_engine.kv_cache import CachedModel
from fsd_chat.engines.torch_engine.timings import modelled_timings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from fsd_chat.models.pair import ModelPair

# How far a float32 recomputation of a log-probability may stray. log p(x) = logit(x) − log Σ exp(logits)
# sums the V = 512 terms of the vocabulary, and recursive float32 summation of n terms is off by at
# most (n − 1)·u of the sum (u = 2⁻²⁴; Higham, "Accuracy and Stability of Numerical Algorithms",
# §4.2), which the log turns into at most (n − 1)·u nats: 3.0e-5. A regret log p(a) − log p(x) or a
# KL term is a difference of two such logs, so twice that. The decoder's batched verification and a
# teacher-forced pass sum in different orders (and in other orders again on other thread counts),
# so a recomputation carries this error on any machine; an absolute 1e-5 held only on one.
VOCAB_SIZE = 512
LOG_PROB_ROUNDING = (VOCAB_SIZE - 1) * 2.0**-24
DIFFERENCE_ROUNDING = 2 * LOG_PROB_ROUNDING


@dataclass
class Collected:
    """Everything one generation emitted."""

    steps: list[Step] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [t.id for s in self.steps for t in s.tokens]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    @property
    def origins(self) -> list[str]:
        return [str(t.origin) for s in self.steps for t in s.tokens]


def collect(steps: Iterable[Step], prompt_ids: list[int] | None = None) -> Collected:
    """Consume a decoder's steps (of a reply to `prompt_ids`, kept for recomputations)."""
    run = Collected(prompt_ids=list(prompt_ids or []))
    for step in steps:
        run.steps.append(step)
        run.stats.add(step)
    return run


def count_fed(model: CachedModel) -> list[int]:
    """Count the tokens fed to `model` per forward pass (wrappers around the real forward, and
    prefill where it does not go through forward)."""
    fed: list[int] = []
    forward = model.forward

    def counting(seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        fed.append(upto - model.seen)
        return forward(seq, upto, keep)

    model.forward = counting  # type: ignore[method-assign]
    if type(model).prefill is not CachedModel.prefill:  # a prefill of its own, not through forward
        prefill = model.prefill

        def counting_prefill(seq: torch.Tensor, upto: int) -> None:
            fed.append(upto - model.seen)
            prefill(seq, upto)

        model.prefill = counting_prefill  # type: ignore[method-assign]
    return fed


def modelled(target: PreTrainedModel, draft: PreTrainedModel | None = None) -> Callable[[], ForwardTimings]:
    """A decoder's `timings` for a transformers `target` and `draft` (None: prompt lookup, whose
    draft positions take no time), modelled once (`modelled_timings`)."""
    return cache(partial(modelled_timings, target, draft))


def lookup_decoder(pair: ModelPair, controls: Controls) -> SpeculativeDecoder:
    """Prompt lookup over a transformers pair's target (its draft model left out), priced as
    prompt lookup (`modelled` without a draft)."""
    return speculative_decoder(
        pair.target, PromptLookup(), pair.tokenizer, controls=controls, timings=modelled(pair.target)
    )
