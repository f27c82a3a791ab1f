"""The settings of decoding, free of torch so that the command line loads fast: acceptance rule,
divergence, threshold T, draft length k (`DecodingSettings`) and sampling (`SamplingConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from fsd_chat.support.errors import SettingsError
from fsd_chat.support.text import renamed_note

Rule = Literal["exact", "fuzzy", "pure", "mixture"]
RULES: tuple[Rule, ...] = ("exact", "fuzzy", "pure", "mixture")
StepRule = Rule | Literal["autoregressive"]
"""What decided a step's tokens (`StepStats.rule`): an acceptance rule, or "autoregressive" for a
step of target-only decoding (`AutoregressiveDecoder`)."""

DivergenceName = Literal["kl", "reverse-kl", "js", "tv"]
DIVERGENCE_NAMES: tuple[DivergenceName, ...] = ("kl", "reverse-kl", "js", "tv")

DraftPolicyName = Literal["goodput", "fixed", "heuristic", "latency"]
DRAFT_POLICIES: tuple[DraftPolicyName, ...] = ("goodput", "fixed", "heuristic", "latency")
DEFAULT_DRAFT_POLICY: DraftPolicyName = "goodput"
"""The app's draft policy (chat, generate, config.toml): never much slower than the target alone.
`DecodingSettings` itself defaults to "fixed", whose k does not depend on measured timings (a
library caller, a test, a bench sweep)."""
FORMER_DRAFT_POLICIES: dict[str, DraftPolicyName] = {"adaptive": "heuristic", "cost": "latency"}
"""Former names of draft policies -> their names now. A saved session's settings are read with the
new names (`fsd_chat.conversation.session.settings_from_dict`); a flag or config.toml value with a
former name is refused in one line that names the new one."""

DEFAULT_DRAFT_TOKENS = 5
"""Default draft length k: the best median tokens/s of exact SD over k = 2..6 on the CPU-scale
pair (README, "Choosing the defaults"); k = 3..6 lie within each other's confidence intervals."""
DEFAULT_MAX_NEW_TOKENS = 256
"""Cap on new tokens per reply (tokens) unless asked otherwise: generate's and the chat's default."""

DEFAULT_THRESHOLD = 0.05
"""Default T (js, nats): the smallest threshold with a measurable speed-up over exact SD on the
CPU-scale pair (README, "Choosing the defaults"); below it fuzzy acceptances are too rare to pay."""

DEFAULT_GREEDY_THRESHOLD = 1.0
"""Default T under greedy decoding, where it bounds each kept draft token's regret in nats
(`fsd_chat.decoding.acceptance`, Greedy), and the greedy dial's top: on the default chat
(SmolLM2-135M-Instruct, prompt lookup; docs/benchmarks.md, "The dial on the default chat") 1.18×
T = 0 on tinystories-retell (96 tokens; 1.16× over 256) and 1.20× the target alone on MT-Bench, at
0.01 nats per token or less with 97-99% of tokens the target's own; 0.5 bought 1.02-1.03× T = 0."""


MAX_DRAFT_TOKENS = 32

DEFAULT_LOOKUP_NGRAM = 3
"""Longest suffix (tokens) prompt lookup matches (`fsd_chat.decoding.lookup`), falling back to
shorter ones; transformers' `max_matching_ngram_size` defaults to 2."""

LOOKUP = "lookup"
"""The `--draft` value that asks for prompt lookup (no draft model)."""

MIN_TEMPERATURE = 1e-4
"""The smallest non-zero temperature: below it the division of float32 logits overflows (1e-40
gives NaN probabilities), and sampling is already indistinguishable from greedy decoding."""

MIN_TOP_P = 1e-6
"""The smallest top-p: below float32's resolution of cumulative probabilities every token would be
dropped; any top-p this small keeps only the most likely token anyway."""

MAX_SEED = 2**64 - 1
"""torch generators take 64-bit seeds."""

