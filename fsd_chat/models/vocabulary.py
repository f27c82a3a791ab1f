"""Whether a draft's vocabulary is the target's, or maps onto it (`fsd_chat.decoding.vocab_map`),
and whether a mapped draft's tokens cover enough of the target's probability mass: the checks of a
pair, whatever engine runs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.tokenizer import Tokenizer
from fsd_chat.decoding.vocab_map import VocabularyMap, coverage, map_vocabularies
from fsd_chat.engines.torch_engine.kv_cache import CachedModel
from fsd_chat.models.options import ModelSpec
from fsd_chat.support.errors import IncompatibleModelsError

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel

MIN_COVERAGE = 0.9
"""Least share of the target's probability mass (on `CALIBRATION_TEXT`) that the tokens of a draft
with another tokenizer must cover. The draft's acceptance is bounded by that share, and falls
faster: measured on the CPU-scale pair with drafts missing part of their vocabulary, 95% coverage
breaks even with the target alone and 80% runs at 0.72× (README, "A draft with another
tokenizer"; `scripts/bench_mapped.py`)."""


def check_compatible(
    target_tokenizer: Tokenizer,
    draft_tokenizer: Tokenizer,
    target_vocab: int,
    draft_vocab: int,
) -> int:
    """Check that the draft and target share a vocabulary; return the shared vocabulary size.

    Token strings must map to the same ids in both tokenizers. An lm_head padded beyond the
    tokenizer is fine: the shared size is the smallest of the tokenizer and the two output layers.

    Raises:
        IncompatibleModelsError: the tokenizers disagree on any token's id (`draft_vocabulary`
            then maps the draft's vocabulary onto the target's, where it can).
    """
    target_map = target_tokenizer.get_vocab()
    draft_map = draft_tokenizer.get_vocab()
    if target_map != draft_map:
        tokens = target_map.keys() | draft_map.keys()
        differing = sum(1 for tok in tokens if target_map.get(tok) != draft_map.get(tok))
        raise IncompatibleModelsError(
            f"the draft and target tokenizers differ: {differing} of the {len(tokens)} tokens in either "
            "are missing from one or have different ids (speculative decoding needs one shared vocabulary)"
        )
    return min(len(target_tokenizer), target_vocab, draft_vocab)


def draft_vocabulary(
    target_tokenizer: Tokenizer,
    draft_tokenizer: Tokenizer,
    target_vocab: int,
    draft_vocab: int,
) -> tuple[int, VocabularyMap | None]:
    """The target's vocabulary size, and how the draft's maps onto it (None: they share one).

    Raises:
        IncompatibleModelsError: the tokenizers differ and no token of the draft's corresponds to
            one of the target's (`check_compatible`'s message).
    """
    try:
        return check_compatible(target_tokenizer, draft_tokenizer, target_vocab, draft_vocab), None
    except IncompatibleModelsError:
        target_size = min(len(target_tokenizer), target_vocab)
        mapping = map_vocabularies(
            target_tokenizer, draft_tokenizer, target_size, min(len(draft_tokenizer), draft_vocab)
        )
        if mapping is None:
            raise
        return target_size, mapping


def check_coverage(share: float, draft: ModelSpec) -> None:
    """Refuse a mapped draft whose paired tokens hold less than MIN_COVERAGE of the target's mass.

    Raises:
        IncompatibleModelsError: `share` < MIN_COVERAGE.
    """
    if share < MIN_COVERAGE:
        raise IncompatibleModelsError(
            f"the tokens {draft.name} shares with the target hold only {share:.0%} of the target's probability "
            f"mass (at least {MIN_COVERAGE:.0%} pays for a draft with another tokenizer): choose a draft "
            "whose vocabulary is closer to the target's"
        )


def checked_coverage(
    target: PreTrainedModel | ModelRunner,
    tokenizer: Tokenizer,
    mapping: VocabularyMap,
    draft: ModelSpec,
    report: Callable[[str], object],
) -> float:
    """The share of the target's probability mass a mapped draft's tokens cover (`coverage`, on
    either engine; a transformers model bound to a `CachedModel` for it), said to `report` first.

    Raises:
        IncompatibleModelsError: under MIN_COVERAGE (`check_coverage`).
        UnsupportedCacheError: the target's KV cache cannot be rolled back (`CachedModel`).
    """
    report(f"mapping {draft.name}'s vocabulary onto the target's")
    runner = target if isinstance(target, ModelRunner) else CachedModel(target, mapping.target_vocab)
    share = coverage(runner, tokenizer, mapping)
    check_coverage(share, draft)
    return share
