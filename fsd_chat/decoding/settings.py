"""The settings of decoding, free of torch so that the command line loads fast: acceptance rule,
divergence, threshold T, draft length k (`DecodingSettings`) and sampling (`SamplingConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fsd_chat.errors import SettingsError

Rule = Literal["exact", "fuzzy", "pure", "mixture"]
RULES: tuple[Rule, ...] = ("exact", "fuzzy", "pure", "mixture")

DivergenceName = Literal["kl", "reverse-kl", "js", "tv"]
DIVERGENCE_NAMES: tuple[DivergenceName, ...] = ("kl", "reverse-kl", "js", "tv")

DraftPolicyName = Literal["fixed", "adaptive", "cost"]
DRAFT_POLICIES: tuple[DraftPolicyName, ...] = ("fixed", "adaptive", "cost")

DEFAULT_DRAFT_TOKENS = 5
"""Default draft length k: the best median tokens/s of exact SD over k = 2..6 on the CPU-scale
pair (README, "Choosing the defaults"); k = 3..6 lie within each other's confidence intervals."""
DEFAULT_MAX_NEW_TOKENS = 256
"""Cap on new tokens per reply (tokens) unless asked otherwise: generate's and the chat's default."""

DEFAULT_THRESHOLD = 0.05
"""Default T (js, nats): the smallest threshold with a measurable speed-up over exact SD on the
CPU-scale pair (README, "Choosing the defaults"); below it fuzzy acceptances are too rare to pay."""

MAX_DRAFT_TOKENS = 32

MIN_TEMPERATURE = 1e-4
"""The smallest non-zero temperature: below it the division of float32 logits overflows (1e-40
gives NaN probabilities), and sampling is already indistinguishable from greedy decoding."""

MIN_TOP_P = 1e-6
"""The smallest top-p: below float32's resolution of cumulative probabilities every token would be
dropped; any top-p this small keeps only the most likely token anyway."""

MAX_SEED = 2**64 - 1
"""torch generators take 64-bit seeds."""


@dataclass(frozen=True, slots=True)
class DecodingSettings:
    """The acceptance rule and its parameters.

    Attributes:
        rule: "exact" (standard SD), "fuzzy" (exact test or D ≤ T; FSD), "pure" (D ≤ T only; the
            paper's released code) or "mixture" (exact SD against (1 − λ)p + λq, KL ≤ T per token).
        divergence: D used by fuzzy/pure: "kl", "reverse-kl", "js" or "tv".
        threshold: T ≥ 0: in the divergence's units (nats; a probability for tv) for fuzzy/pure;
            nats per token (KL, or log-probability regret when greedy) for mixture. Finite: JSON
            output has no infinity, and the dial could not be turned down from it (T at the
            divergence's upper bound, ln 2 for js or 1 for tv, already accepts every draft token).
        draft_tokens: Draft length k, 1..MAX_DRAFT_TOKENS: the draft length of `fixed`, the
            starting length of `adaptive`, the longest draft of `cost`.
        draft_policy: How each step's draft length is chosen (`fsd_chat.decoding.draft_policy`):
            "fixed" (k), "adaptive" (+2 after a fully accepted block, −1 after a rejection:
            transformers' heuristic schedule) or "cost" (draft while one more token's expected
            gain per second of its measured cost beats the block's running rate).

    Raises:
        SettingsError: on any value out of range.
    """

    rule: Rule = "fuzzy"
    divergence: DivergenceName = "js"
    threshold: float = DEFAULT_THRESHOLD
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    draft_policy: DraftPolicyName = "fixed"

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise SettingsError(f"unknown rule {self.rule!r}; choose one of {', '.join(RULES)}")
        if self.divergence not in DIVERGENCE_NAMES:
            raise SettingsError(
                f"unknown divergence {self.divergence!r}; choose one of {', '.join(DIVERGENCE_NAMES)}"
            )
        if not 0 <= self.threshold < math.inf:
            raise SettingsError(
                f"threshold must be a finite number ≥ 0 (0 = exact speculative decoding), got {self.threshold}"
            )
        if self.draft_policy not in DRAFT_POLICIES:
            raise SettingsError(
                f"unknown draft policy {self.draft_policy!r}; choose one of {', '.join(DRAFT_POLICIES)}"
            )
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise SettingsError(f"draft length k must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How tokens are drawn.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it: a finite number
            ≥ MIN_TEMPERATURE.
        top_k: Keep the k most likely tokens (0 = all).
        top_p: Keep the smallest set of tokens whose probability reaches top_p (1.0 = all), in
            [MIN_TOP_P, 1].
        seed: Seed of the generator used for draws and acceptance tests, 0..MAX_SEED (None = random).

    Raises:
        SettingsError: on a temperature that is neither 0 nor a finite number ≥ MIN_TEMPERATURE, a
            negative top-k, top-p outside [MIN_TOP_P, 1], or a seed outside 0..MAX_SEED.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise SettingsError(
                f"temperature must be 0 (greedy) or a finite number ≥ {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.top_k < 0:
            raise SettingsError(f"top-k must be ≥ 0 (0 = off), got {self.top_k}")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise SettingsError(f"top-p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise SettingsError(f"seed must be in 0..2^64 − 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature == 0.0
