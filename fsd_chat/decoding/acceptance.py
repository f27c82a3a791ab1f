"""Acceptance rules: which draft tokens to keep, and the token the target adds after them.

Rules (Holsman, Huang, Dhingra, "Fuzzy Speculative Decoding", ACL Findings 2025, §3):

- `exact`: standard speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023):
  accept x̃_i iff u_i ≤ min(1, p_i(x̃_i) / q_i(x̃_i)), u_i ~ U(0, 1); greedy: iff x̃_i = argmax p_i.
  After a rejection the correction is drawn from norm(max(0, p − q)). Lossless.
- `fuzzy` (default): accept iff the exact test passes or D(p_i, q_i) ≤ T. T = 0 is `exact`.
- `pure` (the paper's released code): accept iff D(p_i, q_i) ≤ T; the correction is drawn from p.

Each position is tested at once (vectorised over the k draft positions); the accepted prefix ends at
the first rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsd_chat.decoding.divergence import DivergenceName, divergence
from fsd_chat.decoding.events import Origin
from fsd_chat.decoding.sampling import draw
from fsd_chat.decoding.settings import Rule, SamplingConfig


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of verifying one block of k draft tokens.

    Attributes:
        accepted: n, the number of draft tokens accepted (the prefix before the first rejection).
        exact: Per draft position, whether the exact test passed; length k.
        divergences: Per draft position, D(p_i, q_i) in the divergence's units; length k.
        next_token: The target's token after the accepted prefix (correction when n < k, bonus when
            n = k).
        next_origin: TARGET_RESAMPLED or TARGET_BONUS.
    """

    accepted: int
    exact: list[bool]
    divergences: list[float]
    next_token: int
    next_origin: Origin

    def origins(self) -> list[Origin]:
        """Origins of the n accepted draft tokens followed by the target's token (n + 1 items)."""
        drafted = [Origin.DRAFT_EXACT if e else Origin.DRAFT_FUZZY for e in self.exact[: self.accepted]]
        return [*drafted, self.next_origin]


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
    """Accept a prefix of the draft block and choose the target's next token.

    Args:
        p: Target probabilities, shape [k + 1, vocab]: rows 0..k-1 at the draft positions, row k
            for the bonus token.
        q: Draft probabilities the draft tokens were drawn from, shape [k, vocab].
        draft_ids: The draft tokens, shape [k] int64.
        rule: "exact", "fuzzy" or "pure".
        divergence_name: The divergence D used by "fuzzy" and "pure".
        threshold: T, in the divergence's units (≥ 0; math.inf accepts everything under "fuzzy").
        sampling: Sampling settings (greedy: argmax tests and corrections).
        generator: Source of the uniform draws u_i and of the correction draw.

    Returns:
        The `Verdict` (one host synchronisation for the whole block).
    """
    k = draft_ids.shape[0]
    positions = torch.arange(k, device=p.device)
    div = divergence(divergence_name, p[:k], q)
    if sampling.greedy:
        exact = draft_ids == p[:k].argmax(-1)
    else:
        u = torch.rand(k, generator=generator, device=p.device)
        # u ≤ p/q written without the division; q(x̃) > 0 since x̃ was drawn from q.
        exact = u * q[positions, draft_ids] <= p[positions, draft_ids]
    fuzzy = div <= threshold
    accept = {"exact": exact, "fuzzy": exact | fuzzy, "pure": fuzzy}[rule]
    n = int(accept.long().cumprod(0).sum())

    if n == k:
        next_token = int(draw(p[k], sampling, generator))
        origin = Origin.TARGET_BONUS
    else:
        target_row = p[n]
        if rule != "pure" and not sampling.greedy:
            residual = (p[n] - q[n]).clamp_min(0.0)
            # A rejection implies p(x̃) < q(x̃), so the residual has mass; guard rounding anyway.
            if float(residual.sum()) > 0.0:
                target_row = residual / residual.sum()
        next_token = int(draw(target_row, sampling, generator))
        origin = Origin.TARGET_RESAMPLED
    return Verdict(
        accepted=n,
        exact=exact.tolist(),
        divergences=div.tolist(),
        next_token=next_token,
        next_origin=origin,
    )
