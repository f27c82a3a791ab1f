"""`scripts/policy_replay.py` replays a draft-length policy over a greedy reply without a model: at
T = 0 its steps must be the decoder's own, step for step, or its figures say nothing of the app."""

from __future__ import annotations

import pytest

from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.decoding.draft_policy import make_policy
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.settings import DEFAULT_LOOKUP_NGRAM, MAX_DRAFT_TOKENS
from fsd_chat.engines.torch_engine.binding import speculative_decoder
from fsd_chat.models.pair import ModelPair
from scripts.policy_replay import copies, driving, replay
from tests.decoding_helpers import collect

K = 5
CHEAP_COPIES = ForwardTimings(
    draft=0.0, widths=(1, MAX_DRAFT_TOKENS + 1), verify=(1.0, 1.0 + 0.15 * MAX_DRAFT_TOKENS), step=0.05
)
"""Prompt lookup where a verified token adds 15% to a forward and a drafting step 5%: copies pay
when most of their tokens are accepted, so the goodput policy drafts, pauses and probes."""


@pytest.mark.parametrize("prompt", ["Once upon a time", "The little bird was sad because"])
def test_a_replayed_policy_takes_the_decoders_steps(pair: ModelPair, prompt: str) -> None:
    ids = pair.tokenizer(prompt).input_ids
    settings = DecodingSettings(rule="exact", threshold=0.0, draft_tokens=K, draft_policy="goodput")
    decoder = speculative_decoder(
        pair.target,
        PromptLookup(),
        pair.tokenizer,
        controls=Controls(settings),
        vocab_size=pair.vocab_size,
        timings=lambda: CHEAP_COPIES,
    )
    decoded = collect(decoder.generate(ids, max_new_tokens=120))
    reply = copies(list(ids), decoded.ids, K)
    policy = driving(lambda: make_policy("goodput", lambda: CHEAP_COPIES, "lookup", DEFAULT_LOOKUP_NGRAM), K)
    (steps,) = replay([reply], CHEAP_COPIES, policy)["steps"]
    assert [(s.stats.drafted, s.stats.emitted) for s in decoded.steps] == steps
    assert any(drafted for drafted, _ in steps) and any(not drafted for drafted, _ in steps)
