"""Divergences D(p, q) between the target's (p) and the draft's (q) next-token distributions.

All functions take probability tensors of shape [..., vocab] (rows summing to 1) and return shape
[...]. kl, reverse-kl and js are in nats; tv is a probability in [0, 1]. Rows that sum to 1 only up
to rounding (probabilities of a half-precision model sum to 1 ± 2^-9) can take a formula slightly
outside its range (KL below 0, JS above ln 2, TV above 1): results are clamped into the range.

Sources: Kullback–Leibler (1951); Jensen–Shannon as in Lin (1991), bounded by ln 2; total variation
½Σ|p−q|, whose complement 1 − TV is the acceptance probability of the exact speculative-sampling
test (Leviathan et al. 2023, §3.5). FSD (Holsman, Huang, Dhingra, ACL Findings 2025, §3) accepts a
draft token when D(p, q) ≤ T.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fsd_chat.decoding.settings import DivergenceName


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Terms with a = 0 contribute 0 (xlogy); a > 0 with b = 0 gives +inf, as KL should.
    return (torch.special.xlogy(a, a) - torch.special.xlogy(a, b)).sum(-1).clamp_min(0.0)


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) = Σ p log(p/q) in nats, shape [...]. +inf where q = 0 < p (e.g. after top-k on q)."""
    return _kl(p, q)


def reverse_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(q‖p) = Σ q log(q/p) in nats, shape [...]."""
    return _kl(q, p)


def js(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence ½KL(p‖m) + ½KL(q‖m), m = (p+q)/2, in nats; in [0, ln 2]."""
    m = 0.5 * (p + q)
    return (0.5 * (_kl(p, m) + _kl(q, m))).clamp_max(math.log(2.0))


def tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance ½Σ|p − q|, in [0, 1]."""
    return (0.5 * (p - q).abs().sum(-1)).clamp(0.0, 1.0)


DIVERGENCES: dict[DivergenceName, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": kl,
    "reverse-kl": reverse_kl,
    "js": js,
    "tv": tv,
}


DIVERGENCE_NAMES: tuple[DivergenceName, ...] = tuple(DIVERGENCES)
"""The divergences in the order a device index selects them (`selected`)."""


def selected(index: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """values[index] for a 0-dim int64 device `index`, without reading it on the host: the
    candidates are stacked and one is picked on the device (a captured step computes every
    candidate and selects; `fsd_chat.engines.torch_engine.step_graph`)."""
    return torch.stack(values).index_select(0, index.view(1)).squeeze(0)


def against_point_mass(name: DivergenceName | torch.Tensor, p_x: torch.Tensor) -> torch.Tensor:
    """D(p, δ_x) against a point mass q = δ_x (a prompt-lookup proposal), from a = p(x) alone.

    With q = δ_x every divergence is a function of a = p(x) ∈ [0, 1]:

    - kl: KL(p‖δ_x) = Σ_y p(y) log(p(y)/δ_x(y)) = +inf unless p = δ_x (a = 1, then 0): every
      y ≠ x with p(y) > 0 has δ_x(y) = 0.
    - reverse-kl: KL(δ_x‖p) = log(1/p(x)) = −log a (+inf at a = 0).
    - js: with m = (p + δ_x)/2, m(x) = (1 + a)/2 and m(y) = p(y)/2 elsewhere,
      KL(δ_x‖m) = log(2/(1 + a)) and KL(p‖m) = (1 − a) log 2 + a log(2a/(1 + a)), so
      JS = log 2 + ½[a log a − (1 + a) log(1 + a)]: log 2 at a = 0, 0 at a = 1, decreasing.
    - tv: ½[(1 − a) + Σ_{y≠x} p(y)] = 1 − a.

    Args:
        name: The divergence.
        p_x: a = p(x) per row, shape [...] (probabilities, float).

    Returns:
        D(p, δ_x), shape [...], float32, in the divergence's units (clamped into its range).

    Raises:
        KeyError: unknown divergence name.
    """
    if isinstance(name, torch.Tensor):
        return selected(name, [against_point_mass(each, p_x) for each in DIVERGENCE_NAMES])
    a = p_x.float().clamp(0.0, 1.0)
    if name == "kl":
        return torch.where(a >= 1.0, 0.0, math.inf)
    if name == "reverse-kl":
        return -a.log()
    if name == "js":
        half = 0.5 * (torch.special.xlogy(a, a) - (1 + a) * torch.log1p(a))
        return (math.log(2.0) + half).clamp(0.0, math.log(2.0))
    if name == "tv":
        return 1.0 - a
    raise KeyError(name)


def divergence(name: DivergenceName | torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """D(p, q) by name, over the last dimension: [..., vocab] × [..., vocab] -> [...]. A 0-dim
    int64 device tensor names it by its index in DIVERGENCE_NAMES: all four are computed, and
    it selects one on the device.

    Raises:
        KeyError: unknown divergence name.
    """
    if isinstance(name, torch.Tensor):
        return selected(name, [DIVERGENCES[each](p.float(), q.float()) for each in DIVERGENCE_NAMES])
    return DIVERGENCES[name](p.float(), q.float())
