"""transformers' lossy verification (`assistant_ensemble_weight`, the bench's `hf-ensemble`) and
the cost the bench charges it.

The bench's cost for hf-ensemble rests on one claim: a token transformers emits at a draft position
has law v = w·p + (1 − w)·q (a bonus token: p). The law test runs transformers' own
`_speculative_sampling` 20,000 times with a fixed seed and applies a chi-square goodness-of-fit test
at α = 0.001 (false-alarm probability 0.001); its power is shown by rejecting the same samples
against p and against q (p < 1e-6). The bench's recorded costs are then checked token by token
against a teacher-forced recomputation of KL(v ‖ p) from the text it produced.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.utils import _speculative_sampling

from fsd_chat.bench.methods import PairRunner
from fsd_chat.bench.records import Configuration, Setup
from fsd_chat.decoding import SamplingConfig
from fsd_chat.decoding.divergence import kl
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.pair import ModelPair
from tests.test_sampling_lossless import chi_square_p_value

SAMPLING = SamplingConfig(temperature=1.0)
WEIGHT = 0.5
"""Halfway between p and q, so that v differs from both."""


@torch.inference_mode()
@pytest.mark.slow
def test_transformers_ensemble_verification_emits_the_mixture_law(pair: ModelPair) -> None:
    samples = 20_000
    prompt = pair.tokenizer("The little dog").input_ids
    ids = torch.tensor([prompt])
    p1 = probabilities(pair.target(ids).logits[0, -1, : pair.vocab_size], SAMPLING)
    q1 = probabilities(pair.draft(ids).logits[0, -1, : pair.vocab_size], SAMPLING)
    v = WEIGHT * p1 + (1 - WEIGHT) * q1
    # One draft position (γ = 1) and the bonus row, as logits (transformers applies softmax).
    candidate_logits = q1.log()[None, None]
    new_logits = torch.stack([p1, p1]).log()[None]
    torch.manual_seed(1234)  # transformers draws from torch's global generator
    counts = torch.zeros(pair.vocab_size, dtype=torch.long)
    for _ in range(samples):
        draft = torch.multinomial(q1, 1)
        candidate_ids = torch.cat([ids, draft[None]], dim=1)
        tokens, _ = _speculative_sampling(
            candidate_ids, candidate_logits, 1, new_logits, assistant_ensemble_weight=WEIGHT
        )
        counts[tokens[0, 0]] += 1
    assert chi_square_p_value(counts, v) > 1e-3
    assert chi_square_p_value(counts, p1) < 1e-6
    assert chi_square_p_value(counts, q1) < 1e-6


@torch.inference_mode()
def test_bench_costs_are_each_tokens_kl_from_the_target(pair: ModelPair) -> None:
    """Each recorded cost is KL(v ‖ p) at its own position (recomputed teacher-forced from the
    reply), or 0 for a bonus token; a cost shifted by one position would not match."""
    runner = PairRunner(pair)
    prompt = prompt_ids(pair.tokenizer, [Message("user", "Once upon a time, there was a little cat.")])
    config = Configuration(Setup("float32"), 1.0, "hf-ensemble", 3, None, WEIGHT)
    try:
        generation = runner.run(config, prompt, max_new_tokens=60, seed=3, stop_strings=())
    finally:
        runner.close()
    reply = generation.token_ids
    assert generation.costs is not None and len(generation.costs) == len(reply) >= 20
    ids = torch.tensor([prompt + reply])
    rows = slice(len(prompt) - 1, -1)  # the positions that predicted the reply's tokens
    p = probabilities(pair.target(ids).logits[0, rows, : pair.vocab_size], SAMPLING)
    q = probabilities(pair.draft(ids).logits[0, rows, : pair.vocab_size], SAMPLING)
    expected = kl(WEIGHT * p + (1 - WEIGHT) * q, p).tolist()
    costs = generation.costs
    bonus = [i for i, cost in enumerate(costs) if cost == 0.0]
    assert all(
        abs(cost - e) < 1e-4
        for i, (cost, e) in enumerate(zip(costs, expected, strict=True))
        if i not in bonus
    )
    # Every bonus token ends a step: at most one per target forward, and the rest cost something.
    assert len(bonus) <= generation.target.calls and len(bonus) < len(costs) / 2
    assert min(expected) > 0  # a 0 is a bonus token, never a draft position's coincidence
