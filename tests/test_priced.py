"""The priced rule: exact speculative sampling against r = (1 − λ)p + λq with, at each position, the λ
that maximises acceptance − KL(r ‖ p)/T (T: nats per unit of acceptance probability at the margin).

The law test is a chi-square goodness-of-fit test at α = 0.001 (false-alarm probability 0.001) on
20,000 verifications with a fixed seed; its power is shown by rejecting the same samples against p
and against q (p < 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from fsd_chat.decoding import SamplingConfig
from fsd_chat.decoding.acceptance import mixture_weight, priced_mixture_weight, verify
from fsd_chat.decoding.divergence import kl, tv
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.models import ModelPair
from tests.test_acceptance import TEXT
from tests.test_sampling_lossless import chi_square_p_value

SAMPLING = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def teacher_forced(pair: ModelPair) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q at every position of a held-out text, temperature 1 ([n, vocab] each)."""
    ids = torch.tensor([pair.tokenizer(TEXT).input_ids])
    with torch.inference_mode():
        p = probabilities(pair.target(ids).logits[0, :-1, : pair.vocab_size], SAMPLING)
        q = probabilities(pair.draft(ids).logits[0, :-1, : pair.vocab_size], SAMPLING)
    return p, q


def objective(p: torch.Tensor, q: torch.Tensor, lam: torch.Tensor, rate: float) -> torch.Tensor:
    """acceptance − KL/rate at each row for weights lam [...] (or [grid, ...]), in float64."""
    p, q, lam = p.double(), q.double(), lam.double()
    r = p + lam.unsqueeze(-1) * (q - p)
    return 1 - (1 - lam) * tv(p, q) - kl(r, p.expand_as(r)) / rate


@pytest.mark.parametrize("rate", [0.2, 0.67, 2.0])
def test_priced_weight_is_the_per_position_optimum(teacher_forced, rate: float) -> None:
    p, q = teacher_forced
    lam, cost = priced_mixture_weight(p, q, rate)
    assert cost.double() == pytest.approx(kl(p + lam[:, None] * (q - p), p).double(), abs=1e-6)
    # No λ on a fine grid (nor 0, nor 1) does better at any position.
    grid = torch.linspace(0, 1, 401, dtype=torch.float64)
    best = torch.stack([objective(p, q, g.expand(p.shape[0]), rate) for g in grid]).max(0).values
    assert torch.all(objective(p, q, lam, rate) >= best - 1e-5)
    assert ((lam > 0) & (lam < 1)).any()


def test_priced_accepts_at_least_as_much_as_mixture_at_equal_mean_cost(teacher_forced) -> None:
    """Maximising acceptance − μ·cost position by position maximises the mean acceptance for its
    mean cost (a Lagrangian argument): mixture, which spends up to T everywhere, cannot beat it."""
    p, q = teacher_forced
    distance = tv(p, q)
    for rate in (0.5, 1.0):
        lam, cost = priced_mixture_weight(p, q, rate)
        spent = float(cost.mean())
        lo, hi = 0.0, 1.0  # the mixture budget with the same mean cost, by bisection
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float(mixture_weight(p, q, mid)[1].mean()) < spent else (lo, mid)
        mixture_lam = mixture_weight(p, q, lo)[0]
        priced, mixture = (float((1 - (1 - w) * distance).mean()) for w in (lam, mixture_lam))
        assert priced >= mixture - 1e-6


@torch.inference_mode()
def test_first_token_follows_the_priced_mixture(pair: ModelPair) -> None:
    samples, rate = 20_000, 2.0
    ids = torch.tensor([pair.tokenizer("The little dog").input_ids])
    p1 = probabilities(pair.target(ids).logits[0, -1, : pair.vocab_size], SAMPLING)
    q1 = probabilities(pair.draft(ids).logits[0, -1, : pair.vocab_size], SAMPLING)
    lam = float(priced_mixture_weight(p1, q1, rate)[0])
    assert 0.1 < lam < 0.9, "the price must bind: the law differs from both p and q"
    r = (1 - lam) * p1 + lam * q1
    generator = torch.Generator().manual_seed(1234)
    p = torch.stack([p1, p1])  # the second row stands for the bonus position
    counts = torch.zeros(pair.vocab_size, dtype=torch.long)
    for _ in range(samples):
        draft = torch.multinomial(q1, 1, generator=generator)
        verdict = verify(
            p,
            q1[None],
            draft,
            rule="priced",
            divergence_name="js",
            threshold=rate,
            sampling=SAMPLING,
            generator=generator,
        )
        counts[verdict.token_ids[0]] += 1
    assert chi_square_p_value(counts, r) > 1e-3
    assert chi_square_p_value(counts, p1) < 1e-6
    assert chi_square_p_value(counts, q1) < 1e-6
