"""How many tokens each step drafts: `fixed`, `adaptive` and `cost` draft-length policies.

A policy only decides the length of a step's draft block, from the draft's own outputs and past
verdicts, never from the target's distributions at the step being decided; the acceptance rules
and their guarantees (`fsd_chat.decoding.acceptance`) are untouched. The decoder asks it three
things per step: the most tokens the step may draft (`limit`), after each draft forward pass
whether that position joins the block (`extend`; the first always does, so k ≥ 1), and, after the
verdict, how many drafted tokens were accepted (`observe`).

- `fixed`: k = settings.draft_tokens.
- `adaptive`: transformers' "heuristic" schedule (`num_assistant_tokens_schedule`): start at
  settings.draft_tokens, +2 after a fully accepted block (up to MAX_DRAFT_TOKENS), −1 after a
  rejection (down to 1); a k set by the user restarts it.
- `cost`: draft while one more token pays for itself in expected tokens per second:

  Let a_j be the estimated probability that draft token j is accepted given tokens 1..j−1 were,
  G_j = a_1···a_j the probability that all of 1..j are accepted, E_j = 1 + G_1 + … + G_j the
  expected tokens a block of j draft tokens emits (the target adds one after the accepted prefix),
  and T_j = j·c_d + V(j + 1) its cost in seconds (c_d: one draft position; V(w): a target forward
  over w tokens). After the draft forward that proposes token j + 1 (j ≥ 1), the token joins the
  block iff E_{j+1}/T_{j+1} ≥ E_j/T_j, i.e. iff its marginal ratio G_{j+1}/(T_{j+1} − T_j) is at
  least the running average E_j/T_j (for T_{j+1} > T_j); otherwise the block is the first j tokens
  and the step verifies them. Drafting also stops at k = settings.draft_tokens (the cap). The rule
  is greedy (one token of look-ahead): a dip further along a non-monotone V is not sought.

  a_j comes from the draft's confidence, its top probability c_j = max_x q_j(x), calibrated against
  the acceptance measured in this reply: c_j falls in one of `BINS` equal-width bins of [0, 1], and
  a_j is the posterior mean of that bin's Beta(s + α, f + β) counts, with s / f the accepted /
  rejected draft tokens of the bin so far in the reply (only positions up to the first rejection
  are observed, so a_j is the acceptance given the prefix was accepted) and the prior α + β =
  `PRIOR_STRENGTH` pseudo-tokens centred on the bin's middle (a calibrated draft). Whatever the rule
  (exact, fuzzy, mixture) and threshold, acceptance is measured as the verdicts count it.

  The decision is taken before x̃_{j+1} is drawn and depends on q_{j+1} alone (not on the sampled
  token's probability q_{j+1}(x̃_{j+1})), so a kept position's token is still a draw from q_{j+1}
  and the exact test keeps sampling lossless; a dropped position costs its draft forward (which
  also fed x̃_j, needed anyway when the whole block is accepted). Reading c_j costs one host
  synchronisation per draft forward under `cost` (the other policies read nothing).

  c_d and V(w) are measured once per loaded pair on its device (`measure_costs`; `ModelPair` keeps
  the curve, the decoder measures its own models when given none) and can be injected (tests pass
  a synthetic `CostCurve`). The costs of sampling, verification and rollback are left out.

Sources: SpecDec++ (Huang, Guo, Wang 2024, arXiv 2405.19715: stop drafting when a predicted
acceptance probability says a rejection is likely; here the threshold comes from measured costs);
DISCO (Mamou et al. 2024, arXiv 2405.04304: a dynamic draft length from the draft's confidence);
transformers' `assistant_confidence_threshold` (stop when the draft token's probability is below a
constant, 0.4 by default) and `num_assistant_tokens_schedule="heuristic"` (the +2/−1 schedule);
llama.cpp's `--draft-p-min` (drop a draft token whose top probability is below a constant).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from fsd_chat.decoding.kv_cache import CachedModel
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS, DecodingSettings, DraftPolicyName
from fsd_chat.decoding.timing import PhaseClock

BINS = 10
"""Equal-width bins of the draft's top probability over which acceptance is calibrated."""

