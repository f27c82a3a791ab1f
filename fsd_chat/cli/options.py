"""The options of `generate`, `chat` and `bench`, each declared once (an `Option`, `cli/option.py`),
and their conversion into the library's settings objects.

A command takes its options with `@takes(...)`: the typer parameters are built from these
declarations, so a flag's spelling, type, default, help and check exist in one place. config.toml's
keys, their types and their checks come from the same declarations (`config_values`), so a bad value
there fails with the same one line as the flag. Read rather than copied: copies drift.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from fsd_chat.cli.option import Option, one_of
from fsd_chat.decoding.settings import (
    DEFAULT_DRAFT_POLICY,
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_GREEDY_THRESHOLD,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_THRESHOLD,
    DIVERGENCE_NAMES,
    DRAFT_POLICIES,
    FORMER_DRAFT_POLICIES,
    LOOKUP,
    RULES,
    DecodingSettings,
    DivergenceName,
    DraftPolicyName,
    Rule,
    SamplingConfig,
    SamplingRequest,
    check_max_new_tokens,
)
from fsd_chat.models.options import (
    DTYPES,
    ENGINES,
    QUANTIZATIONS,
    Engine,
    LoadOptions,
    ModelSpec,
    Quantization,
    check_device_name,
    check_dtype_name,
    check_engine,
    check_quantization,
    pair_specs,
)
from fsd_chat.support.threads import check_threads_batch, choose_threads

MODELS = "Models"
DECODING = "Decoding"
SAMPLING = "Sampling"
CHAT = "Chat"


_DEFAULTS = DecodingSettings()
_SAMPLING = SamplingConfig()

T = TypeVar("T")


def _checked_by(settings: Callable[..., object], field: str) -> Callable[[T], T]:
    """The check of the option that sets `field` of `settings` (`DecodingSettings`,
    `SamplingConfig`): the settings object's own validation of that one value, the other fields at
    their defaults, so that a flag and config.toml are refused by the rule the decoder applies, as
    soon as they are read. Returns the checked value.

    The returned check raises SettingsError for a value the settings object refuses.
    """

    def check(value: T) -> T:
        return cast(T, getattr(settings(**{field: value}), field))

    return check


TARGET = Option(
    "target",
    ("--target",),
    str,
    None,
    "Target model: a Hugging Face Hub id, a local directory, a GGUF file (path, folder, or Hub repo_id:file.gguf), "
    "or default (the default chat model, SmolLM2-135M-Instruct, fetched once).",
    MODELS,
)
DRAFT = Option(
    "draft",
    ("--draft",),
    str,
    None,
    f"Draft model (one with another tokenizer is mapped onto the target's vocabulary), or {LOOKUP} "
    "(prompt lookup: drafts copied from the conversation, no draft model; the default).",
    MODELS,
)
QUANTIZE_TARGET = Option(
    "quantize_target",
    ("--quantize-target",),
    str,
    "none",
    "bitsandbytes quantization of the target.",
    MODELS,
    check_quantization,
    QUANTIZATIONS,
)
QUANTIZE_DRAFT = QUANTIZE_TARGET.replace(
    name="quantize_draft", flags=("--quantize-draft",), help="bitsandbytes quantization of the draft."
)
DEVICE = Option(
    "device",
    ("--device",),
    str,
    "auto",
    "auto (CUDA when available), cpu, cuda or cuda:N.",
    MODELS,
    check_device_name,
)
DTYPE = Option(
    "dtype",
    ("--dtype",),
    str,
    "auto",
    "Weights' dtype; auto: bfloat16 on CUDA (float16 on a GPU without it), float32 on CPU.",
    MODELS,
    check_dtype_name,
    DTYPES,
)
ENGINE = Option(
    "engine",
    ("--engine",),
    str,
    "auto",
    "What runs the models: llama.cpp (GGUF files, natively quantized), transformers (any model; a GGUF file "
    "is converted to float32 once), or auto (llama.cpp for a GGUF file when llama-cpp-python is installed).",
    MODELS,
    check_engine,
    ENGINES,
)
THREADS = Option(
    "threads",
    ("--threads",),
    int,
    None,
    "CPU threads of torch and llama.cpp (default: the cores idle at the start, one fewer in the chat).",
    MODELS,
    choose_threads,
)
THREADS_BATCH = Option(
    "threads_batch",
    ("--threads-batch",),
    int,
    None,
    "llama.cpp's CPU threads for forwards of several tokens: a prompt's prefill, a verify (default: "
    "--threads if given, else the cores idle at the start).",
    MODELS,
    check_threads_batch,
)
TRUST_REMOTE_CODE = Option(
    "trust_remote_code",
    ("--trust-remote-code/--no-trust-remote-code",),
    bool,
    False,
    "Let model repositories run their own code.",
    MODELS,
)
THRESHOLD = Option(
    "threshold",
    ("--threshold", "-T"),
    float,
    None,
    "Threshold T: greedy, nats of regret per token under every rule; sampling, divergence units for "
    f"fuzzy/pure and nats per token for mixture; 0 = exact SD. Default: {DEFAULT_GREEDY_THRESHOLD:g} "
    f"greedy, {DEFAULT_THRESHOLD:g} sampling.",
    DECODING,
    _checked_by(DecodingSettings, "threshold"),
)
DIVERGENCE = Option(
    "divergence",
    ("--divergence",),
    str,
    _DEFAULTS.divergence,
    "Divergence D(p, q) for the fuzzy test.",
    DECODING,
    one_of("divergence", DIVERGENCE_NAMES),
    DIVERGENCE_NAMES,
)
RULE = Option(
    "rule",
    ("--rule",),
    str,
    _DEFAULTS.rule,
    "exact (standard SD), fuzzy (SD test or D ≤ T; FSD), pure (D ≤ T only; the paper's code) "
    "or mixture (SD against (1 − λ)p + λq̄, at most T nats per token).",
    DECODING,
    one_of("rule", RULES),
    RULES,
)
DRAFT_TOKENS = Option(
    "draft_tokens",
    ("--draft-tokens", "-k"),
    int,
    DEFAULT_DRAFT_TOKENS,
    "Draft length k (fixed), its start (heuristic) or its cap (goodput, latency).",
    DECODING,
    _checked_by(DecodingSettings, "draft_tokens"),
)
DRAFT_POLICY = Option(
    "draft_policy",
    ("--draft-policy",),
    str,
    DEFAULT_DRAFT_POLICY,
    "Draft length per step: goodput (the k, 0 included, with the most expected tokens/s: "
    "target-only steps while drafting does not pay), fixed (k), heuristic (+2 after a full accept, "
    "−1 after a rejection) or latency (draft while one more token's expected gain beats its measured time).",
    DECODING,
    one_of("draft policy", DRAFT_POLICIES, FORMER_DRAFT_POLICIES),
    DRAFT_POLICIES,
)
COMPILE = Option(
    "compile",
    ("--compile/--no-compile",),
    bool,
    None,
    "Compile the target's and the draft's decoding steps (torch.compile; CUDA graphs on a GPU) over "
    "static KV caches: the load (the whole step's, compiled before its capture) or the first replies "
    "wait for compilation, later steps run faster. Default: on "
    "a CUDA device, off on the CPU; a model that cannot be compiled runs eagerly, with a one-line reason.",
    DECODING,
)
WHOLE_STEP = Option(
    "whole_step",
    ("--whole-step/--no-whole-step",),
    bool,
    None,
    "Run each decoding step, speculative or target-only, as one function over static buffers: one "
    "captured CUDA graph a step on CUDA (captured while the models load), eager on the CPU. For a "
    "draft of the target's vocabulary or prompt lookup (a mapped draft keeps its usual steps). Its "
    "step functions are compiled before the capture (each decoder layer compiled once) unless "
    "--no-compile is given. Default: on for transformers models of full-attention layers (on the "
    "CPU measured no slower than per-forward steps, faster when drafting). llama.cpp runs its own steps.",
    DECODING,
)
AUTOREGRESSIVE = Option(
    "autoregressive",
    ("--autoregressive/--no-autoregressive",),
    bool,
    False,
    "Target-only decoding (no draft: the baseline).",
    DECODING,
)
_MODELS_OWN = " Default: the target's generation_config, else {}."
TEMPERATURE = Option(
    "temperature",
    ("--temperature",),
    float,
    None,
    "0 = greedy." + _MODELS_OWN.format(f"{_SAMPLING.temperature:g} (greedy)"),
    SAMPLING,
    _checked_by(SamplingConfig, "temperature"),
)
TOP_P = Option(
    "top_p",
    ("--top-p",),
    float,
    None,
    "Nucleus sampling mass (1 = off)." + _MODELS_OWN.format("off"),
    SAMPLING,
    _checked_by(SamplingConfig, "top_p"),
)
TOP_K = Option(
    "top_k",
    ("--top-k",),
    int,
    None,
    "Keep the k most likely tokens (0 = off)." + _MODELS_OWN.format("off"),
    SAMPLING,
    _checked_by(SamplingConfig, "top_k"),
)
MIN_P = Option(
    "min_p",
    ("--min-p",),
    float,
    None,
    "Keep tokens at least min-p times as likely as the most likely one (0 = off)."
    + _MODELS_OWN.format("off"),
    SAMPLING,
    _checked_by(SamplingConfig, "min_p"),
)
SEED = Option("seed", ("--seed",), int, None, "Random seed.", SAMPLING, _checked_by(SamplingConfig, "seed"))
MAX_NEW_TOKENS = Option(
    "max_new_tokens",
    ("--max-new-tokens",),
    int,
    DEFAULT_MAX_NEW_TOKENS,
    "Cap on generated tokens per reply.",
    SAMPLING,
    check_max_new_tokens,
)
RAW = Option("raw", ("--raw/--no-raw",), bool, False, "Plain text, no chat template.", CHAT)

MODEL_OPTIONS: tuple[Option[Any], ...] = (
    ENGINE,
    QUANTIZE_TARGET,
    QUANTIZE_DRAFT,
    DEVICE,
    DTYPE,
    TRUST_REMOTE_CODE,
)
"""The model options that `pair_specs` reads, besides --target and --draft."""
DECODING_OPTIONS: tuple[Option[Any], ...] = (THRESHOLD, DIVERGENCE, RULE, DRAFT_TOKENS, DRAFT_POLICY)
SAMPLING_OPTIONS: tuple[Option[Any], ...] = (TEMPERATURE, TOP_P, TOP_K, MIN_P, SEED)
REPLY_OPTIONS: tuple[Option[Any], ...] = (
    *DECODING_OPTIONS,
    COMPILE,
    WHOLE_STEP,
    AUTOREGRESSIVE,
    *SAMPLING_OPTIONS,
    MAX_NEW_TOKENS,
    *MODEL_OPTIONS,
    THREADS,
    THREADS_BATCH,
    RAW,
)
"""The options of a reply, which `generate` and `chat` both take."""


def model_specs(
    target: str, draft: str, values: Mapping[str, object]
) -> tuple[ModelSpec, ModelSpec, LoadOptions]:
    """`pair_specs` of a command's model options (`MODEL_OPTIONS` in `values`)."""
    return pair_specs(
        target,
        draft,
        cast(Quantization, QUANTIZE_TARGET.of(values)),
        cast(Quantization, QUANTIZE_DRAFT.of(values)),
        DEVICE.of(values),
        DTYPE.of(values),
        TRUST_REMOTE_CODE.of(values),
        cast(Engine, ENGINE.of(values)),
    )


