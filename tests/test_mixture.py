"""The mixture rule: exact speculative sampling against r = (1 − λ)p + λq, with the largest λ whose
KL(r ‖ p) stays within the per-token budget T.

The law test is a chi-square goodness-of-fit test at α = 0.001 (false-alarm probability 0.001) on
20,000 verifications with a fixed seed; its power is shown by rejecting the same samples against p
and against q (p < 1e-6).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.acceptance import mixture_weight
from fsd_chat.decoding.divergence import kl, tv
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import DIFFERENCE_ROUNDING, collect
from tests.test_acceptance import TEXT
from tests.test_cli_generate import pair_args, run_cli
from tests.test_sampling_lossless import chi_square_p_value, emitted

SAMPLING = SamplingConfig(temperature=1.0)
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park"]


def bisection_weight(p: torch.Tensor, q: torch.Tensor, budget: float) -> torch.Tensor:
    """The largest λ with KL((1 − λ)p + λq ‖ p) ≤ budget, by plain bisection in float64 (per row)."""
    p, q = p.double(), q.double()
    lo, hi = torch.zeros(p.shape[:-1], dtype=torch.float64), torch.ones(p.shape[:-1], dtype=torch.float64)
    for _ in range(60):
        mid = (lo + hi) / 2
        r = (1 - mid[..., None]) * p + mid[..., None] * q
        ok = kl(r, p) <= budget
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return lo


@pytest.fixture(scope="module")
def teacher_forced(pair: ModelPair) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q at every position of a held-out text, temperature 1 ([n, vocab] each)."""
    ids = torch.tensor([pair.tokenizer(TEXT).input_ids])
    with torch.inference_mode():
        p = probabilities(pair.target(ids).logits[0, :-1, : pair.vocab_size], SAMPLING)
        q = probabilities(pair.draft(ids).logits[0, :-1, : pair.vocab_size], SAMPLING)
    return p, q


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95)])
@pytest.mark.slow
def test_zero_budget_is_exact_speculative_decoding(pair: ModelPair, sampling: SamplingConfig) -> None:
    for prompt, seed in itertools.product(PROMPTS, range(2)):
        ids = pair.tokenizer(prompt).input_ids
        seeded = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        outputs = [
            collect(
                pair.speculative(Controls(DecodingSettings(rule=rule, threshold=0.0))).generate(
                    ids, max_new_tokens=80, sampling=seeded
                )
            )
            for rule in ("exact", "mixture")
        ]
        assert outputs[0].ids == outputs[1].ids
        assert outputs[0].origins == outputs[1].origins


@pytest.mark.parametrize("budget", [0.005, 0.02, 0.1])
def test_mixture_weight_is_the_largest_within_budget(teacher_forced, budget: float) -> None:
    p, q = teacher_forced
    lam, cost = mixture_weight(p, q, budget)
    expected = bisection_weight(p, q, budget)
    assert torch.all(cost <= budget + 1e-6)
    assert lam.double() == pytest.approx(expected, abs=1e-4)
    # Where the budget binds, it is nearly spent; where KL(q ‖ p) fits, the draft is accepted outright.
    binding = expected < 1
    assert torch.all(cost[binding] >= 0.99 * budget)
    assert torch.all(lam[~binding] == 1.0)
    assert binding.any() and (~binding).any()


@pytest.mark.parametrize("budget", [1e3, 1e100, 1e308, math.inf])
def test_a_budget_past_any_kl_saturates(teacher_forced, budget: float) -> None:
    """Every finite T ≥ 0 is a valid threshold (`DecodingSettings`): a budget past what any law can
    spend accepts the draft outright (λ = 1, cost KL(q ‖ p)) instead of overflowing float32."""
    p, q = teacher_forced
    lam, cost = mixture_weight(p, q, budget)
    assert torch.all(lam == 1.0)
    assert torch.allclose(cost, kl(q, p), atol=1e-5) and torch.isfinite(cost).all()
    # Where q has mass outside p's support, nothing is accepted, however large the budget.
    outside = q.clone()
    outside[0] = 0.0
    outside[0, int(p[0].argmin())] = 1.0
    p_cut = p.clone()
    p_cut[0, int(p[0].argmin())] = 0.0
    assert mixture_weight(p_cut / p_cut.sum(-1, keepdim=True), outside, budget)[0][0] == 0.0


