"""The configurations a sweep runs: model setups (dtype × quantization) × temperatures × methods.

Methods: `autoregressive` (target only), `exact` (standard speculative decoding in fsd-chat's
engine), `hf-assisted` (transformers' `generate(assistant_model=...)` with the same constant k),
`hf-assisted-default` (the same at transformers' own defaults, whatever k), FSD's `fuzzy` / `pure`
rules at every divergence × threshold, and the `mixture` rule at every per-token KL budget of its
own list (nats; it has no divergence, so it is not multiplied by the divergences). Speculative
methods run at every k asked for; fsd-chat's own (exact and the lossy rules) with every
draft-length policy asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from fsd_chat.decoding.settings import (
    DIVERGENCE_NAMES,
    DRAFT_POLICIES,
    DecodingSettings,
    SamplingConfig,
)
from fsd_chat.errors import FsdChatError, SettingsError
from fsd_chat.model_options import DTYPES, QUANTIZATIONS

Method = Literal["autoregressive", "exact", "hf-assisted", "hf-assisted-default", "fuzzy", "pure", "mixture"]
BASELINES: tuple[Method, ...] = ("autoregressive", "exact", "hf-assisted", "hf-assisted-default")
FSD_RULES: tuple[Method, ...] = ("fuzzy", "pure", "mixture")
"""The lossy rules a sweep can run (`--rules`); each draws one curve per divergence (if any) and k."""
DIVERGENCE_RULES: tuple[Method, ...] = ("fuzzy", "pure")
"""The rules whose threshold is a divergence bound, swept over `--divergences` × `--thresholds`."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Setup:
    """How the pair is loaded: compute dtype and bitsandbytes quantization of each model."""

    dtype: str
    quantize_target: str = "none"
    quantize_draft: str = "none"

    @property
    def label(self) -> str:
        """Short label, e.g. "float32" or "bfloat16 · target 4bit"."""
        parts = [self.dtype]
        if self.quantize_target != "none":
            parts.append(f"target {self.quantize_target}")
        if self.quantize_draft != "none":
            parts.append(f"draft {self.quantize_draft}")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class Config:
    """One measured configuration.

    Attributes:
        setup: How the models are loaded.
        temperature: Sampling temperature (0 = greedy).
        method: autoregressive, exact, hf-assisted, hf-assisted-default, fuzzy, pure or mixture.
        draft_tokens: Draft length k (None for autoregressive and hf-assisted-default).
        divergence: D of the fuzzy test (fuzzy/pure only).
        threshold: T: in the divergence's units (fuzzy/pure), or the per-token KL budget in nats
            (mixture; the log-probability regret budget when greedy). None for the baselines.
        draft_policy: fsd-chat's draft-length policy (exact and the lossy rules; "fixed" otherwise).
    """

    setup: Setup
    temperature: float
    method: Method
    draft_tokens: int | None = None
    divergence: str | None = None
    threshold: float | None = None
    draft_policy: str = "fixed"

    @property
    def label(self) -> str:
        """Short label of the method part, e.g. "fuzzy js T=0.2 k=4", "mixture T=0.02 k=4" or
        "exact k=8 cost"."""
        parts: list[str] = [self.method]
        if self.divergence is not None:
            parts.append(self.divergence)
        if self.threshold is not None:
            parts.append(f"T={self.threshold:g}")
        if self.draft_tokens is not None:
            parts.append(f"k={self.draft_tokens}")
        if self.draft_policy != "fixed":
            parts.append(self.draft_policy)
        return " ".join(parts)

    @property
    def group(self) -> tuple[Setup, float]:
        """Configurations of one group are compared with each other (same models, same sampling)."""
        return (self.setup, self.temperature)

    @property
    def curve(self) -> str | None:
        """The trade-off curve this configuration lies on (its rule, divergence and k, through the
        thresholds, and its draft-length policy), e.g. "fuzzy js k=4" or "mixture k=4 cost"; None for
        the baselines."""
        if self.method not in FSD_RULES:
            return None
        divergence = "" if self.divergence is None else f" {self.divergence}"
        policy = "" if self.draft_policy == "fixed" else f" {self.draft_policy}"
        return f"{self.method}{divergence} k={self.draft_tokens}{policy}"


