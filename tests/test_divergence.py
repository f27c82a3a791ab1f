"""Divergences against hand-computed values and their textbook properties."""

from __future__ import annotations

import math

import pytest
import torch

from fsd_chat.decoding.divergence import divergence, js, kl, reverse_kl, tv
from fsd_chat.decoding.settings import DIVERGENCE_NAMES

P = torch.tensor([0.5, 0.5, 0.0])
Q = torch.tensor([0.25, 0.25, 0.5])


def test_hand_computed_values() -> None:
    # KL(p‖q) = 2 · 0.5 · ln(0.5/0.25) = ln 2
    assert kl(P, Q).item() == pytest.approx(math.log(2))
    # KL(q‖p) is infinite: q puts mass where p has none
    assert math.isinf(reverse_kl(P, Q).item())
    # TV = ½(0.25 + 0.25 + 0.5) = 0.5
    assert tv(P, Q).item() == pytest.approx(0.5)
    # JS: m = (0.375, 0.375, 0.25); ½[KL(p‖m) + KL(q‖m)]
    # m = (p + q) / 2 = (0.375, 0.375, 0.25)
    expected = 0.5 * (
        2 * 0.5 * math.log(0.5 / 0.375) + (2 * 0.25 * math.log(0.25 / 0.375) + 0.5 * math.log(0.5 / 0.25))
    )
    assert js(P, Q).item() == pytest.approx(expected)


@pytest.mark.parametrize("name", DIVERGENCE_NAMES)
def test_identity_is_zero(name: str) -> None:
    p = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.allclose(divergence(name, p, p), torch.zeros(4), atol=1e-6)


def test_bounds_and_symmetry() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(3 * torch.randn(200, 64, generator=gen), -1)
    q = torch.softmax(3 * torch.randn(200, 64, generator=gen), -1)
    j, t = js(p, q), tv(p, q)
    assert bool((j >= 0).all()) and bool((j <= math.log(2) + 1e-6).all())
    assert bool((t >= 0).all()) and bool((t <= 1).all())
    assert torch.allclose(js(p, q), js(q, p), atol=1e-6)
    assert torch.allclose(tv(p, q), tv(q, p), atol=1e-6)
    assert torch.allclose(kl(p, q), reverse_kl(q, p))
    assert not torch.allclose(kl(p, q), kl(q, p))  # KL is not symmetric
    # Disjoint supports reach the upper bounds.
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert js(a, b).item() == pytest.approx(math.log(2))
    assert tv(a, b).item() == pytest.approx(1.0)
