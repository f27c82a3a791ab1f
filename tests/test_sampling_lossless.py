"""Sampling with T = 0 is lossless: the first two generated tokens follow the target's exact
distribution.

Chi-square goodness-of-fit tests on 20,000 replies from a fixed context, against probabilities
computed exactly from the target (the second token's marginal sums over every first token).
Each test uses α = 0.001, so the pair raises a false alarm with probability ≤ 0.002; the seeds
are fixed, so the outcome is reproducible. The same samples tested against the draft's
distribution must be rejected, which shows the test has the power to see a wrong distribution.
"""

from __future__ import annotations

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.models import ModelPair

SAMPLES = 20_000
ALPHA = 1e-3
SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95)
PROMPT = "Once upon a time, there was a"


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test; categories expected fewer than 5 times are pooled into one."""
    n = observed.sum()
    expected = expected_probs.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if bool((obs[exp == 0] > 0).any()):
        return 0.0
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    # Survival function of chi-square(dof): the regularised upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@torch.inference_mode()
def exact_first_two(model, prompt_ids: list[int], vocab: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 1) and P(token 2) over vocab + 1 categories; the last one is "reply ended" (EOS)."""
    p1 = probabilities(model(torch.tensor([prompt_ids])).logits[0, -1, :vocab], SAMPLING)
    batch = torch.tensor([[*prompt_ids, x] for x in range(vocab)])
    p2_given = probabilities(model(batch).logits[:, -1, :vocab], SAMPLING)  # [vocab, vocab]
    first = torch.cat([p1, torch.zeros(1)])
    first[vocab], first[eos] = p1[eos], 0.0
    weights = p1.clone()
    weights[eos] = 0.0
    second = torch.cat([weights @ p2_given, torch.zeros(1)])
    second[vocab] = p1[eos] + second[eos]
    second[eos] = 0.0
    return first, second


@pytest.mark.parametrize("rule", ["fuzzy"])
def test_first_two_tokens_follow_the_target(pair: ModelPair, rule: str) -> None:
    tokenizer, vocab = pair.tokenizer, pair.vocab_size
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer(PROMPT).input_ids
    decoder = pair.speculative(Controls(DecodingSettings(rule=rule, threshold=0.0, draft_tokens=2)))
    firsts = torch.zeros(vocab + 1, dtype=torch.long)
    seconds = torch.zeros(vocab + 1, dtype=torch.long)
    for seed in range(SAMPLES):
        sampling = SamplingConfig(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p, seed=seed)
        ids = [
            t.id
            for step in decoder.generate(prompt_ids, max_new_tokens=2, sampling=sampling)
            for t in step.tokens
        ]
        firsts[ids[0] if ids else vocab] += 1
        seconds[ids[1] if len(ids) > 1 else vocab] += 1

    first, second = exact_first_two(pair.target, prompt_ids, vocab, eos)
    assert chi_square_p_value(firsts, first) > ALPHA
    assert chi_square_p_value(seconds, second) > ALPHA

    draft_first, draft_second = exact_first_two(pair.draft, prompt_ids, vocab, eos)
    assert chi_square_p_value(firsts, draft_first) < 1e-6
    assert chi_square_p_value(seconds, draft_second) < 1e-6
