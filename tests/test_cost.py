"""The per-token cost: KL(r ‖ p) of each token's law r against the target's p (greedy: the
log-probability regret), checked against an independent recomputation (on both engines:
transformers and llama.cpp) and against the exact expectation enumerated over the vocabulary.

The calibration test compares a sample mean with an exact value at 3 standard errors: a false alarm
has probability about 0.003 under the normal approximation; the seed is fixed, so the outcome is
reproducible.
"""

from __future__ import annotations

import math

import pytest
import torch

from fsd_chat.bench.quality import reply_logits
from fsd_chat.decoding import Controls, DecodingSettings, Origin, SamplingConfig
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import DIFFERENCE_ROUNDING, LOG_PROB_ROUNDING, Collected, collect

BATCH_VARIANCE = 1e-2
"""How far a cost recomputed on llama.cpp may stray, in nats: llama.cpp's logits for a position
depend on the batch it is computed in (the verify's k + 1 tokens against the recomputation's
chunk), by up to 0.004 nats on these costs of the offline pair in float32 (docs/engines.md,
"Numerics"); torch's are the same up to float rounding."""

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird"]
DRAFTED = {Origin.DRAFT_EXACT, Origin.DRAFT_FUZZY}


def replies(
    pair: ModelPair, settings: DecodingSettings, sampling: SamplingConfig, tokens: int
) -> list[Collected]:
    """Replies to PROMPTS (several seeds when sampling) until they hold `tokens` tokens in all."""
    decoder = pair.speculative(Controls(settings))
    runs: list[Collected] = []
    seed = 0
    while sum(r.stats.tokens for r in runs) < tokens:
        prompt = PROMPTS[seed % len(PROMPTS)]
        seeded = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        ids = pair.tokenizer.encode(prompt)
        runs.append(collect(decoder.generate(ids, max_new_tokens=160, sampling=seeded), ids))
        seed += 1
    return runs


@torch.inference_mode()
def teacher_forced(pair: ModelPair, prompt_ids: list[int], reply_ids: list[int], sampling: SamplingConfig):
    """p and q at the positions that produced each reply token ([n, vocab] each), recomputed over
    prompt + reply by each engine (`reply_logits`: one forward of a transformers model, a runner's
    passes over its KV cache on llama.cpp)."""
    assert pair.draft is not None
    p = probabilities(reply_logits(pair.target, pair.vocab_size, prompt_ids, reply_ids), sampling)
    q = probabilities(reply_logits(pair.draft, pair.vocab_size, prompt_ids, reply_ids), sampling)
    return p, q


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.9)])
@pytest.mark.parametrize("rule", ["exact", "fuzzy", "mixture"])
@pytest.mark.slow
def test_exact_and_zero_threshold_cost_nothing(pair: ModelPair, rule: str, sampling: SamplingConfig) -> None:
    threshold = 0.3 if rule == "exact" else 0.0
    for run in replies(pair, DecodingSettings(rule=rule, threshold=threshold), sampling, 200):
        assert all(t.cost == 0.0 for s in run.steps for t in s.tokens)
        assert run.stats.cost == 0.0


def test_sampled_costs_match_a_teacher_forced_recomputation(engine_pair: ModelPair) -> None:
    pair = engine_pair
    threshold = 0.3
    sampling = SamplingConfig(temperature=1.0)
    settings = DecodingSettings(rule="fuzzy", divergence="js", threshold=threshold)
    runs = replies(pair, settings, sampling, 300)
    fuzzy = sum(r.stats.accepted_fuzzy for r in runs)
    total = sum(r.stats.tokens for r in runs)
    assert fuzzy >= 0.2 * total, "the threshold must make at least a fifth of the tokens fuzzy"

    reported, recomputed = [], []
    for run in runs:
        p, q = teacher_forced(pair, run.prompt_ids, run.ids, sampling)
        m = 0.5 * (p + q)
        js = 0.5 * ((p * (p / m).log()).nansum(-1) + (q * (q / m).log()).nansum(-1))
        reverse_kl = (q * (q / p).log()).nansum(-1)
        tokens = [t for s in run.steps for t in s.tokens]
        for i, token in enumerate(tokens):
            # A drafted position with D ≤ T emits a token of the draft's law q; all others follow p.
            fuzzy_position = token.origin in DRAFTED and float(js[i]) <= threshold
            recomputed.append(float(reverse_kl[i]) if fuzzy_position else 0.0)
            reported.append(token.cost)
        if run.steps[-1].stop_reason != "eos":
            assert run.stats.cost == pytest.approx(sum(t.cost for t in tokens), rel=1e-9)
    llama = pair.engine == "llama.cpp"
    rounding = (BATCH_VARIANCE, BATCH_VARIANCE) if llama else (LOG_PROB_ROUNDING, DIFFERENCE_ROUNDING)
    assert reported == pytest.approx(recomputed, rel=rounding[0], abs=rounding[1])
    assert sum(reported) == pytest.approx(sum(recomputed), rel=BATCH_VARIANCE if llama else 1e-4)
    assert sum(reported) > 0


