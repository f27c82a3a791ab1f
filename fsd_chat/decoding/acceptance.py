"""Acceptance rules: which draft tokens to keep, the token the target adds after them, and what each
emitted token costs.

Rules (Holsman, Huang, Dhingra, "Fuzzy Speculative Decoding", ACL Findings 2025, §3):

- `exact`: standard speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023):
  accept x̃_i iff u_i < p_i(x̃_i) / q_i(x̃_i), u_i ~ U[0, 1); greedy: iff x̃_i = argmax p_i. The
  strict test has the same law (P(u < a) = a for u ~ U[0, 1)) and never accepts a token the
  target cannot emit: with u ≤ p/q, a draw u = 0 (which `torch.rand` can return) would accept
  x̃_i with p_i(x̃_i) = 0, a token top-k or top-p removed, as `draft-exact` at cost 0.
  After a rejection the correction is drawn from norm(max(0, p − q)). Lossless.
- `fuzzy` (default): a position with D(p_i°, q_i°) ≤ T accepts its draft token whenever the target
  can emit it (p_i(x̃_i) > 0); the other positions take the exact test.
- `pure` (the paper's released code): as `fuzzy`, but a position with D > T rejects, and every
  correction is drawn from p.
- `mixture`: exact speculative sampling against r_i = (1 − λ_i)·p_i + λ_i·q̄_i, q̄_i = q_i
  restricted to p_i's support and renormalised, with the largest λ_i ∈ [0, 1] such that
  KL(r_i ‖ p_i) ≤ T (see `mixture_weight`). Greedy: see below. Every token's cost is ≤ T. It is the per-position form
  of transformers' static ensemble (`assistant_ensemble_weight` w, transformers ≥ 5.23), which
  verifies against (1 − λ)p + λq with one fixed λ = 1 − w at every position, whatever that costs
  there; `mixture` picks each position's λ_i, the largest within the budget T.

At T = 0 every rule is `exact` (lossless), `pure` included.

**Greedy.** Every relaxed rule (`fuzzy`, `pure`, `mixture`) accepts x̃_i iff its regret
log p_i(argmax p_i) − log p_i(x̃_i) ≤ T (so the three coincide; argmax p_i has regret 0). The
draft token is deterministic, so the regret is the very cost the emitted token is charged: T is a
per-token cost bound in nats, and each step of the dial admits tokens whose log-probability is
within T of the target's choice. D(p_i, q_i) would be dead over most of the dial: a greedy lookup
proposes a point mass, and JS(p, δ_x̃) ≤ T holds only once p(x̃) is above about ½, where x̃ is
already the argmax, until T reaches about 0.22 nats (docs/decoding.md, "The dial's scale").

**Truncated sampling (top-k, top-p, min-p).** p and q are the laws after truncation, and they may
have different supports: q can put mass on tokens p excludes, and KL(p‖q), KL(q‖p) and every
mixture (1 − λ)p + λq then have infinite cost. The rules are built so that this never happens:

- Speculative sampling turns proposals x̃ ~ q into tokens of *any* law r: accept with
  min(1, r(x̃)/q(x̃)), else draw from norm(max(0, r − q)); the emitted token has law r exactly
  (Leviathan et al. 2023, Appendix A.1, whose proof uses nothing of r but that it is a law;
  Chen et al. 2023, Theorem 1). `mixture` aims at r = (1 − λ)p + λq̄, whose support is p's, so
  KL(r ‖ p) is finite and λ > 0 is possible whenever q has any mass on p's support. Its test
  contains the exact one: on p's support q̄ ≥ q, so u·q ≤ p implies u·q ≤ r.
- `fuzzy` and `pure` compare the models' *untruncated* laws p°, q° (after temperature only):
  truncation is a sampling choice, not a property of the models, and KL-type divergences between
  laws with different supports are infinite. T therefore means what it means without truncation.
  A fuzzy position emits x̃ when p(x̃) > 0, else the correction c (norm(max(0, p − q)); `pure`: p):
  its law is r = q·1[p > 0] + q(p = 0)·c, supported on p's support, so its cost is finite.

**Labels.** A position is *relaxed* when the rule's relaxed test decides it (sampling: D° ≤ T
under `fuzzy`/`pure`, a mixture whose law differs from p under `mixture`; greedy: an accepted token
other than argmax p). A draft token accepted at a relaxed position whose law r departs from p
(cost > 0, costs up to COST_FLOOR being rounding and counted as 0) is `draft-fuzzy`, even when
the exact coin would also have passed; every other accepted draft token is `draft-exact` and costs
exactly 0 (+0.0). So a relaxed position whose law is p
after all (a lookup token the truncated p holds with probability 1, where −log p(x̃) = −0.0) is
`draft-exact`: `draft-fuzzy` ⇔ cost > 0, and `fuzzy_share` counts only tokens that cost something.

**Cost.** Every emitted token is drawn from some law r (the relaxed law above at a relaxed position,
the target's p otherwise); its cost is KL(r ‖ p) in nats, 0 whenever r = p. Greedy: the regret
log p(argmax p) − log p(x). By the chain rule of relative entropy (Cover & Thomas, *Elements of
Information Theory*, 2nd ed., Thm 2.5.3) the sum of the costs along a reply is an unbiased estimate
of the KL divergence of the decoder's law (tokens together with its own choices, such as which
positions were drafted) from the target's law; by the data-processing inequality (ibid., §2.8) that
bounds the KL divergence of the law of the text alone, with equality when each position's law is
determined by the text before it (e.g. 2-token replies). A relaxed position's cost is carried by the
token it emits, draft or correction.

**Point-mass proposals** (prompt lookup: q_i = δ(x̃_i), passed as q = None). Every rule keeps its
meaning and its exact cost, and its formulas need only a = p_i(x̃_i), never a one-hot row:

- `exact`: accept iff u < a; the residual norm(max(0, p − δ)) is p with x̃ removed, renormalised
  (p(y)/(1 − a) for y ≠ x̃). Lossless, as for any q.
- D(p, δ) (`divergence.against_point_mass`): kl = +inf unless a = 1; reverse-kl = −log a;
  js = log 2 + ½[a log a − (1 + a) log(1 + a)]; tv = 1 − a. All but kl are decreasing in a, so
  `fuzzy` and `pure` with D ≤ T accept exactly when a ≥ a_T (a_T = e^−T for reverse-kl, 1 − T for
  tv, the root of the js formula for js). With kl the divergence test never passes (a = 1 only,
  where the exact test accepts anyway): `fuzzy` is `exact` at every T and `pure` accepts nothing
  but sure tokens, so the dial does nothing; use reverse-kl, js or tv with a lookup.
- A `fuzzy`/`pure` position with D ≤ T emits x̃ for sure (law δ, when a > 0): cost
  KL(δ‖p) = −log a ≤ −log a_T. Otherwise its law is the correction's (`fuzzy`: residual after an
  exact test; `pure`: p), cost 0 as before.
- `mixture`: r = (1 − λ)p + λδ; accept iff u < (1 − λ)a + λ; the residual norm(max(0, r − δ)) is
  again p without x̃ renormalised. KL(r‖p) = (1 − λ)(1 − a) log(1 − λ) + r(x̃) log(r(x̃)/a),
  r(x̃) = a + λ(1 − a), is a function of (λ, a), increasing in λ (its derivative is
  (1 − a)[log(r(x̃)/a) − log(1 − λ)] ≥ 0), +inf for λ > 0 at a = 0: the KL of the two-outcome laws
  on {x̃, the rest}, so `point_mass_mixture_weight` is `mixture_weight` on those two outcomes.
- greedy: unchanged (the tests read p alone: argmax, regret log p(argmax) − log a).

Each position is tested at once (vectorised over the k draft positions); the accepted prefix ends at
the first rejection, and the whole verdict reaches the host in one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fsd_chat.decoding.divergence import DivergenceName, against_point_mass, divergence, kl, selected
from fsd_chat.decoding.events import Origin
from fsd_chat.decoding.sampling import argmax, draw, exponential_noise, non_finite, non_finite_error
from fsd_chat.decoding.settings import RULES, Rule, SamplingConfig

COST_FLOOR = 1e-6
"""Costs up to this, in nats, are 0: a relaxed law that equals p (q ≤ p wherever p is positive
makes the fuzzy rule's law p itself) comes out within about 1e-7 nats of it, the rounding of laws
computed in float32, and on either side of 0 depending on the order of the sums (compiled or
eager). A real departure costs far more (the dial's thresholds start at 0.01 nats)."""
NEWTON_STEPS = 12
"""Safeguarded Newton steps of `mixture_weight`; measured on truncated and untruncated laws of the
offline pair, they reach the root to float32 precision."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of verifying one block of k draft tokens.

    Attributes:
        accepted: n, the number of draft tokens accepted (the prefix before the first rejection).
        next_token: The target's token (correction or bonus), shape [1] int64 on the device, for
            the decoder to write into its buffer without a host-to-device copy.
        token_ids: The n accepted draft tokens followed by the target's token (n + 1 ids).
        exact: Per draft position, whether a draft token accepted there is `draft-exact`: its law
            is the target's (the exact test decided, or the relaxed law costs 0; module docstring,
            Labels); length k.
        divergences: Per draft position, D(p_i°, q_i°) of the untruncated laws, in the
            divergence's units; length k.
        costs: Cost in nats of each of the n + 1 emitted tokens (see the module docstring).
        next_origin: TARGET_RESAMPLED (correction after a rejection) or TARGET_BONUS (n = k).
    """

    accepted: int
    next_token: torch.Tensor
    token_ids: list[int]
    exact: list[bool]
    divergences: list[float]
    costs: list[float]
    next_origin: Origin

    def origins(self) -> list[Origin]:
        """Origins of the n accepted draft tokens followed by the target's token (n + 1 items)."""
        drafted = [Origin.DRAFT_EXACT if e else Origin.DRAFT_FUZZY for e in self.exact[: self.accepted]]
        return [*drafted, self.next_origin]


@dataclass(frozen=True, slots=True)
class Judgement:
    """Each draft position of a block judged on its own, as device tensors (see `judge`).

    Attributes:
        accept: Whether the position's draft token passes the rule, shape [k] bool.
        draft_exact: Whether a draft token accepted there is `draft-exact` (not a relaxed position
            whose law departs from p), shape [k] bool.
        divergences: D(p_i°, q_i°) of the untruncated laws, shape [k], in the divergence's units.
        costs: Cost in nats of the token the position emits (draft token or correction), shape [k];
            ≥ 0, and +0.0 where the law is p.
        candidates: The target's token after a rejection at each position, then the bonus token
            after k acceptances, shape [k + 1] int64.
    """

    accept: torch.Tensor
    draft_exact: torch.Tensor
    divergences: torch.Tensor
    costs: torch.Tensor
    candidates: torch.Tensor


def restrict(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """q̄: q restricted to p's support and renormalised, [..., vocab] -> [..., vocab]; p itself in
    rows where q has no mass on p's support (so that aiming at q̄ there changes nothing)."""
    on_support = torch.where(p > 0, q, 0.0)
    mass = on_support.sum(-1, keepdim=True)
    return torch.where(mass > 0, on_support / mass.clamp_min(torch.finfo(mass.dtype).tiny), p)


def mixture_weight(
    p: torch.Tensor, q: torch.Tensor, budget: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest λ ∈ [0, 1] with KL((1 − λ)p + λq ‖ p) ≤ budget, per row, and that KL.

    `verify` passes q̄ = `restrict(q, p)` as q, whose support is p's, so that λ > 0 is possible.

    f(λ) = KL(r_λ ‖ p) is convex and increasing on [0, 1] with f(0) = f'(0) = 0. The root of
    f(λ) = budget is bracketed by [lo, hi] (f(lo) ≤ budget < f(hi)), and each step takes Newton's
    iterate when it falls inside the bracket, else the bracket's midpoint (safeguarded Newton; Press
    et al., *Numerical Recipes*, 3rd ed., §9.4). By convexity the chord through (0, 0) and
    (λ, f(λ)) crosses the budget at λ·budget / f(λ), below the root: it raises `lo` after every
    step that overshoots. `lo` is returned, so the bound holds for any number of steps. Rows where
    q has mass outside p's support (f = +inf for every λ > 0) get λ = 0.

    Args:
        p: Target probabilities, shape [..., vocab].
        q: Draft probabilities, shape [..., vocab].
        budget: The per-token KL budget T in nats (> 0; any finite value, or inf: λ = 1 past
            what any law of p's dtype can spend; a 0-dim device tensor in a captured step).

    Returns:
        (λ, cost): both shape [...]; cost = KL(r_λ ‖ p) ≤ budget (up to float32 rounding), in nats.
    """
    # Saturate: f(λ) ≤ f(1) = Σ q log(q/p) ≤ max −log p(x) ≤ −log(the dtype's least positive value),
    # so a budget past twice that (rounding) gives λ = 1 wherever q is inside p's support. Any finite
    # budget then works: 1e100 would overflow float32 in the steps below.
    finfo = torch.finfo(p.dtype)
    ceiling = -2.0 * math.log(finfo.tiny * finfo.eps)
    # On the device for a device budget: `min` would read it on the host.
    budget = budget.clamp_max(ceiling) if isinstance(budget, torch.Tensor) else min(budget, ceiling)
    inside = ~((q > 0) & (p == 0)).any(-1)
    log_p = torch.where(p > 0, p.log(), 0.0)
    diff = q - p
    tiny = torch.finfo(p.dtype).tiny

    def kl_and_slope(lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = p + lam.unsqueeze(-1) * diff
        # Clamped rather than zeroed where r = 0 < p (q = 0 there, λ = 1): the slope is then large,
        # as it should be, not an underestimate that would throw Newton below the root.
        log_ratio = torch.where(p > 0, r.clamp_min(tiny).log() - log_p, 0.0)
        return (r * log_ratio).sum(-1).clamp_min(0.0), (diff * log_ratio).sum(-1)

    lo = torch.zeros(p.shape[:-1], device=p.device)
    hi = torch.where(inside, 1.0, 0.0)
    lam = hi
    for _ in range(NEWTON_STEPS):
        f, slope = kl_and_slope(lam)
        over = f > budget
        lo = torch.where(over, torch.maximum(lo, lam * budget / f.clamp_min(budget)), lam)
        hi = torch.where(over, lam, hi)
        newton = lam - (f - budget) / torch.where(slope > 0, slope, 1.0)
        bracketed = (newton > lo) & (newton < hi) & (slope > 0)
        lam = torch.where(bracketed, newton, (lo + hi) / 2)
    f, _ = kl_and_slope(lam)
    lam = torch.where(f <= budget, lam, lo)
    cost, _ = kl_and_slope(lam)
    return lam, cost


def point_mass_mixture_weight(
    p_x: torch.Tensor, budget: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mixture_weight` against a point mass q = δ_x (a prompt-lookup proposal), from a = p(x) alone.

    r = (1 − λ)p + λδ_x moves mass only between x and the rest, in proportion, so KL(r ‖ p) =
    r(x) log(r(x)/a) + (1 − λ)(1 − a) log(1 − λ), r(x) = a + λ(1 − a): the KL of the two-outcome
    laws [r(x), 1 − r(x)] and [a, 1 − a]. The solve is `mixture_weight`'s on those two outcomes
    (p = [a, 1 − a], q = [1, 0]). a = 0 gives λ = 0 (x is outside p's support); a = 1 gives λ = 1.

    Args:
        p_x: a = p(x̃) per draft position, shape [k].
        budget: The per-token KL budget T in nats (> 0).

    Returns:
        (λ, cost): both shape [k]; cost = KL(r_λ ‖ p) ≤ budget, in nats.
    """
    a = p_x.clamp(0.0, 1.0)
    two = torch.stack([a, 1 - a], -1)
    # Not `delta[..., 0] = 1.0`: a Python value written into a tensor is a host-to-device copy,
    # which a CUDA graph's capture refuses (`step_graph`).
    delta = torch.stack([torch.ones_like(a), torch.zeros_like(a)], -1)
    return mixture_weight(two, delta, budget)


def _residual(aim: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """norm(max(0, aim − q)) per row, [k, vocab]: the law of the correction after rejecting a draw of
    q in speculative sampling towards `aim`; `aim` itself where the residual has no mass (then
    aim = q, which accepts every draw, up to rounding). q = None: point masses at `draft_ids`,
    whose residual is `aim` with x̃ removed."""
    residual = aim.scatter(-1, draft_ids.unsqueeze(-1), 0.0) if q is None else (aim - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), aim)


def judge(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_ids: torch.Tensor,
    *,
    rule: Rule | torch.Tensor,
    divergence_name: DivergenceName | torch.Tensor,
    threshold: float | torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    p_full: torch.Tensor | None = None,
    q_full: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    divergences: torch.Tensor | None = None,
) -> Judgement:
    """Judge each draft position on its own: whether its draft token passes, the target's token
    after a rejection there, and what the emitted token costs (`verify` then keeps the prefix up to
    the first rejection). The positions are independent given their rows, so k rows that repeat one
    (p, q) pair are k independent draws of that position's rule: the statistical tests use this.

    Args:
        p: Target probabilities, shape [k + 1, vocab]: rows 0..k-1 at the draft positions, row k
            for the bonus token.
        q: Draft probabilities the draft tokens were drawn from, shape [k, vocab]; None when
            each draft token is a point mass, q_i = δ(x̃_i) (prompt lookup; module docstring).
        draft_ids: The draft tokens, shape [k] int64, on p's device.
        rule: "exact", "fuzzy", "pure" or "mixture"; or, in a captured step, its index in RULES
            as a 0-dim int64 device tensor (with a device `threshold`): every rule is judged and
            the device selects one (`_judge_on_device`), so a new rule never captures again.
        divergence_name: The divergence D used by "fuzzy" and "pure" (reported under every rule),
            or its index in `divergence.DIVERGENCE_NAMES` as a 0-dim int64 device tensor.
        threshold: T ≥ 0: greedy, nats of regret per token under every relaxed rule; sampling,
            in the divergence's units for "fuzzy"/"pure" (math.inf accepts every draft token the
            target's truncation keeps), nats of KL per token for "mixture". A 0-dim float32
            device tensor goes with a device `rule`, which selects `exact` where T = 0.
        sampling: Sampling settings (greedy: argmax tests and corrections).
        generator: Source of the uniform draws u_i and of the correction draw (None when both
            are given).
        p_full: The target's untruncated probabilities (temperature only), [k + 1, vocab] or
            [k, vocab], which D compares; default p (right when `sampling` does not truncate).
        q_full: The draft's untruncated probabilities, [k, vocab]; default q.
        uniforms: The exact test's draws u_i ∈ [0, 1), shape [k] on p's device; default drawn
            from `generator` (given by tests that must reach u = 0, and by `verify`).
        noise: The correction draw's exponential race, shape [k + 1, vocab]
            (`sampling.exponential_noise`); default drawn from `generator`.
        divergences: D(p°, q°) per draft position, shape [k], when already computed (the device
            path judges every rule over one computation).

    Returns:
        The `Judgement`, on p's device; nothing is read back to the host.
    """
    if isinstance(rule, torch.Tensor):
        return _judge_on_device(
            p,
            q,
            draft_ids,
            rule,
            divergence_name,
            threshold,
            sampling,
            generator,
            p_full,
            q_full,
            uniforms,
            noise,
        )
    k = draft_ids.shape[0]
    positions = torch.arange(k, device=p.device)
    p_draft = p[:k]
    p_x = p_draft[positions, draft_ids]
    # Under truncation the divergences compare the untruncated laws (module docstring).
    p_compared = (p if p_full is None else p_full)[:k]
    if q is None:
        q_x = torch.ones_like(p_x)
        div = (
            against_point_mass(divergence_name, p_x if p_full is None else p_compared[positions, draft_ids])
            if divergences is None
            else divergences
        )
    else:
        q_x = q[positions, draft_ids]
        div = (
            divergence(divergence_name, p_compared, q if q_full is None else q_full)
            if divergences is None
            else divergences
        )
    # At T = 0 every rule is the exact one (`pure` included, whose own test would accept nothing).
    # (A device threshold goes with a device rule: `_judge_on_device` selects `exact` at T = 0.)
    if not isinstance(threshold, torch.Tensor) and threshold <= 0:
        rule = "exact"
    # Per position: whether the relaxed test decides it, and the cost of the token it emits; both
    # stay zero under `exact`.
    relaxed = torch.zeros(k, dtype=torch.bool, device=p.device)
    costs = torch.zeros(k, device=p.device)
    if sampling.greedy:
        # The target's choice at every position, corrections and bonus alike (one argmax).
        candidates = argmax(p)
        best = candidates[:k]
        exact = draft_ids == best
        accept = exact
        if rule != "exact":
            # log p(argmax) − log p(x̃): +inf for a token the target's truncation removed.
            regret = p_draft[positions, best].log() - p_x.log()
            # Every relaxed rule tests the regret, the cost of the token it would emit: D(p, q) of
            # a greedy draft is dead over most of the dial (module docstring, Greedy).
            passes = regret <= threshold
            accept = passes if rule == "pure" else exact | passes
            # Deterministic: the draft token is the target's own choice when it is the argmax (no
            # cost, `draft-exact`), else the relaxed test chose it. A rejected position's
            # correction is the target's argmax (regret 0).
            relaxed = passes & ~exact
            costs = torch.where(passes, regret, costs)
    else:
        u = torch.rand(k, generator=generator, device=p.device) if uniforms is None else uniforms
        # u < p/q written without the division (q(x̃) > 0 since x̃ was drawn from q); strict, so
        # that u = 0 rejects a token with p(x̃) = 0 (module docstring).
        exact = u * q_x < p_x
        accept = exact
        corrections = _residual(p_draft, q, draft_ids)
        if rule == "mixture":
            if q is None:
                # q̄ = δ(x̃) on p's support (λ = 0 where p(x̃) = 0): r = (1 − λ)p + λδ(x̃).
                lam, costs = point_mass_mixture_weight(p_x, threshold)
                aim = p_draft * (1 - lam).unsqueeze(-1)
                aim = aim.scatter_add(-1, draft_ids.unsqueeze(-1), lam.unsqueeze(-1))
            else:
                q_bar = restrict(q, p_draft)
                lam, costs = mixture_weight(p_draft, q_bar, threshold)
                aim = p_draft + lam.unsqueeze(-1) * (q_bar - p_draft)
            # Exact speculative sampling towards the mixture: it accepts whatever the exact test does.
            accept = u * q_x < aim[positions, draft_ids]
            relaxed = costs > 0
            corrections = _residual(aim, q, draft_ids)
        elif rule != "exact":
            relaxed = div <= threshold
            if rule == "pure":
                corrections = p_draft
                accept = relaxed & (p_x > 0)
            else:
                accept = exact | (relaxed & (p_x > 0))
            if q is None:
                # A relaxed position emits x̃ for sure (law δ, cost −log p(x̃)) unless p(x̃) = 0,
                # where the draft token is rejected and the correction is p's own law: cost 0.
                costs = torch.where(relaxed & (p_x > 0), -p_x.log(), costs)
            else:
                # The law of a relaxed position: q on the target's support, the rest of q's mass
                # moved to the correction law (the draft token is rejected exactly when it falls
                # outside).
                on_support = torch.where(p_draft > 0, q, 0.0)
                law = on_support + (1 - on_support.sum(-1, keepdim=True)).clamp_min(0.0) * corrections
                costs = torch.where(relaxed, kl(law, p_draft), costs)
        candidates = draw(torch.cat([corrections, p[k:]]), sampling, generator, noise)
    # KL ≥ 0, but where r = p its formulas round to −0.0 (−log 1) or to a few ulps of the laws'
    # float32 either side of 0 (COST_FLOOR).
    costs = torch.where(costs > COST_FLOOR, costs, 0.0)
    # `draft-fuzzy` only where the relaxed law departs from p (module docstring, Labels).
    return Judgement(accept, ~(relaxed & (costs > 0)), div, costs, candidates)


def _judge_on_device(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_ids: torch.Tensor,
    rule: torch.Tensor,
    divergence_name: DivergenceName | torch.Tensor,
    threshold: float | torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    p_full: torch.Tensor | None,
    q_full: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> Judgement:
    """`judge` with the rule chosen on the device (`rule`: its index in RULES, 0-dim int64): every
    rule is judged, with the same draws and one computation of the divergences, and the rule's
    judgement (`exact`'s where T ≤ 0) is selected elementwise. The draws are shared: only the
    selected rule's verdict is used, and it sees them as its own. Eagerly this costs the four
    rules' work, which is why the eager decoders pass the rule by name."""
    if not sampling.greedy:
        # `verify`'s order, so that one seed draws the same either way.
        uniforms = (
            torch.rand(draft_ids.shape[0], generator=generator, device=p.device)
            if uniforms is None
            else uniforms
        )
        noise = exponential_noise(p, generator) if noise is None else noise
    judged: list[Judgement] = []
    for name in RULES:  # "exact" first: the others reuse its divergences
        judged.append(
            judge(
                p,
                q,
                draft_ids,
                rule=name,
                divergence_name=divergence_name,
                threshold=threshold,
                sampling=sampling,
                generator=generator,
                p_full=p_full,
                q_full=q_full,
                uniforms=uniforms,
                noise=noise,
                divergences=judged[0].divergences if judged else None,
            )
        )
    pick = torch.where(torch.as_tensor(threshold, device=p.device) > 0, rule, 0)
    fields = (selected(pick, [getattr(j, field) for j in judged]) for field in _JUDGEMENT_FIELDS)
    return Judgement(*fields)


_JUDGEMENT_FIELDS = ("accept", "draft_exact", "divergences", "costs", "candidates")
"""`Judgement`'s fields in order, written out: torch.compile cannot trace `dataclasses.fields` of
a class, and a captured step runs through here."""


_GREEDY, _SAMPLED = SamplingConfig(), SamplingConfig(temperature=1.0)
"""What `decide` tells `judge` of the sampling settings: greedy or not."""


def decide(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_ids: torch.Tensor,
    uniforms: torch.Tensor | None,
    noise: torch.Tensor | None,
    *,
    rule: Rule | torch.Tensor,
    divergence_name: DivergenceName | torch.Tensor,
    threshold: float | torch.Tensor,
    greedy: bool,
    p_full: torch.Tensor | None = None,
    q_full: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor part of `verify`, with its random draws given (a compiled function cannot take
    a generator): `judge`, the accepted count n (on the device), the target's token at n, and
    the non-finite flags, packed into one float64 vector for one transfer to the host.

    Args:
        p, q, draft_ids, rule, divergence_name, threshold, p_full, q_full: See `judge`.
        greedy: Argmax tests and corrections (`SamplingConfig.greedy`): the rule needs nothing
            else of the sampling settings, whose seed changes from reply to reply (a compiled
            function given them would be guarded on them, and compiled again).
        uniforms: The exact test's draws u_i, shape [k] (None when greedy).
        noise: The correction draw's exponential race, shape [k + 1, vocab] (None when greedy).

    Returns:
        (block, next_token). block: shape [2k + 1 (k + 1 with q None) + 2 + 4k] float64, the flags
        of p's k + 1 rows (and of q's k rows), n, the target's token, then per position the draft
        token, draft-exact, the divergence and the cost (`verify` reads them back in this order).
        next_token: the target's token, shape [1] int64 (`Verdict.next_token`).
    """
    judged = judge(
        p,
        q,
        draft_ids,
        rule=rule,
        divergence_name=divergence_name,
        threshold=threshold,
        sampling=_GREEDY if greedy else _SAMPLED,
        generator=None,
        p_full=p_full,
        q_full=q_full,
        uniforms=uniforms,
        noise=noise,
    )
    k = draft_ids.shape[0]
    n = judged.accept.long().cumprod(0).sum()
    # Only the correction at position n (or the bonus) is used; drawing all k + 1 keeps n on the
    # device. The other draws are independent of everything emitted, so the law is unchanged.
    next_token = judged.candidates.index_select(0, n.view(1))
    # The verdict uses rows 0..n alone: a NaN row after a rejected token (the target overflowing
    # on a token it then refuses) ends nothing.
    used = torch.arange(k + 1, device=p.device) <= n
    # Per law, a flag per row (k + 1 for p, k for q), read with the rest: no reduction to one here.
    flags = [non_finite(p) & used] if q is None else [non_finite(p) & used, non_finite(q) & used[:k]]
    # One concatenation, then one conversion: every entry is exact in the promoted type (flags, ids
    # and counts below 2^24 in float32; the laws' own floats).
    block = torch.cat(
        [
            *flags,
            n.view(1),
            next_token,
            draft_ids,
            judged.draft_exact,
            judged.divergences,
            judged.costs,
        ]
    ).double()
    return block, next_token


def compile_failure(exc: BaseException) -> str:
    """A failed compilation in one line: the exception's type and its message's first line
    (torch.compile's run to dozens of lines of context)."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def verdict_flags(k: int, point_masses: bool) -> int:
    """How many non-finite flags open `decide`'s block (`acceptance.read_verdict`)."""
    return k + 1 if point_masses else 2 * k + 1


Decide = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""`decide`, or a compiled form of it (`CompiledDecision`)."""


class CompiledDecision:
    """`decide` compiled whole (torch.compile, `fullgraph`; CUDA graphs on CUDA): the acceptance
    rule's hundred-odd small operators (divergence, tests, residual laws, the race), each a kernel
    launch on a GPU and microseconds of dispatch on a CPU, as a few fused kernels. Measured on this
    CPU (one thread; fuzzy js, sampled, k 5, 512-token vocabulary; 5 rounds of 300 calls): `verify`
    takes 0.32–0.50 ms compiled against 0.59–0.92 ms eagerly.

    Dynamic shapes (`dynamic=True`): every draft length k shares one compiled graph (CUDA graphs
    still record one a k), and the threshold T is an input rather than a constant, so the dial
    moves it without recompiling (with static shapes each k and each T compiled anew, 12 s each on
    this CPU). A graph is compiled per rule, greedy or sampled, point-mass or model proposals, and
    truncation: 35 to 70 s each on one CPU core. If compilation fails, `decide` runs eagerly from
    then on and `compile_error` says why.

    Args:
        device: Where the laws live.
    """

    compile_error: str | None = None
    """Why the rule runs eagerly (None: it does not)."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._compiled = torch.compile(
            decide, mode="reduce-overhead" if cuda else None, fullgraph=True, dynamic=True
        )

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`decide(*args, **kwargs)`, compiled where it can be."""
        if self.compile_error is None:
            try:
                return self._compiled(*args, **kwargs)
            except Exception as exc:  # compilation failures come in many types; fall back to eager
                self.compile_error = compile_failure(exc)
        return decide(*args, **kwargs)


def verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_ids: torch.Tensor,
    *,
    rule: Rule,
    divergence_name: DivergenceName,
    threshold: float,
    sampling: SamplingConfig,
    generator: torch.Generator,
    p_full: torch.Tensor | None = None,
    q_full: torch.Tensor | None = None,
    decision: Decide = decide,
) -> Verdict:
    """Accept a prefix of the draft block, choose the target's next token, and cost each token.
    The arguments are `judge`'s; the draft positions are judged there, within `decision`
    (`decide`, or a `CompiledDecision`), after the step's random draws are made here.

    Returns:
        The `Verdict`, read back from the device in one transfer at the end: the call's only host
        synchronisation. Nothing before it reads a device value (n stays on the device, and the
        draws are exponential races, which assert nothing on the device; see `sampling.draw`).
        Counted on the CPU, reads from torch's C++ code included, by `tests/test_host_syncs.py`,
        and on a GPU by `make gpu-check`.

    Raises:
        NonFiniteError: p or q holds a NaN (non-finite logits), flagged in the same transfer.
    """
    k = draft_ids.shape[0]
    uniforms = noise = None
    if not sampling.greedy:
        # In `judge`'s order, so that a seed gives the same reply compiled or not.
        uniforms = torch.rand(k, generator=generator, device=p.device)
        noise = exponential_noise(p, generator)
    packed, next_token = decision(
        p,
        q,
        draft_ids,
        uniforms,
        noise,
        rule=rule,
        divergence_name=divergence_name,
        threshold=threshold,
        greedy=sampling.greedy,
        p_full=p_full,
        q_full=q_full,
    )
    return read_verdict(packed.tolist(), k, point_masses=q is None, next_token=next_token)


def read_verdict(block: list[float], k: int, *, point_masses: bool, next_token: torch.Tensor) -> Verdict:
    """The `Verdict` of `decide`'s block once on the host (`verify`, and a captured step's copy).

    Args:
        block: `decide`'s block as Python floats.
        k: The draft length.
        point_masses: The proposal was point masses (q None: no flags of q's rows).
        next_token: The target's token on the device (`Verdict.next_token`).

    Raises:
        NonFiniteError: p or q holds a NaN (non-finite logits), flagged in the block.
    """
    width = k + 1 if point_masses else 2 * k + 1
    flagged, block = block[:width], block[width:]
    if any(flagged):
        raise non_finite_error("target" if any(flagged[: k + 1]) else "draft")
    accepted, chosen = int(block[0]), int(block[1])
    ids, passed = block[2 : 2 + k], block[2 + k : 2 + 2 * k]
    divs, position_costs = block[2 + 2 * k : 2 + 3 * k], block[2 + 3 * k :]
    return Verdict(
        accepted=accepted,
        next_token=next_token,
        token_ids=[*(int(i) for i in ids[:accepted]), chosen],
        exact=[bool(e) for e in passed],
        divergences=divs,
        costs=[*position_costs[:accepted], position_costs[accepted] if accepted < k else 0.0],
        next_origin=Origin.TARGET_BONUS if accepted == k else Origin.TARGET_RESAMPLED,
    )