REGRET = "regret"
"""What every relaxed rule compares with T under greedy decoding: a draft token's regret
log p(argmax p) − log p(x̃) in nats (`fsd_chat.decoding.acceptance`, Greedy). The dial's divergence
is not read there, so a greedy step records this name in its place (`DecodingSettings.tested`)."""


@dataclass(frozen=True, slots=True)
class DecodingSettings:
    """The acceptance rule and its parameters.

    Attributes:
        rule: "exact" (standard SD), "fuzzy" (exact test or D ≤ T; FSD), "pure" (D ≤ T only; the
            paper's released code) or "mixture" (exact SD against (1 − λ)p + λq̄, q̄ = q on p's
            support, with each position's largest λ such that KL ≤ T: the per-position form of
            transformers' static ensemble, `assistant_ensemble_weight` w, whose λ = 1 − w is fixed).
        divergence: D used by fuzzy/pure: "kl", "reverse-kl", "js" or "tv".
        threshold: T ≥ 0: greedy, nats of log-probability regret per token under every relaxed
            rule; sampling, the divergence's units (nats; a probability for tv) for fuzzy/pure and
            nats of KL per token for mixture. Finite: JSON
            output has no infinity, and the dial could not be turned down from it (T at the
            divergence's upper bound, ln 2 for js or 1 for tv, already accepts every draft token).
        draft_tokens: Draft length k, 1..MAX_DRAFT_TOKENS: the draft length of `fixed`, the
            starting length of `heuristic`, the longest draft of `latency` and `goodput`.
        draft_policy: How each step's draft length is chosen (`fsd_chat.decoding.draft_policy`):
            "fixed" (k), "heuristic" (+2 after a fully accepted block, −1 after a rejection:
            transformers' "heuristic" schedule), "latency" (draft while one more token's expected
            gain per measured second beats the block's running rate) or "goodput" (latency, and
            target-only steps while drafting does not pay: never much slower than the target alone).

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
                f"unknown draft policy {self.draft_policy!r}"
                f"{renamed_note(self.draft_policy, FORMER_DRAFT_POLICIES)}; choose one of {', '.join(DRAFT_POLICIES)}"
            )
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise SettingsError(f"draft length k must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")

    def tested(self, greedy: bool) -> str:
        """What the relaxed test compares with T: `REGRET` under greedy decoding, else the divergence."""
        return REGRET if greedy else self.divergence


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How tokens are drawn.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it: a finite number
            ≥ MIN_TEMPERATURE.
        top_k: Keep the k most likely tokens (0 = all).
        top_p: Keep the smallest set of tokens whose probability reaches top_p (1.0 = all), in
            [MIN_TOP_P, 1].
        min_p: Keep the tokens at least min_p times as likely as the most likely one (0.0 = all),
            in [0, 1].
        seed: Seed of the generator used for draws and acceptance tests, 0..MAX_SEED (None = random).

    Raises:
        SettingsError: on a temperature that is neither 0 nor a finite number ≥ MIN_TEMPERATURE, a
            negative top-k, top-p outside [MIN_TOP_P, 1], min-p outside [0, 1], or a seed outside
            0..MAX_SEED.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise SettingsError(
                f"temperature must be 0 (greedy) or a finite number ≥ {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.top_k < 0:
            raise SettingsError(f"top-k must be ≥ 0 (0 = off), got {self.top_k}")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise SettingsError(f"top-p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SettingsError(f"min-p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise SettingsError(f"seed must be in 0..2^64 − 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """True when top-k, top-p or min-p may remove tokens."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def untruncated(self) -> SamplingConfig:
        """The same sampling without top-k, top-p and min-p (the laws the divergences compare)."""
        return replace(self, top_k=0, top_p=1.0, min_p=0.0)

    def describe(self) -> str:
        """One line for people, e.g. "temperature 0.7, top-k 20, top-p 0.8" or "greedy"."""
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1.0 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p > 0.0 else []
        return ", ".join(parts)


