"""The events every decoder yields: emitted tokens with their origin, and per-step statistics.

Terms follow the speculative-decoding literature (Leviathan et al. 2023; Holsman et al. 2025):
*acceptance rate* = accepted draft tokens / drafted tokens; *mean accepted length* τ = tokens
emitted per target forward pass; *tokens/s* counts generated tokens only, over decoding wall-clock
time (prompt prefill excluded and reported on its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from fsd_chat.decoding.settings import StepRule


class Origin(StrEnum):
    """How a token was produced."""

    DRAFT_EXACT = "draft-exact"
    """Draft token whose law is the target's: accepted by the exact speculative-sampling test, or by
    a relaxed test at a position where the relaxed law is p itself. Its cost is 0."""
    DRAFT_FUZZY = "draft-fuzzy"
    """Draft token accepted where the relaxed test decided and its law departs from the target's:
    the output may depart from the target. Its cost is > 0 (see `fsd_chat.decoding.acceptance`)."""
    TARGET_RESAMPLED = "target-resampled"
    """Correction drawn from the target after a rejection."""
    TARGET_BONUS = "target-bonus"
    """Extra target token after all k draft tokens were accepted."""
    TARGET = "target"
    """Plain autoregressive target token (no drafting)."""


class StopReason(StrEnum):
    """Why generation ended (set on the last `Step` only)."""

    EOS = "eos"
    MAX_NEW_TOKENS = "max-new-tokens"
    STOP_STRING = "stop-string"
    STOPPED = "stopped"
    """A stop was requested through `Controls.request_stop`."""
    CONTEXT = "context"
    """The context window of a model is full."""


@dataclass(frozen=True, slots=True)
class Token:
    """One emitted token.

    Attributes:
        id: Token id in the shared vocabulary.
        text: Text this token adds to the reply (incremental detokenisation: "" while a multi-byte
            character is incomplete; the concatenation over a reply equals `tokenizer.decode(ids)`).
        origin: How it was produced.
        divergence: D(p, q) at this position in the divergence's units (nats for kl/reverse-kl/js,
            a probability for tv), for tokens decided by an acceptance test; None otherwise.
        cost: KL(r ‖ p) in nats of the law r this token was drawn from against the target's p
            (greedy: the regret log p(argmax p) − log p(token)); 0 when r = p. See
            `fsd_chat.decoding.acceptance`.
    """

    id: int
    text: str
    origin: Origin
    divergence: float | None = None
    cost: float = 0.0


@dataclass(frozen=True, slots=True)
class StepStats:
    """Statistics of one decoding step (one target forward pass).

    Attributes:
        drafted: Draft tokens proposed (k of this step; 0 for autoregressive steps).
        accepted_exact: Draft tokens accepted `draft-exact`.
        accepted_fuzzy: Draft tokens accepted `draft-fuzzy` (each costs > 0).
        emitted: Tokens this step emitted (after EOS / max-new-tokens / stop-string trimming).
        target_forwards: Target forward passes this step (1).
        draft_forwards: Draft forward passes this step.
        draft_seconds: Wall-clock seconds in draft forward passes and draft sampling.
        target_seconds: Wall-clock seconds in target forward passes.
        other_seconds: Wall-clock seconds in everything else (acceptance, cache rollback, detokenisation).
        threshold: Threshold T in force for this step (divergence units).
        divergence: What the relaxed test compares with T: the divergence in force, or "regret"
            under greedy decoding, which reads no divergence (`DecodingSettings.tested`).
        rule: Acceptance rule in force (a `Rule`), or "autoregressive" for a step of
            `AutoregressiveDecoder` (a speculative step that drafted nothing keeps its rule).
        prefill_seconds: Wall-clock seconds encoding the prompt (first step only; not in `seconds`).
        cost: Sum of the costs (nats) of the tokens this step decided: the emitted ones, and the
            end-of-sequence token when it ends the reply (its law is part of the reply's).
        lookup_hits: 1 when this step's draft tokens came from prompt lookup (an n-gram matched),
            else 0.
        paused: Why the draft policy takes target-only steps after this one, e.g. "lookup accepts
            5%" or "draft 0.87× target" (`fsd_chat.decoding.draft_policy.GoodputPolicy`); None
            while it drafts.
    """

    drafted: int
    accepted_exact: int
    accepted_fuzzy: int
    emitted: int
    target_forwards: int
    draft_forwards: int
    draft_seconds: float
    target_seconds: float
    other_seconds: float
    threshold: float
    divergence: str
    rule: StepRule
    prefill_seconds: float = 0.0
    cost: float = 0.0
    lookup_hits: int = 0
    paused: str | None = None

    @property
    def accepted(self) -> int:
        """Draft tokens accepted by either test."""
        return self.accepted_exact + self.accepted_fuzzy

    @property
    def seconds(self) -> float:
        """Wall-clock seconds of the whole step."""
        return self.draft_seconds + self.target_seconds + self.other_seconds


@dataclass(frozen=True, slots=True)
class Step:
    """One decoding step: the tokens it emitted and its statistics.

    `stop_reason` is set on the final step of a generation only. `flushed` is text of earlier
    tokens that the detokeniser held back (an incomplete character, a lone space) and released
    because the reply ended on this step's first token; it follows the previous step's text.
    """

    tokens: tuple[Token, ...]
    stats: StepStats
    stop_reason: StopReason | None = None
    flushed: str = ""

    @property
    def text(self) -> str:
        """The text this step adds to the reply."""
        return self.flushed + "".join(t.text for t in self.tokens)


@dataclass(slots=True)
class GenerationStats:
    """Running totals over the steps of one generation (or several, when `add` is fed them all).

    Prefill time is totalled apart and excluded from tokens/s.
    """

    tokens: int = 0
    drafted: int = 0
    accepted_exact: int = 0
    accepted_fuzzy: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    steps: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    other_seconds: float = 0.0
    prefill_seconds: float = 0.0
    cost: float = 0.0
    """Sum of the steps' costs in nats (see `StepStats.cost`)."""
    lookup_hits: int = 0
    """Steps whose draft tokens came from prompt lookup (see `StepStats.lookup_hits`)."""
    first_token_seconds: float = 0.0
    """Wall-clock seconds from the start of the reply to its first step's tokens: the prompt's
    prefill and the first step (of the first generation, when several are added)."""
    thresholds: list[float] = field(default_factory=list)
    """Distinct thresholds in force, in the order they were first used."""
    paused: str | None = None
    """Why speculation is paused after the last step added (`StepStats.paused`; None: it is not)."""
    paused_steps: int = 0
    """Steps taken while speculation was paused (target-only steps of a draft that did not pay)."""
    end_tokens: int = 0
    """End-of-sequence tokens the steps decided (0 or 1): not among `tokens`, which are shown."""

    def add(self, step: Step) -> None:
        """Fold one step's statistics into the totals."""
        s = step.stats
        if not self.steps:
            self.first_token_seconds = s.prefill_seconds + s.seconds
        self.tokens += s.emitted
        self.end_tokens += step.stop_reason == StopReason.EOS
        self.drafted += s.drafted
        self.accepted_exact += s.accepted_exact
        self.accepted_fuzzy += s.accepted_fuzzy
        self.target_forwards += s.target_forwards
        self.draft_forwards += s.draft_forwards
        self.steps += 1
        self.draft_seconds += s.draft_seconds
        self.target_seconds += s.target_seconds
        self.other_seconds += s.other_seconds
        self.prefill_seconds += s.prefill_seconds
        self.cost += s.cost
        self.lookup_hits += s.lookup_hits
        if s.threshold not in self.thresholds:
            self.thresholds.append(s.threshold)
        self.paused_steps += self.paused is not None and not s.drafted
        self.paused = s.paused

    @property
    def decode_seconds(self) -> float:
        """Wall-clock seconds of decoding, prefill excluded."""
        return self.draft_seconds + self.target_seconds + self.other_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of decoding (0.0 before any time has passed)."""
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 when nothing was drafted)."""
        accepted = self.accepted_exact + self.accepted_fuzzy
        return accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens emitted per target forward pass (1.0 for autoregressive decoding), the
        end-of-sequence token included: the step that decided it made a forward pass for it, and
        leaving it out would put τ below 1 in short replies that no speculation produced."""
        return (self.tokens + self.end_tokens) / self.target_forwards if self.target_forwards else 0.0

    @property
    def fuzzy_share(self) -> float:
        """Share of emitted tokens labelled `draft-fuzzy` (those that cost something)."""
        return self.accepted_fuzzy / self.tokens if self.tokens else 0.0

    @property
    def cost_per_token(self) -> float:
        """Cost in nats per generated token (0.0 before any token)."""
        return self.cost / self.tokens if self.tokens else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of decoding time outside the two models' forward passes."""
        return self.other_seconds / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float | int | list[float] | str | None]:
        """JSON-ready summary (the keys of `fsd-chat generate --json`'s final `stats`)."""
        return {
            "tokens": self.tokens,
            "tokens_per_second": self.tokens_per_second,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "fuzzy_share": self.fuzzy_share,
            "cost": self.cost,
            "cost_per_token": self.cost_per_token,
            "drafted": self.drafted,
            "accepted_exact": self.accepted_exact,
            "accepted_fuzzy": self.accepted_fuzzy,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "steps": self.steps,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "other_seconds": self.other_seconds,
            "prefill_seconds": self.prefill_seconds,
            "first_token_seconds": self.first_token_seconds,
            "overhead_share": self.overhead_share,
            "lookup_hits": self.lookup_hits,
            "thresholds": list(self.thresholds),
            "paused": self.paused,
            "paused_steps": self.paused_steps,
        }
