"""Acceptance rules: which draft tokens to keep, the token the target adds after them, and what each
emitted token costs.

Rules (Holsman, Huang, Dhingra, "Fuzzy Speculative Decoding", ACL Findings 2025, §3):

- `exact`: standard speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023):
  accept x̃_i iff u_i ≤ min(1, p_i(x̃_i) / q_i(x̃_i)), u_i ~ U(0, 1); greedy: iff x̃_i = argmax p_i.
  After a rejection the correction is drawn from norm(max(0, p − q)). Lossless.
- `fuzzy` (default): accept iff the exact test passes or D(p_i, q_i) ≤ T. T = 0 is `exact`.
- `pure` (the paper's released code): accept iff D(p_i, q_i) ≤ T; the correction is drawn from p.
- `mixture`: exact speculative sampling against r_i = (1 − λ_i)·p_i + λ_i·q_i with the largest
  λ_i ∈ [0, 1] such that KL(r_i ‖ p_i) ≤ T (see `mixture_weight`): accept iff
  u_i·q_i(x̃_i) ≤ (1 − λ_i)·p_i(x̃_i) + λ_i·q_i(x̃_i); the residual after a rejection is
  norm(max(0, r_i − q_i)) = norm(max(0, p_i − q_i)), the exact rule's. Greedy: accept iff the
  log-probability regret log p_i(argmax p_i) − log p_i(x̃_i) ≤ T. Every token's cost is ≤ T.

A draft token that the target's own truncation removed (p_i(x̃_i) = 0 after top-k / top-p) is never
accepted by a relaxed test: its cost would be infinite.

**Cost.** Every emitted token is drawn from some law r (the draft's q at a fuzzy position, the
mixture above, the target's p otherwise); its cost is KL(r ‖ p) in nats, 0 whenever r = p. Greedy:
the regret log p(argmax p) − log p(x). By the chain rule of relative entropy (Cover & Thomas,
*Elements of Information Theory*, 2nd ed., Thm 2.5.3) the sum of the costs along a reply is an
unbiased estimate of the KL divergence of the decoder's law (tokens together with its own choices,
such as which positions were drafted) from the target's law; by the data-processing inequality
(ibid., §2.8) that bounds the KL divergence of the law of the text alone, with equality when each
position's law is determined by the text before it (e.g. 2-token replies).

Under `fuzzy` and `pure`, a position with D(p, q) ≤ T emits a token of law q (the draft token is
always accepted), or, when q has mass outside the target's support, r = q·1[p > 0] + q(p = 0)·c with
c the correction law (the draft token is rejected exactly when it falls outside). Under `exact`, and
whenever T = 0, every cost is exactly 0 by construction.

Each position is tested at once (vectorised over the k draft positions); the accepted prefix ends at
the first rejection, and the whole verdict reaches the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsd_chat.decoding.divergence import DivergenceName, divergence, kl
from fsd_chat.decoding.events import Origin
from fsd_chat.decoding.sampling import draw
from fsd_chat.decoding.settings import Rule, SamplingConfig

NEWTON_STEPS = 8
"""Newton iterations of `mixture_weight`; from λ = 1 they reach the root to float32 precision."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of verifying one block of k draft tokens.

    Attributes:
        accepted: n, the number of draft tokens accepted (the prefix before the first rejection).
        token_ids: The n accepted draft tokens followed by the target's token (n + 1 ids).
        exact: Per draft position, whether the exact test passed; length k.
        divergences: Per draft position, D(p_i, q_i) in the divergence's units; length k.
        costs: Cost in nats of each of the n + 1 emitted tokens (see the module docstring).
        next_origin: TARGET_RESAMPLED (correction after a rejection) or TARGET_BONUS (n = k).
    """

    accepted: int
    token_ids: list[int]
    exact: list[bool]
    divergences: list[float]
    costs: list[float]
    next_origin: Origin

    def origins(self) -> list[Origin]:
        """Origins of the n accepted draft tokens followed by the target's token (n + 1 items)."""
        drafted = [Origin.DRAFT_EXACT if e else Origin.DRAFT_FUZZY for e in self.exact[: self.accepted]]
        return [*drafted, self.next_origin]


