"""Live decoding controls, shared between the UI thread and the generation thread.

The UI changes settings at any time; the decoder takes one consistent `snapshot()` at the start of
every step, so a change applies from the next step and never half-way through one.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

from fsd_chat.decoding.acceptance import RULES, Rule
from fsd_chat.decoding.divergence import DIVERGENCE_NAMES, DivergenceName
from fsd_chat.errors import SettingsError

DEFAULT_DRAFT_TOKENS = 5
"""Default draft length k: the best median tokens/s of exact SD over k = 2..6 on the CPU-scale
pair (README, "Choosing the defaults"); k = 3..6 lie within each other's confidence intervals."""

DEFAULT_THRESHOLD = 0.05
"""Default T (js, nats): the smallest threshold with a measurable speed-up over exact SD on the
CPU-scale pair (README, "Choosing the defaults"); below it fuzzy acceptances are too rare to pay."""

MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class DecodingSettings:
    """The acceptance rule and its parameters.

    Attributes:
        rule: "exact" (standard SD), "fuzzy" (exact test or D ≤ T; FSD) or "pure" (D ≤ T only).
        divergence: D used by fuzzy/pure: "kl", "reverse-kl", "js" or "tv".
        threshold: T ≥ 0 in the divergence's units (nats; a probability for tv); inf allowed.
        draft_tokens: Draft length k, 1..MAX_DRAFT_TOKENS (the starting k when adaptive).
        adaptive: Adapt k each step: +1 after a fully accepted block, −1 after a rejection
            (the heuristic of transformers' assisted generation).

    Raises:
        SettingsError: on any value out of range.
    """

    rule: Rule = "fuzzy"
    divergence: DivergenceName = "js"
    threshold: float = DEFAULT_THRESHOLD
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise SettingsError(f"unknown rule {self.rule!r}; choose one of {', '.join(RULES)}")
        if self.divergence not in DIVERGENCE_NAMES:
            raise SettingsError(
                f"unknown divergence {self.divergence!r}; choose one of {', '.join(DIVERGENCE_NAMES)}"
            )
        if math.isnan(self.threshold) or self.threshold < 0:
            raise SettingsError(
                f"threshold must be ≥ 0 (0 = exact speculative decoding), got {self.threshold}"
            )
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise SettingsError(f"draft length k must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")


class Controls:
    """Thread-safe holder of `DecodingSettings` and of a stop request."""

    def __init__(self, settings: DecodingSettings | None = None) -> None:
        self._lock = threading.Lock()
        self._settings = settings or DecodingSettings()
        self._stop = threading.Event()

    def snapshot(self) -> DecodingSettings:
        """The settings in force now (immutable)."""
        with self._lock:
            return self._settings

    def update(self, **changes: object) -> DecodingSettings:
        """Change some settings (fields of `DecodingSettings`); returns the new settings.

        Raises:
            SettingsError: a value out of range (the settings stay as they were).
        """
        with self._lock:
            self._settings = replace(self._settings, **changes)
            return self._settings

    def request_stop(self) -> None:
        """Ask the running generation to end after the step in progress."""
        self._stop.set()

    def clear_stop(self) -> None:
        """Forget a stop request (called when a new generation starts)."""
        self._stop.clear()

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was requested since the last `clear_stop`."""
        return self._stop.is_set()
