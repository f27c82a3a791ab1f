"""The configurations a sweep runs: model setups (dtype × quantization) × truncations (top-k ×
top-p × min-p) × temperatures × methods.

Methods: `autoregressive` (target only), `exact` (standard speculative decoding in fsd-chat's
engine), `hf-assisted` (transformers' `generate(assistant_model=...)` with the same constant k),
`hf-assisted-default` (the same at transformers' own defaults, whatever k), `hf-autoregressive` and
`hf-static` (transformers' target-only `generate`, with a dynamic and a static cache), `hf-ensemble`
(transformers' lossy static-ensemble verification at every `--ensemble-weights` w, same k), FSD's
`fuzzy` / `pure`
rules at every divergence × threshold, and the `mixture` rule at every per-token KL budget of its
own list (nats; it has no divergence, so it is not multiplied by the divergences). Speculative
methods run at every k asked for; fsd-chat's own (exact and the lossy rules) with every
draft-length policy asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from fsd_chat.bench.records import BASELINES, DIVERGENCE_RULES, FSD_RULES, Configuration, Setup
from fsd_chat.decoding.settings import (
    DIVERGENCE_NAMES,
    DRAFT_POLICIES,
    FORMER_DRAFT_POLICIES,
    DecodingSettings,
    SamplingConfig,
)
from fsd_chat.models.options import DTYPES, QUANTIZATIONS
from fsd_chat.support.errors import FsdChatError, SettingsError
from fsd_chat.support.text import renamed_note

T = TypeVar("T")
C = TypeVar("C", bound=str)


def parse_list(text: str, option: str, convert: Callable[[str], T]) -> list[T]:
    """Comma-separated values of `option`, converted and de-duplicated in order.

    Raises:
        FsdChatError: an empty list, or a value `convert` rejects (with ValueError, or with
            FsdChatError naming the value).
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
        if value not in values:
            values.append(value)
    if not values:
        raise FsdChatError(f"{option}: empty list")
    return values


def parse_choices(
    text: str, option: str, allowed: tuple[C, ...], renamed: Mapping[str, C] | None = None
) -> list[C]:
    """Comma-separated names of `option`, each one of `allowed`, de-duplicated in order (an error
    names the current name of a former one: `renamed`, former -> current name).

    Raises:
        FsdChatError: an empty list, or a name not in `allowed`.
    """

    def choose(item: str) -> C:
        # The allowed value itself, not the text: it carries the choices' type.
        for choice in allowed:
            if choice == item:
                return choice
        note = renamed_note(item, renamed or {})
        raise FsdChatError(f"{option}: unknown value {item!r}{note}; choose from {', '.join(allowed)}")

    return parse_list(text, option, choose)


def _threshold(text: str) -> float:
    # The same rule as generate and chat: DecodingSettings raises SettingsError.
    return DecodingSettings(threshold=float(text)).threshold


def _ensemble_weight(text: str) -> float:
    # transformers' own rule (GenerationConfig.validate): w in the open interval (0, 1).
    weight = float(text)
    if not 0.0 < weight < 1.0:
        raise SettingsError(f"an ensemble weight must lie in the open interval (0, 1), got {text}")
    return weight


def _temperature(text: str) -> float:
    return SamplingConfig(temperature=float(text)).temperature


def _top_k(text: str) -> int:
    return SamplingConfig(top_k=int(text)).top_k


def _top_p(text: str) -> float:
    return SamplingConfig(top_p=float(text)).top_p


def _min_p(text: str) -> float:
    return SamplingConfig(min_p=float(text)).min_p


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
    ensemble_weights: str
    temperatures: str | None
    baselines: str
    dtypes: str
    quantize_target: str
    quantize_draft: str
    top_ks: str | None = None
    top_ps: str | None = None
    min_ps: str | None = None

    def unset_sampling(self) -> list[str]:
        """The sampling lists not given (their flags), which `with_sampling` takes from the model."""
        lists = {
            "--temperature": self.temperatures,
            "--top-k": self.top_ks,
            "--top-p": self.top_ps,
            "--min-p": self.min_ps,
        }
        return [flag for flag, given in lists.items() if given is None]

    def with_sampling(self, model: SamplingConfig) -> SweepSpec:
        """This spec with each sampling list left unset (None) taken from `model`, the sampling
        the target's generation_config asks for (`SamplingRequest.resolve`)."""

        def default(given: str | None, value: float) -> str:
            return given if given is not None else f"{value:g}"

        return replace(
            self,
            temperatures=default(self.temperatures, model.temperature),
            top_ks=default(self.top_ks, model.top_k),
            top_ps=default(self.top_ps, model.top_p),
            min_ps=default(self.min_ps, model.min_p),
        )