PRIOR_STRENGTH = 2.0
"""Pseudo-tokens of each bin's Beta prior (centred on the bin's middle): measured acceptance
outweighs it after a couple of observations."""

MEASURED_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 11, 16, 23, MAX_DRAFT_TOKENS + 1)
"""Verify widths `measure_costs` times (tokens); other widths are linearly interpolated."""

MEASURE_CONTEXT = 64
"""Tokens of context the timed forwards attend to."""

MEASURE_REPEATS = 3
"""Timed passes over the widths (after one untimed pass); each width's cost is their median."""


@dataclass(frozen=True, slots=True)
class CostCurve:
    """What drafting and verifying cost on a device.

    Attributes:
        draft: Seconds of one draft position (a 1-token draft forward and its softmax).
        widths: Verify widths in tokens, increasing, from 1 to at least MAX_DRAFT_TOKENS + 1.
        verify: Seconds of a target forward over each of `widths` tokens.
    """

    draft: float
    widths: tuple[int, ...]
    verify: tuple[float, ...]

    def verify_seconds(self, width: int) -> float:
        """Seconds of a target forward over `width` tokens (linear between measured widths)."""
        i = bisect.bisect_left(self.widths, width)
        if i < len(self.widths) and self.widths[i] == width:
            return self.verify[i]
        i = min(max(i, 1), len(self.widths) - 1)
        (w0, w1), (v0, v1) = self.widths[i - 1 : i + 1], self.verify[i - 1 : i + 1]
        return v0 + (v1 - v0) * (width - w0) / (w1 - w0)


def measure_costs(target: PreTrainedModel, draft: PreTrainedModel, vocab_size: int) -> CostCurve:
    """Time the draft's 1-token forward and the target's forward at `MEASURED_WIDTHS` on their
    devices, over a `MEASURE_CONTEXT`-token context, with caches of their own (a decoder's caches
    are not touched). Takes (1 + MEASURE_REPEATS) × (len(MEASURED_WIDTHS) + 1) forward passes."""
    t_model, d_model = CachedModel(target, vocab_size), CachedModel(draft, vocab_size)
    longest = MEASURE_CONTEXT + MEASURED_WIDTHS[-1]
    t_seq, d_seq = (torch.arange(longest, device=m.device).remainder(vocab_size)[None] for m in (t_model, d_model))
    t_model.forward(t_seq, MEASURE_CONTEXT, keep=1)
    d_model.forward(d_seq, MEASURE_CONTEXT, keep=1)
    clock = PhaseClock(t_model.device)

    def verify(width: int) -> float:
        clock.lap()
        t_model.forward(t_seq, MEASURE_CONTEXT + width, keep=width)
        seconds = clock.lap()
        t_model.rollback(MEASURE_CONTEXT)
        return seconds

    def draft_position() -> float:
        clock.lap()
        d_model.forward(d_seq, MEASURE_CONTEXT + 1, keep=1).softmax(-1).max().item()
        seconds = clock.lap()
        d_model.rollback(MEASURE_CONTEXT)
        return seconds

    samples: list[list[float]] = [[] for _ in range(len(MEASURED_WIDTHS) + 1)]
    for repeat in range(1 + MEASURE_REPEATS):
        times = [verify(width) for width in MEASURED_WIDTHS] + [draft_position()]
        if repeat:  # pass 0 is untimed: first-call allocations and kernel selection
            for sample, seconds in zip(samples, times, strict=True):
                sample.append(seconds)
    medians = [statistics.median(s) for s in samples]
    return CostCurve(draft=medians[-1], widths=MEASURED_WIDTHS, verify=tuple(medians[:-1]))


def _bin(confidence: float) -> int:
    """The calibration bin of a top probability."""
    return min(int(confidence * BINS), BINS - 1)


