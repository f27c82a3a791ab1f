"""A draft model with its own tokenizer, proposing over the target's vocabulary (token-level
intersection; see `fsd_chat.decoding.vocab_map`).

The draft reads the target's text in its own tokens: its sequence is the draft-side spelling of
every target token emitted so far (`VocabularyMap.translate`, a cached look-up per token), built
once for the prompt and then extended by each step's emitted tokens only, never re-tokenised
whole. Its KV cache follows that sequence and is rolled back to the accepted prefix as the
target's is; between replies it keeps what the new prompt's spelling shares with the last one.

Its proposal law at each position is its next-token distribution with every unpaired token masked
out before temperature / top-k / top-p (so the draw and its law agree), moved to the target's ids:
q(t) = q_draft(partner(t)) for a paired target token t and 0 for the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsd_chat.decoding.draft_policy import DraftPolicy
from fsd_chat.decoding.proposal import DraftKind, Proposal, draw_positions
from fsd_chat.decoding.reply import Reply
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS, SamplingConfig
from fsd_chat.decoding.vocab_map import VocabularyMap


class MappedDraft:
    """The draft side of speculative decoding across two vocabularies.

    Args:
        draft: The draft model and its KV cache (logits over the draft's vocabulary).
        mapping: The correspondence of the two vocabularies.
        context: The draft's context window in draft tokens (None: not known).
    """

    def __init__(self, draft: ModelRunner, mapping: VocabularyMap, context: int | None) -> None:
        self.model = draft
        self.mapping = mapping
        self.context = context
        device = draft.device
        # Unpaired draft tokens get no mass; target ids gather their partner's probability, or the
        # zero appended after the draft's vocabulary.
        self._unpaired = torch.ones(mapping.draft_vocab, dtype=torch.bool, device=device)
        self._unpaired[mapping.draft_ids.to(device)] = False
        self._gather = torch.full(
            (mapping.target_vocab,), mapping.draft_vocab, dtype=torch.long, device=device
        )
        self._gather[mapping.target_ids.to(device)] = mapping.draft_ids.to(device)
        self._to_draft = torch.zeros(mapping.target_vocab, dtype=torch.long, device=device)
        self._to_draft[mapping.target_ids.to(device)] = mapping.draft_ids.to(device)
        self._seq = torch.empty((1, 0), dtype=torch.long, device=device)
        # Each step's spelling reaches the device through this host buffer, pinned on CUDA so that
        # the copy is asynchronous: a tensor built from a Python list would be copied with a wait.
        # The copy has run before the buffer is written again: the next step's verdict read waits
        # for everything queued before it.
        self._staging = torch.empty(0, dtype=torch.long)
        self._staged = self._staging.numpy()  # the same memory, written from Python
        self.length = 0
        """Draft tokens that spell the reply's emitted text (prompt included)."""

    def begin(self, prompt_ids: list[int], reuse_prefix: bool, defer: bool = False) -> None:
        """Start a reply: spell the prompt in draft tokens and prefill the draft's cache with all
        but the last of them.

        Args:
            prompt_ids: The prompt in target ids.
            reuse_prefix: Keep the cached draft tokens the new spelling begins with
                (`ModelRunner.keep_prefix`) and prefill only the rest; else start from an empty
                cache.
            defer: Spell only: the draft's first forward (`distribution`) reads what its cache lacks.
        """
        spelling = self.mapping.translate(prompt_ids)
        # A new buffer: keep_prefix compares the new spelling with the buffer the cache was fed.
        self._seq = self._allocate(len(spelling))
        self._seq[0, : len(spelling)] = torch.tensor(spelling, dtype=torch.long)
        self.length = len(spelling)
        if reuse_prefix:
            # A prompt may spell as nothing (a lone BOS the draft lacks): compare no tokens then.
            self.model.keep_prefix(self._seq, max(self.length - 1, 0))
        else:
            self.model.reset()
        if not defer and self.model.seen < self.length - 1 and self.length < self._limit():
            self.model.prefill(self._seq, self.length - 1)

    def spelled(self) -> list[int]:
        """The draft's ids that spell the reply so far (prompt included)."""
        return [int(i) for i in self._seq[0, : self.length].tolist()]

    def room(self) -> int:
        """Most tokens the draft may propose before its context window is full."""
        return max(self._limit() - 1 - self.length, 0)

    def _limit(self) -> int:
        return self.context if self.context is not None else self._seq.shape[1]

    def distribution(
        self,
        seq: torch.Tensor,
        start: int,
        drafted: int,
        sampling: SamplingConfig,
        untruncated: SamplingConfig | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The proposal law of the next draft position, over the target's vocabulary.

        Args:
            seq: The reply's target-id buffer, shape [1, capacity] int64; the tokens drafted so
                far this step sit at seq[0, start:start + drafted].
            start: The reply's length (in target tokens) when the step began.
            drafted: Tokens drafted so far this step.
            sampling: Temperature / top-k / top-p, applied to the draft's masked logits.
            untruncated: Also the law under these settings (temperature only), from the same
                forward pass: the divergences compare untruncated laws (see `acceptance`).

        Returns:
            q over the target's ids, shape [target_vocab] float32, on the draft's device; and the
            untruncated law likewise (None without `untruncated`).
        """
        if drafted:
            # index_select with a 1-element slice: indexing with a 0-dim tensor reads it on the host.
            drafted_id = seq[0, start + drafted - 1 : start + drafted]
            self._seq[0, self.length + drafted - 1 : self.length + drafted].copy_(
                self._to_draft.index_select(0, drafted_id)
            )
        logits = self.model.forward(self._seq, self.length + drafted, keep=1)[-1]
        masked = logits.masked_fill(self._unpaired, float("-inf"))
        q = F.pad(probabilities(masked, sampling), (0, 1))[self._gather]
        if untruncated is None:
            return q, None
        return q, F.pad(probabilities(masked, untruncated), (0, 1))[self._gather]

    def settle(self, emitted: list[int], accepted: int) -> None:
        """Follow a step: keep the `accepted` draft tokens it accepted and spell the rest of the
        tokens it emitted (the target's correction, bonus or own token), in target ids."""
        self.model.rollback(self.length + accepted)
        # The accepted tokens are paired ones: spelled again they are the draft ids already there.
        self._append(self.mapping.translate(emitted))

    def _allocate(self, length: int) -> torch.Tensor:
        """A draft-id buffer for `length` tokens and a step's drafts, with room to grow."""
        return torch.empty(
            (1, 2 * (length + MAX_DRAFT_TOKENS + 1)), dtype=torch.long, device=self.model.device
        )

    def _append(self, draft_ids: list[int]) -> None:
        end = self.length + len(draft_ids)
        if end + MAX_DRAFT_TOKENS + 1 > self._seq.shape[1]:
            grown = self._allocate(end)
            grown[0, : self.length] = self._seq[0, : self.length]
            self._seq = grown
        if len(draft_ids) > self._staging.shape[0]:
            self._staging = torch.empty(
                2 * len(draft_ids), dtype=torch.long, pin_memory=self.model.device.type == "cuda"
            )
            self._staged = self._staging.numpy()
        self._staged[: len(draft_ids)] = draft_ids
        self._seq[0, self.length : end].copy_(self._staging[: len(draft_ids)], non_blocking=True)
        self.length = end


class MappedProposer:
    """`MappedDraft` as a `fsd_chat.decoding.proposal.Proposer`: proposals over the target's ids
    from a draft model with its own tokenizer.

    The draft's sequence follows the reply in its own tokens: `propose` first spells the target
    tokens emitted since it last looked (a plain target step's token included), `rollback` keeps
    the accepted draft tokens and spells the step's last token.

    Args:
        mapped: The draft, its KV cache and the vocabulary map.
    """

    kind: DraftKind = "mapped"

    def __init__(self, mapped: MappedDraft) -> None:
        self.mapped = mapped
        self._reply: Reply | None = None
        self._spelled = 0
        """Target tokens of the reply that the draft's sequence spells."""
        self._start = 0

    @property
    def cached_models(self) -> tuple[ModelRunner, ...]:
        """None that reads the target's ids: the draft's cache follows its own spelling and is
        prefilled by `prefill`."""
        return ()

    @property
    def owned_models(self) -> tuple[ModelRunner, ...]:
        """The draft model (its cache is freed on out-of-memory)."""
        return (self.mapped.model,)

    @property
    def compile_error(self) -> str | None:
        """See `Proposer.compile_error`."""
        return self.mapped.model.compile_error

    def prefill(self, reply: Reply, reuse_prefix: bool, defer: bool) -> None:
        """Spell the prompt in draft tokens and prefill the draft's cache, unless deferred
        (`MappedDraft.begin`)."""
        self._reply = reply
        self.mapped.begin(reply.host[: reply.length].tolist(), reuse_prefix, defer)
        self._spelled = reply.length

    def propose(
        self,
        reply: Reply,
        limit: int,
        policy: DraftPolicy,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Proposal:
        """Up to `limit` draft positions (fewer when the draft's window is nearly full)."""
        seq, start = reply.seq, reply.length
        if start > self._spelled:
            # Tokens the target emitted alone (plain target steps) since the last proposal.
            self.mapped.settle(reply.host[self._spelled : start].tolist(), 0)
            self._spelled = start
        self._start = start

        def laws(
            drafted: int, untruncated: SamplingConfig | None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            return self.mapped.distribution(seq, start, drafted, sampling, untruncated)

        return draw_positions(reply, min(limit, self.mapped.room()), laws, policy, sampling, generator)

    def rollback(self, length: int) -> None:
        """Keep the accepted draft tokens (length − the step's start) and spell the step's last
        token, already recorded at host[length] (`Reply.record`)."""
        assert self._reply is not None  # prefill came first
        emitted = self._reply.host[self._start : length + 1].tolist()
        self.mapped.settle(emitted, length - self._start)
        self._spelled = length + 1
