"""Where draft tokens come from: a `Proposer` gives each speculative step up to k proposed tokens
and the law q each was drawn from; the acceptance rules (`fsd_chat.decoding.acceptance`) need
nothing else of it.

- `ModelDraft`: a draft model sharing the target's vocabulary; q_i is its next-token distribution
  (rows over the target's vocabulary), x̃_i ~ q_i.
- `fsd_chat.decoding.lookup.PromptLookup`: no model; the continuation of an earlier occurrence of
  the context's last n-gram, a deterministic proposal whose law is a point mass q_i = δ(x̃_i),
  represented by `Proposal.q = None` (the rules then use closed forms in p(x̃) alone).

A proposer writes its tokens into the reply's buffer at seq[length : length + k]; the decoder runs
the target over them, accepts a prefix, and calls `rollback` with the accepted length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from fsd_chat.decoding.draft_policy import DraftPolicy, Next
from fsd_chat.decoding.reply import Reply
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.sampling import draw, probabilities
from fsd_chat.decoding.settings import SamplingConfig

DraftKind = Literal["model", "mapped", "lookup"]
"""What proposes: a draft model sharing the target's tokenizer, a draft model with another
tokenizer (`fsd_chat.decoding.mapped_draft`), or prompt lookup (no model)."""


@dataclass(frozen=True, slots=True)
class Proposal:
    """One step's proposed tokens, already written at seq[0, length : length + drafted].

    Attributes:
        drafted: k, the number of proposed tokens (0: nothing to propose; the step is a plain
            target step).
        q: The proposal law of each token, shape [k, vocab] float32 on the reply's device; None
            when every token is a point mass, q_i = δ(x̃_i) (a deterministic proposal).
        q_full: Under truncated sampling, the draft's untruncated laws (temperature only), shape
            [k, vocab], which the divergences compare (see `acceptance`); None otherwise, and for
            point masses (truncation leaves a point mass unchanged).
        forwards: Draft forward passes spent (0 without a draft model).
        lookup: Proposed by prompt lookup (a lookup hit, counted in the step's stats).
    """

    drafted: int
    q: torch.Tensor | None
    forwards: int
    lookup: bool = False
    q_full: torch.Tensor | None = None


class Proposer(Protocol):
    """A source of draft tokens for `SpeculativeDecoder` (see the module docstring)."""

    kind: DraftKind

    @property
    def cached_models(self) -> tuple[ModelRunner, ...]:
        """The models that read the target's ids, whose KV caches `reply.begin` prefills."""
        ...

    @property
    def owned_models(self) -> tuple[ModelRunner, ...]:
        """Every model whose KV cache this proposer holds (freed on out-of-memory)."""
        ...

    @property
    def compile_error(self) -> str | None:
        """Why compiled draft forward passes fell back to eager ones (None: they did not, or none)."""
        ...

    def prefill(self, reply: Reply, reuse_prefix: bool, defer: bool) -> None:
        """Start a reply whose prompt is seq[0, : length] (the last prompt token is fed by the
        first step), after `reply.begin` has prefilled the `cached_models`; `reuse_prefix` as
        there (a cache of another model keeps what it shares with the last reply); `defer`: the
        draft policy is paused, so a model of its own is not fed the prompt now (its first
        forward, on a probe, reads it)."""
        ...

    def propose(
        self,
        reply: Reply,
        limit: int,
        policy: DraftPolicy,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Proposal:
        """Write up to `limit` (≥ 1) proposed tokens at reply.seq[0, length:] and say what they are.

        `policy.extend` is asked after each drafted position by proposers that draw position by
        position (a draft model); a deterministic proposal is cut at `limit` alone.
        """
        ...

    def rollback(self, length: int) -> None:
        """The reply now holds its first `length` tokens plus one emitted token not yet fed."""
        ...


Laws = Callable[[int, SamplingConfig | None], tuple[torch.Tensor, torch.Tensor | None]]
"""A draft's next-position laws over the target's vocabulary, given the tokens drafted so far this
step (already at seq[0, length : length + drafted]): q under the sampling settings, [vocab], and,
when asked for, the untruncated law (None otherwise), from one forward pass."""


def draw_positions(
    reply: Reply,
    limit: int,
    laws: Laws,
    policy: DraftPolicy,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> Proposal:
    """Draft up to `limit` positions one by one: x̃_i ~ q_i written at seq[0, length + i], the
    policy deciding after each law whether to keep drafting (`DraftPolicy.extend`).

    Under truncated sampling each position's untruncated law is kept too (`Proposal.q_full`).
    """
    seq, start = reply.seq, reply.length
    untruncated = sampling.untruncated() if sampling.truncates else None
    q_rows: list[torch.Tensor] = []
    q_full_rows: list[torch.Tensor] = []
    forwards = 0
    for _ in range(limit):
        forwards += 1
        q, q_full = laws(len(q_rows), untruncated)
        # The policy sees q before the draw: a kept position's token is still a draw from q.
        then = policy.extend(q)
        if then is Next.DROP:
            break
        seq[0, start + len(q_rows)].copy_(draw(q, sampling, generator))
        q_rows.append(q)
        if q_full is not None:
            q_full_rows.append(q_full)
        if then is Next.STOP:
            break
    return Proposal(
        drafted=len(q_rows),
        q=torch.stack(q_rows) if q_rows else None,
        forwards=forwards,
        q_full=torch.stack(q_full_rows) if q_full_rows else None,
    )


class ModelDraft:
    """Proposals of a draft model that shares the target's vocabulary.

    Args:
        model: The draft, bound to its KV cache (a `ModelRunner`: `CachedModel`, `CompiledModel`, llama.cpp's).
    """

    kind: DraftKind = "model"

    def __init__(self, model: ModelRunner) -> None:
        self.model = model

    @property
    def cached_models(self) -> tuple[ModelRunner, ...]:
        """The draft model."""
        return (self.model,)

    @property
    def owned_models(self) -> tuple[ModelRunner, ...]:
        """The draft model."""
        return (self.model,)

    @property
    def compile_error(self) -> str | None:
        """See `Proposer.compile_error`."""
        return self.model.compile_error

    def prefill(self, reply: Reply, reuse_prefix: bool, defer: bool) -> None:
        """Nothing more: `reply.begin` prefills the draft's cache (a `cached_models` entry) as the
        target's, keeping the prefix it shares with the last reply, or defers it."""

    def propose(
        self,
        reply: Reply,
        limit: int,
        policy: DraftPolicy,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Proposal:
        """Up to `limit` draft forward passes, x̃_i ~ q_i, the policy deciding after each."""
        start = reply.length

        def laws(
            drafted: int, untruncated: SamplingConfig | None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            logits = self.model.forward(reply.seq, start + drafted, keep=1)[-1]
            full = None if untruncated is None else probabilities(logits, untruncated)
            return probabilities(logits, sampling), full

        return draw_positions(reply, limit, laws, policy, sampling, generator)

    def rollback(self, length: int) -> None:
        """Crop the draft's cache to `length` tokens."""
        self.model.rollback(length)