NOT_APPLIED: dict[str, object] = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
}
"""generation_config fields whose logits processors fsd-chat does not apply, with their "off"
values: each would have to reach p and q alike at every draft position, which the decoders do not
do; a model that asks for one is told so in one line (`ResolvedSampling.not_applied`)."""


@dataclass(frozen=True, slots=True)
class ResolvedSampling:
    """The sampling in force, and where it came from.

    Attributes:
        config: The sampling settings.
        source: One line for people, e.g. "stories260K's generation_config: temperature 0.6,
            top-p 0.9 · given: top-k 40" (given: by a flag or config.toml).
        not_applied: The model's generation_config processors that are not applied, e.g.
            ("repetition_penalty 1.05",).
    """

    config: SamplingConfig
    source: str
    not_applied: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """The sampling asked for by flags or config.toml; None leaves a value to the target's
    `generation_config`, else to `SamplingConfig`'s default, as `transformers.generate` does.

    Raises:
        SettingsError: a given value out of range (checked at once, before any model loads).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        given = {name: value for name, value in self._fields().items() if value is not None}
        SamplingConfig(**given)  # type: ignore[arg-type]

    def _fields(self) -> dict[str, float | int | None]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }

    def resolve(self, generation_config: object | None, model: str) -> ResolvedSampling:
        """The sampling in force for a target whose `generation_config` (a transformers
        `GenerationConfig`, or None) is the model's own.

        The model samples when its config says `do_sample`: then its temperature (1 when unset),
        top-k, top-p and min-p apply; otherwise it is greedy (transformers' rule). A given value
        overrides the model's; truncation applies only when sampling.

        Args:
            generation_config: The target's `generation_config`, or None.
            model: The target's name, for `ResolvedSampling.source`.
        """
        own: dict[str, float | int] = {}
        if generation_config is not None and getattr(generation_config, "do_sample", None):
            own["temperature"] = getattr(generation_config, "temperature", None) or 1.0
            for name in ("top_k", "top_p", "min_p"):
                value = getattr(generation_config, name, None)
                if value is not None:
                    own[name] = value
        given = {name: value for name, value in self._fields().items() if value is not None}
        from_model = {name: value for name, value in own.items() if name not in given}
        config = SamplingConfig(**{**from_model, **given}, seed=self.seed)  # type: ignore[arg-type]

        def listed(values: dict[str, float | int]) -> str:
            return ", ".join(f"{name.replace('_', '-')} {value:g}" for name, value in values.items())

        parts = [f"{model}'s generation_config: {listed(from_model)}"] if from_model else []
        parts += [f"given: {listed(given)}"] if given else []
        not_applied = tuple(
            f"{name} {getattr(generation_config, name):g}"
            for name, off in NOT_APPLIED.items()
            if generation_config is not None and getattr(generation_config, name, None) not in (None, off)
        )
        return ResolvedSampling(config, " · ".join(parts) or "built-in default", not_applied)


MAX_NEW_TOKENS_LIMIT = 10_000_000
"""Upper bound of `--max-new-tokens`: beyond any context window (a reply ends when the window is full
anyway), and small enough for every place the number goes (buffers, SQLite, transformers)."""


def check_max_new_tokens(value: int) -> int:
    """`--max-new-tokens` (tokens): the one rule of generate, chat and bench; returns the value.

    Raises:
        SettingsError: outside 1..MAX_NEW_TOKENS_LIMIT.
    """
    if not 1 <= value <= MAX_NEW_TOKENS_LIMIT:
        raise SettingsError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS_LIMIT:,}, got {value}")
    return value


def default_threshold(settings: DecodingSettings, given: bool, greedy: bool) -> DecodingSettings:
    """`settings` with the setup's default T where none was given (by a flag, config.toml or a
    resumed session): greedy decoding reads T as a regret bound, whose useful range differs from the
    divergences' (`DEFAULT_GREEDY_THRESHOLD`)."""
    return settings if given or not greedy else replace(settings, threshold=DEFAULT_GREEDY_THRESHOLD)
