"""A draft model with its own tokenizer, proposing over the target's vocabulary (token-level
intersection; see `fsd_chat.decoding.vocab_map`).

The draft reads the target's text in its own tokens: its sequence is the draft-side spelling of
every target token emitted so far (`VocabularyMap.translate`, a cached look-up per token), built
once for the prompt and then extended by each step's emitted tokens only, never re-tokenised
whole. Its KV cache follows that sequence and is rolled back to the accepted prefix as the
target's is.

Its proposal law at each position is its next-token distribution with every unpaired token masked
out before temperature / top-k / top-p (so the draw and its law agree), moved to the target's ids:
q(t) = q_draft(partner(t)) for a paired target token t and 0 for the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsd_chat.decoding.kv_cache import CachedModel
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

    def __init__(self, draft: CachedModel, mapping: VocabularyMap, context: int | None) -> None:
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
        self.length = 0
        """Draft tokens that spell the reply's emitted text (prompt included)."""

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a reply: spell the prompt in draft tokens and prefill the draft's cache with all
        but the last of them."""
        self.model.reset()
        self.length = 0
        self._append(self.mapping.translate(prompt_ids))
        if 1 < self.length < self._limit():
            self.model.forward(self._seq, self.length - 1, keep=1)

    def spelled(self) -> list[int]:
        """The draft's ids that spell the reply so far (prompt included)."""
        return [int(i) for i in self._seq[0, : self.length].tolist()]

    def room(self) -> int:
        """Most tokens the draft may propose before its context window is full."""
        return max(self._limit() - 1 - self.length, 0)

    def _limit(self) -> int:
        return self.context if self.context is not None else self._seq.shape[1]

    def distribution(
        self, seq: torch.Tensor, start: int, drafted: int, sampling: SamplingConfig
    ) -> torch.Tensor:
        """The proposal law of the next draft position, over the target's vocabulary.

        Args:
            seq: The reply's target-id buffer, shape [1, capacity] int64; the tokens drafted so
                far this step sit at seq[0, start:start + drafted].
            start: The reply's length (in target tokens) when the step began.
            drafted: Tokens drafted so far this step.
            sampling: Temperature / top-k / top-p, applied to the draft's masked logits.

        Returns:
            q over the target's ids, shape [target_vocab] float32, on the draft's device.
        """
        if drafted:
            self._seq[0, self.length + drafted - 1] = self._to_draft[seq[0, start + drafted - 1]]
        logits = self.model.forward(self._seq, self.length + drafted, keep=1)[-1]
        q = probabilities(logits.masked_fill(self._unpaired, float("-inf")), sampling)
        return F.pad(q, (0, 1))[self._gather]

    def settle(self, emitted: list[int], accepted: int) -> None:
        """Follow a step: keep the `accepted` draft tokens it accepted and spell the rest of the
        tokens it emitted (the target's correction, bonus or own token), in target ids."""
        self.model.rollback(self.length + accepted)
        # The accepted tokens are paired ones: spelled again they are the draft ids already there.
        self._append(self.mapping.translate(emitted))

    def _append(self, draft_ids: list[int]) -> None:
        end = self.length + len(draft_ids)
        if end + MAX_DRAFT_TOKENS + 1 > self._seq.shape[1]:
            grown = torch.empty(
                (1, 2 * (end + MAX_DRAFT_TOKENS + 1)), dtype=torch.long, device=self._seq.device
            )
            grown[0, : self.length] = self._seq[0, : self.length]
            self._seq = grown
        self._seq[0, self.length : end] = torch.tensor(draft_ids, dtype=torch.long)
        self.length = end
