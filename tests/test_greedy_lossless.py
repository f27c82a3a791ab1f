"""Greedy speculative decoding with T = 0 reproduces target-only greedy decoding token for token
(float32, where batched verification and one-token steps round alike)."""

from __future__ import annotations

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, Origin
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect

# Thresholds are finite (JSON has no infinity); 1e9 nats is above any divergence of float32
# distributions, so every draft token passes the fuzzy test.
ACCEPT_ALL = 1e9

PROMPTS = [
    "Once upon a time",
    "Tom and his dog went to the park. They saw",
    "The little bird was sad because",
]


@pytest.fixture(scope="module")
def greedy_references(pair: ModelPair) -> dict[str, list[int]]:
    refs = {}
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt).input_ids
        refs[prompt] = collect(pair.autoregressive(Controls()).generate(ids, max_new_tokens=200)).ids
    return refs


@pytest.mark.slow
def test_autoregressive_matches_transformers_generate(pair: ModelPair, greedy_references) -> None:
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt).input_ids
        out = pair.target.generate(torch.tensor([ids]), max_new_tokens=200, do_sample=False)
        expected = out[0, len(ids) :].tolist()
        assert greedy_references[prompt] == expected[: len(greedy_references[prompt])]
        assert len(greedy_references[prompt]) >= 50


@pytest.mark.parametrize("rule", ["exact", "fuzzy"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.slow
def test_speculative_greedy_equals_target_greedy(
    pair: ModelPair, greedy_references, rule: str, k: int
) -> None:
    controls = Controls(DecodingSettings(rule=rule, threshold=0.0, draft_tokens=k))
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt).input_ids
        run = collect(pair.speculative(controls).generate(ids, max_new_tokens=200))
        assert run.ids == greedy_references[prompt]
        assert Origin.DRAFT_FUZZY not in run.origins
        # The draft is good enough that SD really skips target forwards.
        assert run.stats.target_forwards < run.stats.tokens
        assert run.stats.acceptance_rate > 0.3


def test_pure_rule_with_zero_threshold_is_exact_speculative_decoding(
    pair: ModelPair, greedy_references
) -> None:
    # T = 0 is exact speculative decoding under every rule: `pure` accepts the target's own choices
    # (draft-exact, cost 0) instead of nothing.
    controls = Controls(DecodingSettings(rule="pure", threshold=0.0, draft_tokens=3))
    prompt = PROMPTS[0]
    run = collect(pair.speculative(controls).generate(pair.tokenizer(prompt).input_ids, max_new_tokens=100))
    assert run.stats.accepted_exact > 0 and run.stats.accepted_fuzzy == 0
    assert run.ids == greedy_references[prompt][:100]


def test_fuzzy_with_a_huge_threshold_accepts_every_draft_token(pair: ModelPair) -> None:
    controls = Controls(DecodingSettings(rule="fuzzy", threshold=ACCEPT_ALL, draft_tokens=4))
    run = collect(
        pair.speculative(controls).generate(pair.tokenizer(PROMPTS[1]).input_ids, max_new_tokens=100)
    )
    assert run.stats.acceptance_rate == 1.0
    assert str(Origin.TARGET_RESAMPLED) not in run.origins
    assert run.stats.accepted_fuzzy > 0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_is_exact_mid_block(pair: ModelPair, max_new_tokens: int) -> None:
    controls = Controls(DecodingSettings(rule="fuzzy", threshold=ACCEPT_ALL, draft_tokens=5))
    run = collect(
        pair.speculative(controls).generate(
            pair.tokenizer(PROMPTS[0]).input_ids, max_new_tokens=max_new_tokens
        )
    )
    assert len(run.ids) == max_new_tokens
    assert run.steps[-1].stop_reason == "max-new-tokens"


def test_heuristic_draft_length(pair: ModelPair, greedy_references) -> None:
    prompt = pair.tokenizer(PROMPTS[0]).input_ids
    # Every block accepted: k grows by 2 per step (transformers' schedule), up to the room left.
    accept_all = Controls(DecodingSettings(threshold=ACCEPT_ALL, draft_tokens=2, draft_policy="heuristic"))
    run = collect(pair.speculative(accept_all).generate(prompt, max_new_tokens=40))
    assert [s.stats.drafted for s in run.steps][:4] == [2, 4, 6, 8]
    # With the exact rule, adapting k never changes the output.
    exact = Controls(DecodingSettings(threshold=0.0, draft_tokens=4, draft_policy="heuristic"))
    run = collect(pair.speculative(exact).generate(prompt, max_new_tokens=200))
    assert run.ids == greedy_references[PROMPTS[0]]
    assert len({s.stats.drafted for s in run.steps}) > 2