def test_generate_takes_a_huge_mixture_threshold(
    target_dir: Path, draft_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fsd-chat generate --rule mixture --threshold 1e100` at temperature 1 replies (it raised
    RuntimeError: value cannot be converted to type float without overflow)."""
    args = ["generate", *pair_args(target_dir, draft_dir), "--threads", "1", "--rule", "mixture"]
    args += ["--threshold", "1e100", "--temperature", "1", "--seed", "1", "--max-new-tokens", "12"]
    code, out, err = run_cli([*args, "Once upon a time"], capsys)
    assert (code, err) == (0, "") and out.strip()


def test_mean_acceptance_rises_with_the_budget(teacher_forced) -> None:
    p, q = teacher_forced
    distance = tv(p, q)
    budgets = [0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 2.0]
    acceptance = []
    for budget in budgets:
        lam = mixture_weight(p, q, budget)[0] if budget > 0 else torch.zeros_like(distance)
        # Exact sampling against r accepts with probability 1 − TV(r, q) = 1 − (1 − λ)·TV(p, q).
        acceptance.append(float((1 - (1 - lam) * distance).mean()))
    assert acceptance[0] == pytest.approx(float((1 - distance).mean()))
    assert all(a <= b + 1e-7 for a, b in itertools.pairwise(acceptance))
    assert acceptance[-1] > acceptance[0] + 0.05


@pytest.mark.slow
@torch.inference_mode()
def test_first_token_follows_the_mixture(pair: ModelPair) -> None:
    samples = 20_000
    prompt_ids = pair.tokenizer("The little dog").input_ids
    ids = torch.tensor([prompt_ids])
    p1 = probabilities(pair.target(ids).logits[0, -1, : pair.vocab_size], SAMPLING)
    q1 = probabilities(pair.draft(ids).logits[0, -1, : pair.vocab_size], SAMPLING)
    budget = 0.4 * float(kl(q1, p1))
    lam = float(bisection_weight(p1, q1, budget))
    assert 0.2 < lam < 0.9, "the budget must bind: the law differs from both p and q"
    r = (1 - lam) * p1 + lam * q1

    # 20,000 independent draws of the first position's rule, judged at once (see `emitted`).
    generator = torch.Generator().manual_seed(1234)
    tokens = emitted(p1.expand(samples, -1), q1.expand(samples, -1), "mixture", budget, generator, SAMPLING)
    counts = torch.bincount(tokens, minlength=pair.vocab_size)
    assert chi_square_p_value(counts, r) > 1e-3
    assert chi_square_p_value(counts, p1) < 1e-6
    assert chi_square_p_value(counts, q1) < 1e-6


@pytest.mark.slow
def test_every_sampled_token_costs_at_most_the_budget(pair: ModelPair) -> None:
    budget = 0.05
    decoder = pair.speculative(Controls(DecodingSettings(rule="mixture", threshold=budget)))
    costs, tokens = [], 0
    for seed, prompt in enumerate(PROMPTS * 2):
        seeded = SamplingConfig(temperature=1.0, seed=seed)
        run = collect(decoder.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=120, sampling=seeded))
        costs += [t.cost for s in run.steps for t in s.tokens]
        tokens += run.stats.tokens
    assert tokens >= 300
    assert max(costs) <= budget + 1e-6
    assert sum(c > 0 for c in costs) >= 0.3 * len(costs), "the budget must be spent at most positions"


@torch.inference_mode()
def test_greedy_accepts_only_within_the_regret_budget(pair: ModelPair) -> None:
    budget = 0.5
    greedy = SamplingConfig()
    decoder = pair.speculative(Controls(DecodingSettings(rule="mixture", threshold=budget)))
    regrets = []
    for prompt in PROMPTS:
        prompt_ids = pair.tokenizer(prompt).input_ids
        run = collect(decoder.generate(prompt_ids, max_new_tokens=120, sampling=greedy), prompt_ids)
        ids = torch.tensor([run.prompt_ids + run.ids])
        logits = pair.target(ids).logits[0, len(run.prompt_ids) - 1 : -1, : pair.vocab_size]
        p = probabilities(logits, greedy)
        chosen = p.gather(-1, torch.tensor(run.ids)[:, None])[:, 0]
        regrets += (p.max(-1).values.log() - chosen.log()).tolist()
        assert [t.cost for s in run.steps for t in s.tokens] == pytest.approx(
            regrets[-len(run.ids) :], abs=DIFFERENCE_ROUNDING
        )
    assert max(regrets) <= budget + DIFFERENCE_ROUNDING
    assert sum(r > 1e-3 for r in regrets) >= 5, "the rule must accept some tokens other than the argmax"