def parse_list(text: str, option: str, convert: Callable[[str], T], allowed: tuple[T, ...] = ()) -> list[T]:
    """Comma-separated values of `option`, converted and de-duplicated in order.

    Raises:
        FsdChatError: an empty list, a value `convert` rejects, or one not in `allowed`.
    """
    values: list[T] = []
    for raw in text.split(","):
        item = raw.strip()
        try:
            value = convert(item)
        except SettingsError as exc:
            raise FsdChatError(f"{option}: {exc}") from None
        except ValueError:
            raise FsdChatError(f"{option}: bad value {item!r} in {text!r}") from None
        if allowed and value not in allowed:
            raise FsdChatError(
                f"{option}: unknown value {item!r}; choose from {', '.join(map(str, allowed))}"
            )
        if value not in values:
            values.append(value)
    if not values:
        raise FsdChatError(f"{option}: empty list")
    return values


def _threshold(text: str) -> float:
    # The same rule as generate and chat: DecodingSettings raises SettingsError.
    return DecodingSettings(threshold=float(text)).threshold


def _temperature(text: str) -> float:
    return SamplingConfig(temperature=float(text)).temperature


def _draft_tokens(text: str) -> int:
    return DecodingSettings(draft_tokens=int(text)).draft_tokens


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """The sweep as asked for on the command line (comma-separated lists, still unparsed)."""

    thresholds: str
    divergences: str
    rules: str
    draft_tokens: str
    draft_policies: str
    mixture_thresholds: str
    temperatures: str
    baselines: str
    dtypes: str
    quantize_target: str
    quantize_draft: str


def build_sweep(spec: SweepSpec, *, auto_dtype: str) -> tuple[list[Setup], list[Config]]:
    """Parse the lists and expand them into setups and configurations (in a fixed order).

    `auto_dtype` is what dtype "auto" means on the device (so that reports name the real dtype).

    Raises:
        FsdChatError: any malformed or out-of-range list item.
    """
    thresholds = parse_list(spec.thresholds, "--thresholds", _threshold)
    divergences = parse_list(spec.divergences, "--divergences", str, DIVERGENCE_NAMES)
    rules = [] if spec.rules.strip() == "none" else parse_list(spec.rules, "--rules", str, FSD_RULES)
    budgets = parse_list(spec.mixture_thresholds, "--mixture-thresholds", _threshold)
    ks = parse_list(spec.draft_tokens, "--draft-tokens", _draft_tokens)
    policies = parse_list(spec.draft_policies, "--draft-policies", str, DRAFT_POLICIES)
    temperatures = parse_list(spec.temperatures, "--temperature", _temperature)
    baselines = (
        []
        if spec.baselines.strip() in ("", "none")
        else parse_list(spec.baselines, "--baselines", str, BASELINES)
    )
    dtypes = [auto_dtype if d == "auto" else d for d in parse_list(spec.dtypes, "--dtype", str, DTYPES)]
    quant_t = parse_list(spec.quantize_target, "--quantize-target", str, QUANTIZATIONS)
    quant_d = parse_list(spec.quantize_draft, "--quantize-draft", str, QUANTIZATIONS)
    setups = [Setup(d, qt, qd) for d in dtypes for qt in quant_t for qd in quant_d]
    configs: list[Config] = []
    for setup in setups:
        for temperature in temperatures:
            configs += [
                Config(setup, temperature, m)
                for m in ("autoregressive", "hf-assisted-default")
                if m in baselines
            ]
            for k in ks:
                if "hf-assisted" in baselines:
                    configs.append(Config(setup, temperature, "hf-assisted", k))
                for policy in policies:
                    if "exact" in baselines:
                        configs.append(Config(setup, temperature, "exact", k, draft_policy=policy))
                    for rule in rules:
                        if rule in DIVERGENCE_RULES:
                            configs += [
                                Config(setup, temperature, rule, k, divergence, threshold, policy)  # type: ignore[arg-type]
                                for divergence in divergences
                                for threshold in thresholds
                            ]
                        else:
                            configs += [Config(setup, temperature, rule, k, None, t, policy) for t in budgets]  # type: ignore[arg-type]
    return setups, configs