def mixture_weight(p: torch.Tensor, q: torch.Tensor, budget: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest λ ∈ [0, 1] with KL((1 − λ)p + λq ‖ p) ≤ budget, per row, and that KL.

    f(λ) = KL(r_λ ‖ p) is convex with f(0) = f'(0) = 0, so Newton's method from λ = 1 descends onto
    the root from above, and the chord through (0, 0) and (λ, f(λ)) crosses the budget at
    λ·budget / f(λ), a point below the root: that point is returned, so the bound holds for any
    number of iterations. Rows where q has mass outside p's support (f = +inf for every λ > 0)
    get λ = 0.

    Args:
        p: Target probabilities, shape [..., vocab].
        q: Draft probabilities, shape [..., vocab].
        budget: The per-token KL budget T in nats (> 0).

    Returns:
        (λ, cost): both shape [...]; cost = KL(r_λ ‖ p) ≤ budget (up to float32 rounding), in nats.
    """
    inside = ~((q > 0) & (p == 0)).any(-1)
    log_p = torch.where(p > 0, p.log(), 0.0)
    diff = q - p

    def kl_and_slope(lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = p + lam.unsqueeze(-1) * diff
        log_ratio = torch.where(r > 0, r.clamp_min(torch.finfo(r.dtype).tiny).log() - log_p, 0.0)
        return (r * log_ratio).sum(-1).clamp_min(0.0), (diff * log_ratio).sum(-1)

    lam = torch.where(inside, 1.0, 0.0)
    for _ in range(NEWTON_STEPS):
        f, slope = kl_and_slope(lam)
        over = f > budget
        lam = torch.where(over, (lam - (f - budget) / torch.where(over, slope, 1.0)).clamp(0.0, 1.0), lam)
    f, _ = kl_and_slope(lam)
    lam = torch.where(f > budget, lam * budget / f.clamp_min(budget), lam)
    cost, _ = kl_and_slope(lam)
    return lam, cost


def _corrections(p: torch.Tensor, q: torch.Tensor, rule: Rule) -> torch.Tensor:
    """The law of the target's token after a rejection at each draft position, plus the bonus row.

    Returns [k + 1, vocab]: norm(max(0, p_i − q_i)) (p_i for `pure`, or where the residual has no
    mass, which a rejection rules out up to rounding), then p_{k+1}.
    """
    k = q.shape[0]
    if rule == "pure":
        return p
    residual = (p[:k] - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    rows = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p[:k])
    return torch.cat([rows, p[k:]])


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_ids: torch.Tensor,
    *,
    rule: Rule,
    divergence_name: DivergenceName,
    threshold: float,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> Verdict:
    """Accept a prefix of the draft block, choose the target's next token, and cost each token.

    Args:
        p: Target probabilities, shape [k + 1, vocab]: rows 0..k-1 at the draft positions, row k
            for the bonus token.
        q: Draft probabilities the draft tokens were drawn from, shape [k, vocab].
        draft_ids: The draft tokens, shape [k] int64, on p's device.
        rule: "exact", "fuzzy", "pure" or "mixture".
        divergence_name: The divergence D used by "fuzzy" and "pure" (reported under every rule).
        threshold: T ≥ 0: in the divergence's units for "fuzzy"/"pure" (math.inf accepts every
            draft token the target's truncation keeps); nats of KL (sampling) or of regret
            (greedy) per token for "mixture".
        sampling: Sampling settings (greedy: argmax tests and corrections).
        generator: Source of the uniform draws u_i and of the correction draw.

    Returns:
        The `Verdict`, read back from the device in one transfer at the end: the call's only host
        synchronisation. Nothing before it reads a device value (n stays on the device, and
        `torch.multinomial` has checked its input with device-side asserts since torch 2.5).
        Counted on the CPU, reads from torch's C++ code included, by `tests/test_host_syncs.py`,
        and on a GPU by `make gpu-check`.
    """
    k = draft_ids.shape[0]
    positions = torch.arange(k, device=p.device)
    p_draft = p[:k]
    p_x = p_draft[positions, draft_ids]
    q_x = q[positions, draft_ids]
    div = divergence(divergence_name, p_draft, q)
    relaxing = rule != "exact" and threshold > 0
    # The relaxed test of each rule (never passing under `exact` or at T = 0), and the cost of the
    # token each position emits; both stay zero unless the rule relaxes.
    relaxed = torch.zeros(k, dtype=torch.bool, device=p.device)
    costs = torch.zeros(k, device=p.device)
    if sampling.greedy:
        exact = draft_ids == p_draft.argmax(-1)
        if relaxing:
            # log p(argmax) − log p(x̃): +inf for a token the target's truncation removed.
            regret = p_draft.max(-1).values.log() - p_x.log()
            relaxed = (regret <= threshold) if rule == "mixture" else (div <= threshold) & (p_x > 0)
            # A relaxed acceptance costs its regret; the exact test's token and a rejected
            # position's correction are the target's argmax (regret 0).
            costs = torch.where(relaxed, regret, costs)
        candidates = p.argmax(-1)
    else:
        u = torch.rand(k, generator=generator, device=p.device)
        # u ≤ p/q written without the division; q(x̃) > 0 since x̃ was drawn from q.
        exact = u * q_x <= p_x
        corrections = _corrections(p, q, rule)
        if relaxing and rule == "mixture":
            lam, costs = mixture_weight(p_draft, q, threshold)
            # Exact sampling against (1 − λ)p + λq: it accepts whatever the exact test accepts.
            relaxed = u * q_x <= (1 - lam) * p_x + lam * q_x
        elif relaxing:
            fuzzy = div <= threshold
            relaxed = fuzzy & (p_x > 0)
            # The law of a fuzzy position: q on the target's support, the rest of q's mass moved to
            # the correction law (the draft token is rejected exactly when it falls outside).
            on_support = torch.where(p_draft > 0, q, 0.0)
            law = on_support + (1 - on_support.sum(-1, keepdim=True)).clamp_min(0.0) * corrections[:k]
            costs = torch.where(fuzzy, kl(law, p_draft), costs)
        candidates = draw(corrections, sampling, generator)
    accept = relaxed if rule == "pure" else exact | relaxed
    n = accept.long().cumprod(0).sum()
    # Only the correction at position n (or the bonus) is used; drawing all k + 1 keeps n on the
    # device. The other draws are independent of everything emitted, so the law is unchanged.
    next_token = candidates.index_select(0, n.view(1))
    block = torch.cat(
        [
            n.view(1).double(),
            next_token.double(),
            draft_ids.double(),
            exact.double(),
            div.double(),
            costs.double(),
        ]
    ).tolist()
    accepted, chosen = int(block[0]), int(block[1])
    ids, passed = block[2 : 2 + k], block[2 + k : 2 + 2 * k]
    divs, position_costs = block[2 + 2 * k : 2 + 3 * k], block[2 + 3 * k :]
    return Verdict(
        accepted=accepted,
        token_ids=[*(int(i) for i in ids[:accepted]), chosen],
        exact=[bool(e) for e in passed],
        divergences=divs,
        costs=[*position_costs[:accepted], position_costs[accepted] if accepted < k else 0.0],
        next_origin=Origin.TARGET_BONUS if accepted == k else Origin.TARGET_RESAMPLED,
    )