def test_greedy_costs_are_the_targets_regret(engine_pair: ModelPair) -> None:
    pair = engine_pair
    greedy = SamplingConfig()
    # Greedy, T is a regret bound (nats): 1.0 accepts tokens up to e times less likely than the argmax.
    runs = replies(pair, DecodingSettings(rule="fuzzy", divergence="js", threshold=1.0), greedy, 300)
    reported, recomputed = [], []
    for run in runs:
        p, _ = teacher_forced(pair, run.prompt_ids, run.ids, greedy)
        chosen = p.gather(-1, torch.tensor(run.ids)[:, None])[:, 0]
        recomputed += (p.max(-1).values.log() - chosen.log()).tolist()
        reported += [t.cost for s in run.steps for t in s.tokens]
    rounding = BATCH_VARIANCE if pair.engine == "llama.cpp" else DIFFERENCE_ROUNDING
    assert reported == pytest.approx(recomputed, abs=rounding)
    assert sum(c > 1e-3 for c in reported) >= 10, "some accepted tokens must differ from the target's argmax"


@torch.inference_mode()
@pytest.mark.slow
def test_mean_cost_is_the_kl_of_the_decoders_law(pair: ModelPair) -> None:
    """Fuzzy (js), k = 1, 3-token replies from a prompt whose first position is not fuzzy.

    The first token then follows p1 and is either accepted by the exact test (the second token is
    then the bonus, law p2) or resampled (the second token is drafted: law q2 where D2 ≤ T, else
    p2). Enumerating every first token gives the exact expected cost, the KL divergence of the
    decoder's law (tokens and path) from the target's; the KL of the text alone, also enumerated, is
    no larger (data-processing inequality). The third token is always the target's (cost 0).

    Error rate and power: the mean of 2,000 replies' costs must lie within 3 standard errors of the
    exact value (a false alarm with probability 0.0027, normal approximation; fixed seeds). Here the
    exact mean is 0.1344 nats and one reply's cost has standard deviation 0.1158 (enumerated as
    above), so the standard error is 1.9% of the mean: a cost off by 10% is caught with probability
    0.986, and one that reported the text's KL instead (0.1108 nats, 17.5% lower) with probability
    1 − 5·10⁻¹⁰ (5,000 replies, at 2.5 times the time, add nothing these bounds need).
    """
    replies_count, threshold = 2_000, 0.08
    sampling = SamplingConfig(temperature=1.0)
    vocab, eos = pair.vocab_size, pair.tokenizer.eos_token_id
    prompt_ids = pair.tokenizer.encode("The little dog")

    def laws(model, ids: torch.Tensor) -> torch.Tensor:
        return probabilities(model(ids).logits[:, -1, :vocab], sampling)

    p1, q1 = laws(pair.target, torch.tensor([prompt_ids]))[0], laws(pair.draft, torch.tensor([prompt_ids]))[0]
    m1 = 0.5 * (p1 + q1)
    js1 = 0.5 * (torch.special.xlogy(p1, p1 / m1).sum() + torch.special.xlogy(q1, q1 / m1).sum())
    assert js1 > threshold, "the first position must be decided by the exact test"
    batch = torch.tensor([[*prompt_ids, x] for x in range(vocab)])
    p2, q2 = laws(pair.target, batch), laws(pair.draft, batch)
    m2 = 0.5 * (p2 + q2)
    js2 = 0.5 * (torch.special.xlogy(p2, p2 / m2).sum(-1) + torch.special.xlogy(q2, q2 / m2).sum(-1))
    fuzzy2 = js2 <= threshold
    cost2 = torch.where(fuzzy2, torch.special.xlogy(q2, q2 / p2).sum(-1), 0.0).double()
    resampled = (p1 - q1).clamp_min(0).double()  # P(x1 is the correction), per x1
    resampled[eos] = 0.0  # the reply ends there
    expected = float(resampled @ cost2)
    # The text's own law: x2 | x1 mixes the bonus (p2) and the drafted law (q2 or p2).
    share = torch.where(p1 > 0, resampled / p1.double(), 0.0)[:, None]
    law2 = (1 - share) * p2.double() + share * torch.where(fuzzy2[:, None], q2, p2).double()
    text_kl = float((p1.double() * torch.special.xlogy(law2, law2 / p2.double()).sum(-1)).sum())
    assert 0 < text_kl <= expected
    assert expected > 1e-3, "the second position must be fuzzy often enough to measure"

    settings = DecodingSettings(rule="fuzzy", divergence="js", threshold=threshold, draft_tokens=1)
    decoder = pair.speculative(Controls(settings))
    costs = torch.zeros(replies_count, dtype=torch.float64)
    for seed in range(replies_count):
        seeded = SamplingConfig(temperature=1.0, seed=seed)
        # Stopped once two tokens are out: a third in a step of its own is the target's (cost 0),
        # so the sums are the whole replies' (seed by seed), at 16% fewer steps.
        tokens = 0
        for step in decoder.generate(prompt_ids, max_new_tokens=3, sampling=seeded):
            costs[seed] += step.stats.cost
            tokens += len(step.tokens)
            if tokens >= 2:
                break
    mean, se = float(costs.mean()), float(costs.std() / math.sqrt(replies_count))
    assert abs(mean - expected) <= 3 * se, f"mean cost {mean:.5f} ± {se:.5f}, exact {expected:.5f}"