class DraftPolicy(Protocol):
    """Chooses each step's draft length (see the module docstring)."""

    def limit(self, settings: DecodingSettings) -> int:
        """The most tokens the coming step may draft (≥ 1; the decoder also caps it by the room
        left in the reply). Starts a step."""
        ...

    def extend(self, q: torch.Tensor) -> bool:
        """Whether the position whose draft distribution `q` ([vocab]) was just computed joins the
        block (True for the step's first position)."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """The verdict of the step: `drafted` tokens in the block, `accepted` of them accepted."""
        ...


class FixedPolicy:
    """k = settings.draft_tokens at every step."""

    def limit(self, settings: DecodingSettings) -> int:
        """settings.draft_tokens."""
        return settings.draft_tokens

    def extend(self, q: torch.Tensor) -> bool:
        """Always (no host read)."""
        return True

    def observe(self, drafted: int, accepted: int) -> None:
        """Nothing to learn."""


class AdaptivePolicy(FixedPolicy):
    """transformers' heuristic schedule: +2 after a fully accepted block, −1 after a rejection,
    starting from (and restarted by a change of) settings.draft_tokens."""

    def __init__(self) -> None:
        self._start = 0
        self._k = 0

    def limit(self, settings: DecodingSettings) -> int:
        """The scheduled k."""
        if settings.draft_tokens != self._start:
            self._start = self._k = settings.draft_tokens
        return self._k

    def observe(self, drafted: int, accepted: int) -> None:
        """+2 (up to MAX_DRAFT_TOKENS) when all `drafted` were accepted, else −1 (down to 1)."""
        self._k = min(drafted + 2, MAX_DRAFT_TOKENS) if accepted == drafted else max(drafted - 1, 1)


class CostPolicy:
    """Draft while one more token raises the block's expected tokens per second (module docstring).

    Args:
        costs: The device's draft and verify costs.
    """

    def __init__(self, costs: CostCurve) -> None:
        # T_j for j = 0..MAX_DRAFT_TOKENS: j draft positions and a verify over j + 1 tokens.
        self._seconds = [j * costs.draft + costs.verify_seconds(j + 1) for j in range(MAX_DRAFT_TOKENS + 1)]
        middles = [(b + 0.5) / BINS for b in range(BINS)]
        self._accepted = [PRIOR_STRENGTH * m for m in middles]
        self._observed = [PRIOR_STRENGTH] * BINS
        self._bins: list[int] = []
        self._all_accepted = 1.0  # G_j
        self._expected = 1.0  # E_j

    def limit(self, settings: DecodingSettings) -> int:
        """settings.draft_tokens, the cap."""
        self._bins, self._all_accepted, self._expected = [], 1.0, 1.0
        return settings.draft_tokens

    def acceptance(self, confidence: float) -> float:
        """a: the calibrated probability that a draft token of top probability `confidence` is
        accepted, given the tokens before it in the block were."""
        b = _bin(confidence)
        return self._accepted[b] / self._observed[b]

    def extend(self, q: torch.Tensor) -> bool:
        """Whether E_{j+1}/T_{j+1} ≥ E_j/T_j with j the block's length so far (one host read)."""
        confidence = float(q.max())
        j = len(self._bins)
        all_accepted = self._all_accepted * self.acceptance(confidence)
        expected = self._expected + all_accepted
        if j and expected * self._seconds[j] < self._expected * self._seconds[j + 1]:
            return False
        self._bins.append(_bin(confidence))
        self._all_accepted, self._expected = all_accepted, expected
        return True

    def observe(self, drafted: int, accepted: int) -> None:
        """Count the accepted positions and the first rejected one in their bins."""
        for b in self._bins[: accepted + 1]:
            self._observed[b] += 1
        for b in self._bins[:accepted]:
            self._accepted[b] += 1


def make_policy(name: DraftPolicyName, costs: Callable[[], CostCurve]) -> DraftPolicy:
    """A fresh policy of that name; `costs` is called only by `cost` (measurements may be slow)."""
    if name == "cost":
        return CostPolicy(costs())
    return AdaptivePolicy() if name == "adaptive" else FixedPolicy()