def decoding_settings(values: Mapping[str, object]) -> DecodingSettings:
    """A command's decoding options (`DECODING_OPTIONS` in `values`) -> `DecodingSettings`.

    Raises:
        SettingsError: a value out of range.
    """
    return DecodingSettings(
        rule=cast(Rule, RULE.of(values)),
        divergence=cast(DivergenceName, DIVERGENCE.of(values)),
        # Not given: the sampling default, which a greedy model's resolved sampling replaces
        # (`default_threshold`, once the target's generation_config is read).
        threshold=DEFAULT_THRESHOLD if (given := THRESHOLD.get(values)) is None else given,
        draft_tokens=DRAFT_TOKENS.of(values),
        draft_policy=cast(DraftPolicyName, DRAFT_POLICY.of(values)),
    )


def sampling_request(values: Mapping[str, object]) -> SamplingRequest:
    """A command's sampling options (`SAMPLING_OPTIONS` in `values`) -> `SamplingRequest` (what is
    not given is left to the target's generation_config).

    Raises:
        SettingsError: a value out of range.
    """
    return SamplingRequest(
        temperature=TEMPERATURE.get(values),
        top_k=TOP_K.get(values),
        top_p=TOP_P.get(values),
        min_p=MIN_P.get(values),
        seed=SEED.get(values),
    )