def _resolved(text: str | None) -> str:
    if text is None:
        raise ValueError("a sampling list is unset: resolve it first (SweepSpec.with_sampling)")
    return text


def build_sweep(spec: SweepSpec, *, auto_dtype: str) -> tuple[list[Setup], list[Configuration]]:
    """Parse the lists and expand them into setups and configurations (in a fixed order).

    `auto_dtype` is what dtype "auto" means on the device (so that reports name the real dtype).

    Raises:
        FsdChatError: any malformed or out-of-range list item.
        ValueError: a sampling list left unset (resolve it first: `SweepSpec.with_sampling`).
    """
    thresholds = parse_list(spec.thresholds, "--thresholds", _threshold)
    divergences = parse_choices(spec.divergences, "--divergences", DIVERGENCE_NAMES)
    rules = [] if spec.rules.strip() == "none" else parse_choices(spec.rules, "--rules", FSD_RULES)
    budgets = parse_list(spec.mixture_thresholds, "--mixture-thresholds", _threshold)
    weights = parse_list(spec.ensemble_weights, "--ensemble-weights", _ensemble_weight)
    ks = parse_list(spec.draft_tokens, "--draft-tokens", _draft_tokens)
    policies = parse_choices(spec.draft_policies, "--draft-policies", DRAFT_POLICIES, FORMER_DRAFT_POLICIES)
    temperatures = parse_list(_resolved(spec.temperatures), "--temperature", _temperature)
    truncations = list(
        itertools.product(
            parse_list(_resolved(spec.top_ks), "--top-k", _top_k),
            parse_list(_resolved(spec.top_ps), "--top-p", _top_p),
            parse_list(_resolved(spec.min_ps), "--min-p", _min_p),
        )
    )
    baselines = (
        []
        if spec.baselines.strip() in ("", "none")
        else parse_choices(spec.baselines, "--baselines", BASELINES)
    )
    dtypes = [auto_dtype if d == "auto" else d for d in parse_choices(spec.dtypes, "--dtype", DTYPES)]
    quant_t = parse_choices(spec.quantize_target, "--quantize-target", QUANTIZATIONS)
    quant_d = parse_choices(spec.quantize_draft, "--quantize-draft", QUANTIZATIONS)
    setups = [Setup(d, qt, qd) for d in dtypes for qt in quant_t for qd in quant_d]
    configs: list[Configuration] = []
    for setup, (top_k, top_p, min_p) in itertools.product(setups, truncations):
        for temperature in temperatures:
            start = len(configs)
            configs += [
                Configuration(setup, temperature, m)
                for m in (
                    "autoregressive",
                    "hf-autoregressive",
                    "hf-static",
                    "hf-assisted-default",
                    "llama.cpp",
                )
                if m in baselines
            ]
            for k in ks:
                configs += [
                    Configuration(setup, temperature, m, k)
                    for m in ("hf-assisted", "hf-prompt-lookup", "llama.cpp-lookup")
                    if m in baselines
                ]
                if "hf-ensemble" in baselines:
                    configs += [Configuration(setup, temperature, "hf-ensemble", k, None, w) for w in weights]
                for policy in policies:
                    if "exact" in baselines:
                        configs.append(Configuration(setup, temperature, "exact", k, draft_policy=policy))
                    for rule in rules:
                        if rule in DIVERGENCE_RULES:
                            configs += [
                                Configuration(setup, temperature, rule, k, divergence, threshold, policy)
                                for divergence in divergences
                                for threshold in thresholds
                            ]
                        else:
                            configs += [
                                Configuration(setup, temperature, rule, k, None, t, policy) for t in budgets
                            ]
            configs[start:] = [replace(c, top_k=top_k, top_p=top_p, min_p=min_p) for c in configs[start:]]
    return setups, configs
