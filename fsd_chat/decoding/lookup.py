"""Prompt lookup: draft tokens copied from the context itself, no draft model.

At each step the context (prompt and reply so far) is searched for an earlier occurrence of its
last n tokens; the tokens that followed that occurrence are proposed, up to k of them. Text that
repeats, revises or quotes its prompt (code edits, summaries with names, retold stories) is
proposed for free. Where no n-gram matches, nothing is proposed and the step is a plain target step.

The match: the longest suffix of the context, of at most `ngram` tokens, that occurred before
(falling back to shorter n-grams down to one token, as transformers does); among the occurrences of
that length, the one whose next token followed the suffix most often in the context, the latest of
those on a tie. Sources: Saxena, "Prompt Lookup Decoding" (2023); transformers'
`PromptLookupCandidateGenerator` (`prompt_lookup_num_tokens`, `max_matching_ngram_size`), which takes
the earliest occurrence; llama.cpp's n-gram drafts (`--spec-type ngram-*`), which search the
context's history the same way; the frequency, from SuffixDecoding (Oliaro et al.,
arXiv:2411.04975; vLLM's `suffix` method through Arctic Inference), which proposes the continuation
its suffix tree of the context has seen most often. Where a summary says "the little girl" three
times and "the little dog" once, the next "the little" proposes "girl" whichever came last.
Priced by the goodput policy's steps on 30 summary requests to the default chat, it gains 1.152×
over the target alone against the latest occurrence's 1.126× (T 1 regret, prefill included;
`docs/benchmarks.md`, "The most frequent continuation").

The proposal is deterministic given the context: its law is a point mass q_i = δ(x̃_i), passed to
the rules as `Proposal.q = None` (`fsd_chat.decoding.acceptance` derives each rule for it).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from fsd_chat.decoding.draft_policy import DraftPolicy
from fsd_chat.decoding.proposal import DraftKind, Proposal
from fsd_chat.decoding.reply import Reply
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.settings import DEFAULT_LOOKUP_NGRAM, MAX_DRAFT_TOKENS, SamplingConfig


class Match(NamedTuple):
    """A continuation prompt lookup found (`find_continuation`)."""

    start: int
    """Where the proposed tokens start in the context."""
    proposed: int
    """How many to propose (0: nothing matches)."""
    matched: int
    """The length of the suffix that matched, in tokens (0: none): the proposal's evidence, by
    which `goodput` keeps acceptance apart (`fsd_chat.decoding.draft_policy.MatchedGoodput`)."""


NO_MATCH = Match(0, 0, 0)


def continuations(tokens: np.ndarray, ngram: int) -> tuple[np.ndarray, int]:
    """Where the continuations of the earlier occurrences of the context's longest matching suffix
    (≤ `ngram` tokens) start, and that suffix's length.

    Vectorised over the context: the earlier positions holding the context's last token are found
    in one comparison, and their agreement with the suffix is extended backwards one token at a
    time, for those positions only (at most `ngram` - 1 more comparisons of a few entries). It runs
    on the host's copy of the context (`Reply.host`): the step's proposal length must be known
    there, and searching a device copy would cost a device read per step besides the verdict's.

    Args:
        tokens: The context, shape [L] int64, L ≥ 1 (prompt and reply so far).
        ngram: The longest suffix to match, in tokens (≥ 1).

    Returns:
        (starts, matched): the positions just after each occurrence of the `matched`-token suffix,
        shape [n] int64 ascending, each < L; an empty array and 0 when nothing occurred before.
    """
    length = tokens.shape[0]
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # earlier occurrences of the last token
    if ends.size == 0:
        return ends, 0
    agree = np.ones(ends.size, dtype=np.int64)
    # An occurrence ending at `end` agrees on j + 1 tokens when it agreed on j and the tokens j back
    # match; none reaches back past the context's start (end ≥ j), nor the suffix past it.
    for back in range(1, min(ngram, length - 1)):
        before = ends - back
        agree += (agree == back) & (before >= 0) & (tokens[before] == tokens[length - 1 - back])
    matched = int(agree.max())
    return ends[agree == matched] + 1, matched


def find_continuation(tokens: np.ndarray, ngram: int, limit: int) -> Match:
    """Where the proposed continuation starts, and how many tokens of it to propose: of the
    continuations of the context's longest matching suffix (`continuations`), one whose first
    token follows that suffix most often, the latest of those (module docstring). The counts are
    one `np.unique` over the few occurrences, the choice one argmax.

    Args:
        tokens: The context, shape [L] int64 (prompt and reply so far).
        ngram: The longest suffix to match, in tokens (≥ 1).
        limit: The most tokens to propose (≥ 1).

    Returns:
        (start, proposed, matched): propose tokens[start : start + proposed], after a suffix of
        `matched` tokens that occurred before; NO_MATCH when nothing does.
    """
    length = tokens.shape[0]
    starts, matched = continuations(tokens, ngram)
    if not matched:
        return NO_MATCH
    _, which, counts = np.unique(tokens[starts], return_inverse=True, return_counts=True)
    start = int(starts[(counts[which] * length + starts).argmax()])
    return Match(start, min(limit, length - start), matched)


def repeat_run(tokens: np.ndarray, distance: int) -> int:
    """How many of the context's last tokens each equal the token `distance` before it: the length
    of the repetition a copy from `distance` back extends.

    Args:
        tokens: The context, shape [L] int64.
        distance: How far back the copy's source is, in tokens (1 ≤ distance < L).
    """
    n = tokens.shape[0] - distance
    same = tokens[distance:] == tokens[:n]  # [n]: position distance + i against i
    differ = np.flatnonzero(~same)
    return n if differ.size == 0 else n - 1 - int(differ[-1])


class PromptLookup:
    """Proposals copied from the context (module docstring); no model, no cache.

    Args:
        ngram: The longest suffix matched, in tokens (≥ 1).

    Raises:
        ValueError: ngram < 1.
    """

    kind: DraftKind = "lookup"
    cached_models: tuple[ModelRunner, ...] = ()
    owned_models: tuple[ModelRunner, ...] = ()
    compile_error: str | None = None

    def __init__(self, ngram: int = DEFAULT_LOOKUP_NGRAM) -> None:
        if ngram < 1:
            raise ValueError(f"the lookup n-gram must be ≥ 1 token, got {ngram}")
        self.ngram = ngram
        self._found: tuple[Reply, int, Match] | None = None

    def prefill(self, reply: Reply, reuse_prefix: bool, defer: bool) -> None:
        """Nothing to encode: the context is searched at each step."""

    def match(self, reply: Reply, limit: int = MAX_DRAFT_TOKENS) -> Match:
        """The continuation of the reply's context now, up to `limit` tokens (found once per
        context length: the decoder asks before its policy decides, the step again after)."""
        length = reply.length
        if self._found is None or self._found[0] is not reply or self._found[1] != length:
            self._found = (
                reply,
                length,
                find_continuation(reply.host[:length], self.ngram, MAX_DRAFT_TOKENS),
            )
        found = self._found[2]
        return found._replace(proposed=min(found.proposed, limit))

    def propose(
        self,
        reply: Reply,
        limit: int,
        policy: DraftPolicy,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Proposal:
        """Copy up to `limit` tokens of the matched continuation to seq[0, length:]. The policy
        only caps the length (`limit`): a copied token's law, δ, says nothing of its acceptance."""
        length = reply.length
        start, count, _ = self.match(reply, limit)
        if count:
            # start + count ≤ length: source and destination do not overlap.
            reply.seq[0, length : length + count] = reply.seq[0, start : start + count]
        return Proposal(drafted=count, q=None, forwards=0, lookup=count > 0)

    def rollback(self, length: int) -> None:
        """Nothing to roll back."""
