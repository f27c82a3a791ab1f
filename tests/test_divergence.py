"""Divergences against hand-computed values, their textbook properties, and the clamp that keeps
them in range when the rows sum to 1 only up to rounding."""

from __future__ import annotations

import math

import pytest
import torch

from fsd_chat.decoding.divergence import divergence, js, kl, reverse_kl, tv
from fsd_chat.decoding.settings import DIVERGENCE_NAMES, DivergenceName

LN2 = math.log(2.0)

# Asymmetric, with full supports: every divergence is finite and strictly inside its range.
P = torch.tensor([0.75, 0.25])
Q = torch.tensor([0.5, 0.5])
M = [0.625, 0.375]  # (P + Q) / 2
HAND_VALUES: dict[DivergenceName, float] = {
    # 0.75 ln(0.75/0.5) + 0.25 ln(0.25/0.5)
    "kl": 0.75 * math.log(1.5) - 0.25 * LN2,
    # 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25)
    "reverse-kl": 0.5 * math.log(2 / 3) + 0.5 * LN2,
    # ½[0.75 ln(0.75/0.625) + 0.25 ln(0.25/0.375)] + ½[0.5 ln(0.5/0.625) + 0.5 ln(0.5/0.375)]
    "js": 0.5 * (0.75 * math.log(0.75 / M[0]) + 0.25 * math.log(0.25 / M[1]))
    + 0.5 * (0.5 * math.log(0.5 / M[0]) + 0.5 * math.log(0.5 / M[1])),
    # ½(0.25 + 0.25)
    "tv": 0.25,
}


@pytest.mark.parametrize("name", DIVERGENCE_NAMES)
def test_hand_computed_values_inside_the_range(name: DivergenceName) -> None:
    assert divergence(name, P, Q).item() == pytest.approx(HAND_VALUES[name], rel=1e-6)
    # Rows of a batch are independent: [2, vocab] -> [2].
    both = divergence(name, torch.stack([P, Q]), torch.stack([Q, Q]))
    assert both.tolist() == pytest.approx([HAND_VALUES[name], 0.0], rel=1e-6, abs=1e-7)


def test_kl_and_reverse_kl_are_the_two_directions() -> None:
    assert kl(P, Q).item() == pytest.approx(HAND_VALUES["kl"], rel=1e-6)
    assert reverse_kl(P, Q).item() == pytest.approx(HAND_VALUES["reverse-kl"], rel=1e-6)
    assert kl(Q, P).item() == pytest.approx(HAND_VALUES["reverse-kl"], rel=1e-6)
    assert HAND_VALUES["kl"] != pytest.approx(HAND_VALUES["reverse-kl"], rel=1e-3)


def test_hand_computed_values_with_zeros() -> None:
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])
    # KL(p‖q) = 2 · 0.5 · ln(0.5/0.25) = ln 2: p's zero contributes nothing
    assert kl(p, q).item() == pytest.approx(LN2)
    # KL(q‖p) is infinite: q puts mass where p has none
    assert math.isinf(reverse_kl(p, q).item())
    # TV = ½(0.25 + 0.25 + 0.5) = 0.5
    assert tv(p, q).item() == pytest.approx(0.5)
    # m = (p + q) / 2 = (0.375, 0.375, 0.25); ½[KL(p‖m) + KL(q‖m)]
    expected = 0.5 * (
        2 * 0.5 * math.log(0.5 / 0.375) + (2 * 0.25 * math.log(0.25 / 0.375) + 0.5 * math.log(0.5 / 0.25))
    )
    assert js(p, q).item() == pytest.approx(expected)


def test_disjoint_supports_reach_the_upper_bounds() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    # m = (½, ½): JS = ½(ln 2 + ln 2); TV = ½(1 + 1)
    assert js(a, b).item() == pytest.approx(LN2)
    assert tv(a, b).item() == pytest.approx(1.0)


@pytest.mark.parametrize("name", DIVERGENCE_NAMES)
def test_identity_is_zero(name: DivergenceName) -> None:
    p = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.allclose(divergence(name, p, p), torch.zeros(4), atol=1e-6)


def test_textbook_inequalities_and_symmetry() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(3 * torch.randn(200, 64, generator=gen), -1)
    q = torch.softmax(3 * torch.randn(200, 64, generator=gen), -1)
    # Pinsker: TV ≤ √(KL/2), either way round; and JS ≤ ln 2 · TV. A clamp to the range cannot
    # make these hold: they tie the divergences to each other, well inside their ranges here.
    assert bool((tv(p, q) <= (kl(p, q) / 2).sqrt() + 1e-6).all())
    assert bool((tv(p, q) <= (reverse_kl(p, q) / 2).sqrt() + 1e-6).all())
    assert bool((js(p, q) <= LN2 * tv(p, q) + 1e-6).all())
    assert torch.allclose(js(p, q), js(q, p), atol=1e-6)
    assert torch.allclose(tv(p, q), tv(q, p), atol=1e-6)
    assert not torch.allclose(kl(p, q), kl(q, p))  # KL is not symmetric


# Rows rounded to bfloat16 (as a half-precision model's probabilities are) sum to 1 only up to
# rounding: 1/3 rounds to 0.333984375, so three of them sum to 1.001953125 (1 + 2^-9); and a
# uniform row over 4 tokens with its last entry one bfloat16 step low sums to 1 − 2^-10.
THIRDS = torch.tensor([0.333984375] * 3 + [0.0] * 3)
DISJOINT_THIRDS = THIRDS.flip(0)
UNIFORM = torch.full((4,), 0.25)
UNIFORM_LOW = torch.tensor([0.25, 0.25, 0.25, 0.2490234375])


def test_kl_below_zero_by_rounding_is_clamped_to_zero() -> None:
    # Unclamped: 0.2490234375 · ln(0.2490234375 / 0.25) ≈ −9.75e-4
    assert kl(UNIFORM_LOW, UNIFORM).item() == 0.0
    assert reverse_kl(UNIFORM, UNIFORM_LOW).item() == 0.0
    assert divergence("kl", UNIFORM_LOW, UNIFORM).item() == 0.0


def test_js_above_ln2_by_rounding_is_clamped_to_ln2() -> None:
    # Unclamped: m = p/2 on p's support and q/2 on q's, so JS = ln 2 · 1.001953125 ≈ 0.69450
    assert js(THIRDS, DISJOINT_THIRDS).item() == pytest.approx(LN2, abs=1e-7)
    assert divergence("js", THIRDS, DISJOINT_THIRDS).item() == pytest.approx(LN2, abs=1e-7)


def test_tv_above_one_by_rounding_is_clamped_to_one() -> None:
    # Unclamped: ½ · 6 · 0.333984375 = 1.001953125
    assert tv(THIRDS, DISJOINT_THIRDS).item() == 1.0
    assert divergence("tv", THIRDS, DISJOINT_THIRDS).item() == 1.0
