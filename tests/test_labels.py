"""Labels and costs agree: a token is `draft-fuzzy` exactly when it costs something.

A relaxed test may decide a position whose law is the target's after all: under top-p a
prompt-lookup token the truncated target holds with probability 1 (the divergence compares the
untruncated laws, which differ). Such a token departs from nothing: `draft-exact`, cost +0.0 (the
formula −log 1 gives −0.0, which used to reach `generate --json`). Checked under top-k, top-p and
min-p with a draft model, a mapped draft (another tokenizer) and prompt lookup, with the real
offline pair.
"""

from __future__ import annotations

import math

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, Origin, SamplingConfig
from fsd_chat.decoding.acceptance import verify
from fsd_chat.decoding.events import StopReason
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect, lookup_decoder

TRUNCATIONS = {
    "top-k 3": SamplingConfig(temperature=0.7, top_k=3, seed=1),
    "top-p 0.9": SamplingConfig(temperature=0.7, top_p=0.9, seed=1),
    "min-p 0.2": SamplingConfig(temperature=0.7, min_p=0.2, seed=1),
}
RULES = {  # (rule, divergence, T): wide enough that the relaxed test decides many positions
    "fuzzy js": ("fuzzy", "js", 0.05),
    "fuzzy reverse-kl": ("fuzzy", "reverse-kl", 0.5),
    "mixture": ("mixture", "js", 0.05),
}
PROMPTS = ["Tom had a red ball. Tom had a red ball. Tom had a", "Once upon a time"]
LOOKUP_PROMPTS = [
    "Lily had a red ball. She played with the red ball in the park every day. Her friend Tom came to"
    " play too. Lily had a red ball. She played with the red ball in the park every day. Her friend",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the log. The cat",
]
"""Prompts that say themselves again, which the reply goes on copying: prompt lookup relaxes
copies of the prompt only (under min-p 0.2 the second is the one that gives fuzzy tokens)."""


def test_a_relaxed_position_whose_law_is_the_targets_is_exact_and_free() -> None:
    """The issue's case in one verification: top-p leaves the copied token alone in p, so the
    relaxed law (a point mass on it) is p itself."""
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, seed=0)
    logits = torch.tensor([[4.0, 1.0, 0.0, 0.0]] * 2)
    p = probabilities(logits, sampling)
    p_full = probabilities(logits, sampling.untruncated())
    assert p[0, 0] == 1.0 and p_full[0, 0] < 1.0  # truncation made the copy certain
    verdict = verify(
        p,
        None,
        torch.tensor([0]),
        rule="fuzzy",
        divergence_name="js",
        threshold=0.1,
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
        p_full=p_full,
    )
    assert verdict.divergences[0] > 0  # the relaxed test did decide it (D° ≤ T)
    assert verdict.origins()[0] == Origin.DRAFT_EXACT
    assert verdict.costs[0] == 0.0 and math.copysign(1.0, verdict.costs[0]) == 1.0


def _decoder(kind: str, pair: ModelPair, shuffled: ModelPair, settings: DecodingSettings) -> Decoder:
    if kind == "model":
        return pair.speculative(Controls(settings))
    if kind == "mapped":
        return shuffled.speculative(Controls(settings))
    return lookup_decoder(pair, Controls(settings))


@pytest.mark.parametrize("kind", ["model", "mapped", "lookup"])
@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
@pytest.mark.slow
def test_every_fuzzy_token_costs_something_and_no_cost_is_negative_zero(
    pair: ModelPair, shuffled: ModelPair, kind: str, truncation: str
) -> None:
    fuzzy = 0
    # Lookup relaxes only copies of the prompt (a copy of the reply is verified exactly).
    prompts = [*PROMPTS, *LOOKUP_PROMPTS] if kind == "lookup" else PROMPTS
    for name, (rule, divergence, threshold) in RULES.items():
        settings = DecodingSettings(
            rule=rule, divergence=divergence, threshold=threshold, draft_tokens=4, draft_policy="fixed"
        )
        decoder = _decoder(kind, pair, shuffled, settings)
        for prompt in prompts:
            run = collect(
                decoder.generate(
                    pair.tokenizer(prompt).input_ids, max_new_tokens=64, sampling=TRUNCATIONS[truncation]
                )
            )
            for step in run.steps:
                for token in step.tokens:
                    assert math.copysign(1.0, token.cost) == 1.0, (name, token)  # never −0.0
                    if token.origin == Origin.DRAFT_FUZZY:
                        assert token.cost > 0, (name, token)
                    elif token.origin == Origin.DRAFT_EXACT:
                        assert token.cost == 0, (name, token)
                # fuzzy_share (generate --json, the chat's strip) counts `accepted_fuzzy`: the
                # tokens labelled fuzzy, and at the reply's end an EOS kept fuzzily (decided, not
                # shown), never a token accepted after the end.
                labelled = sum(t.origin == Origin.DRAFT_FUZZY for t in step.tokens)
                extra = int(step.stop_reason == StopReason.EOS)
                assert labelled <= step.stats.accepted_fuzzy <= labelled + extra
            fuzzy += sum(t.origin == Origin.DRAFT_FUZZY for s in run.steps for t in s.tokens)
    assert fuzzy > 0  # the relaxed rules did label some tokens fuzzy: the checks above ran on them
