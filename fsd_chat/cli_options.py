"""The options of `generate`, `chat` and `bench`, each declared once (`Option`), and their conversion
into the library's settings objects.

A command takes its options with `@takes(...)`: the typer parameters are built from the
declarations, so a flag's spelling, type, default, help and check exist in one place. config.toml's
keys, their types and their checks come from the same declarations (`config_values`), so a bad value
there fails with the same one line as the flag. Read rather than copied: copies drift.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import typer

from fsd_chat.config import ConfigError, UserConfig
from fsd_chat.decoding.settings import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_THRESHOLD,
    DIVERGENCE_NAMES,
    DRAFT_POLICIES,
    LOOKUP,
    RULES,
    DecodingSettings,
    DivergenceName,
    DraftPolicyName,
    Rule,
    SamplingConfig,
    SamplingRequest,
)
from fsd_chat.errors import FsdChatError, SettingsError
from fsd_chat.model_options import (
    DTYPES,
    QUANTIZATIONS,
    LoadOptions,
    ModelSpec,
    Quantization,
    check_device_name,
    check_dtype_name,
    check_quantization,
)
from fsd_chat.text import some

T = TypeVar("T")
S = TypeVar("S", bound=str)
F = TypeVar("F", bound=Callable[..., None])

MODELS = "Models"
DECODING = "Decoding"
SAMPLING = "Sampling"
CHAT = "Chat"

MAX_NEW_TOKENS_LIMIT = 10_000_000
"""Upper bound of `--max-new-tokens`: beyond any context window (a reply ends when the window is full
anyway), and small enough for every place the number goes (buffers, SQLite, transformers)."""


@dataclass(frozen=True, slots=True)
class Option(Generic[T]):
    """One command-line option, declared once; the typer parameter and the config.toml key are both
    built from it.

    Attributes:
        name: The command's parameter name, and the config.toml key.
        flags: Its spellings, e.g. ("--threshold", "-T"); a boolean's read "--x/--no-x".
        kind: The value's type, str, int, float or bool: what typer converts the flag's text to and
            what config.toml's value must be (an integer is taken for a float).
        default: The value when neither the flag nor config.toml gives one.
        help: The help text.
        panel: The help panel it is listed under (None: the plain "Options").
        check: Validates a value of `kind`, from a flag and from config.toml alike, and returns it;
            raises an `FsdChatError` (one line, exit 2). None: any value of the type is accepted.
        choices: The values it takes, when they are few; shown in the help.
        required: The flag must be given. Otherwise a default of None makes None a value (the
            option has no default of its own, e.g. `--seed`).
    """

    name: str
    flags: tuple[str, ...]
    kind: type[T]
    default: T | None
    help: str
    panel: str | None = None
    check: Callable[[T], T] | None = None
    choices: tuple[str, ...] = ()
    required: bool = False

    def validate(self, value: T | None) -> T | None:
        """`value` once checked (None, the value of an option without a default, is not checked).

        Raises:
            FsdChatError: the check's error.
        """
        return value if value is None or self.check is None else self.check(value)

    def parameter(self) -> inspect.Parameter:
        """The typer parameter (keyword-only) of a command that takes this option."""
        info = typer.Option(
            ... if self.required else self.default,
            *self.flags,
            help=self.help,
            rich_help_panel=self.panel,
            metavar=f"[{'|'.join(self.choices)}]" if self.choices else None,
            callback=self.validate,
            show_default=self.default is not None,
        )
        annotation = self.kind | None if self.default is None and not self.required else self.kind
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation
        )

    def of(self, values: Mapping[str, object]) -> T:
        """This option's value in a command's `values` (of its type, checked when parsed), for an
        option that always has one."""
        return cast(T, values[self.name])

    def get(self, values: Mapping[str, object]) -> T | None:
        """This option's value in a command's `values`, or None (an option without a default, not given)."""
        return cast(T | None, values[self.name])

    def from_config(self, value: object, where: str) -> T | None:
        """A config.toml value of this option, checked as its flag would be.

        Raises:
            ConfigError: a value of the wrong type, or one its check refuses.
        """
        number = self.kind is float and isinstance(value, int)
        # bool is an int in Python, but `threshold = true` is surely a mistake.
        if not (isinstance(value, self.kind) or number) or (
            isinstance(value, bool) and self.kind is not bool
        ):
            raise ConfigError(f"{where}: {self.name} = {value!r} has the wrong type")
        try:
            return self.validate(cast(T, float(cast(int, value)) if number else value))
        except FsdChatError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def replace(self, **changes: Any) -> Option[T]:
        """A variant of this option (another default, or a longer help) for one command."""
        return dataclasses.replace(self, **changes)

    def listed(self, flag: str | None = None) -> Option[str]:
        """The comma-separated form of this option, as `bench` takes it to sweep over its values
        (which the sweep parses and checks): the same help, panel and default; `flag` (e.g.
        "--thresholds") renames it."""
        values = f" ({', '.join(self.choices)})" if self.choices else ""
        return Option(
            flag.removeprefix("--").replace("-", "_") if flag else self.name,
            (flag,) if flag else self.flags,
            str,
            None if self.default is None else str(self.default),
            f"{self.help} Comma-separated{values}: each is measured.",
            self.panel,
        )


def takes(*options: Option[Any]) -> Callable[[F], F]:
    """Decorator: the command also takes these options, as keyword arguments after its own
    parameters (which come first in its help). Its `**values` then hold them by name."""

    def add(command: F) -> F:
        # eval_str: typer takes `__signature__` as it is, and the commands' annotations are strings.
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        command.__signature__ = inspect.Signature([*own, *(o.parameter() for o in options)])  # type: ignore[attr-defined]
        return command

    return add


def one_of(kind: str, choices: tuple[S, ...]) -> Callable[[str], S]:
    """The check of an option whose value is one of `choices`; its error names the `kind` of value.

    The returned check raises SettingsError for any other value.
    """

    def check(value: str) -> S:
        for choice in choices:
            if value == choice:
                return choice
        raise SettingsError(f"unknown {kind} {value!r}; use {', '.join(choices)}")

    return check


def check_max_new_tokens(value: int) -> int:
    """`--max-new-tokens` (tokens): the one rule of generate, chat and bench; returns the value.

    Raises:
        SettingsError: outside 1..MAX_NEW_TOKENS_LIMIT.
    """
    if not 1 <= value <= MAX_NEW_TOKENS_LIMIT:
        raise SettingsError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS_LIMIT:,}, got {value}")
    return value


_DEFAULTS = DecodingSettings()
_SAMPLING = SamplingConfig()

TARGET = Option(
    "target", ("--target",), str, None, "Target model: a Hugging Face Hub id or a local directory.", MODELS
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
    "auto (bf16/fp16 on CUDA, float32 on CPU), float32, bfloat16 or float16.",
    MODELS,
    check_dtype_name,
    DTYPES,
)
THREADS = Option(
    "threads",
    ("--threads",),
    int,
    None,
    "torch CPU threads (default: the cores idle at the start, one fewer in the chat).",
    MODELS,
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
    DEFAULT_THRESHOLD,
    "Threshold T: divergence units for fuzzy/pure, nats per token for mixture; 0 = exact SD.",
    DECODING,
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
    "Draft length k (fixed), its start (adaptive) or its cap (cost).",
    DECODING,
)
DRAFT_POLICY = Option(
    "draft_policy",
    ("--draft-policy",),
    str,
    _DEFAULTS.draft_policy,
    "Draft length per step: fixed (k), adaptive (+2 after a full accept, −1 after a "
    "rejection) or cost (draft while one more token's expected gain beats its measured cost).",
    DECODING,
    one_of("draft policy", DRAFT_POLICIES),
    DRAFT_POLICIES,
)
COMPILE_DRAFT = Option(
    "compile_draft",
    ("--compile/--no-compile",),
    bool,
    False,
    "Compile the draft's one-token forward passes (torch.compile; CUDA graphs on a GPU) over a "
    "static KV cache: the first reply waits for compilation, later draft steps run faster.",
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
)
TOP_P = Option(
    "top_p",
    ("--top-p",),
    float,
    None,
    "Nucleus sampling mass (1 = off)." + _MODELS_OWN.format("off"),
    SAMPLING,
)
TOP_K = Option(
    "top_k",
    ("--top-k",),
    int,
    None,
    "Keep the k most likely tokens (0 = off)." + _MODELS_OWN.format("off"),
    SAMPLING,
)
MIN_P = Option(
    "min_p",
    ("--min-p",),
    float,
    None,
    "Keep tokens at least min-p times as likely as the most likely one (0 = off)."
    + _MODELS_OWN.format("off"),
    SAMPLING,
)
SEED = Option("seed", ("--seed",), int, None, "Random seed.", SAMPLING)
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

MODEL_OPTIONS: tuple[Option[Any], ...] = (QUANTIZE_TARGET, QUANTIZE_DRAFT, DEVICE, DTYPE, TRUST_REMOTE_CODE)
"""The model options that `pair_specs` reads, besides --target and --draft."""
DECODING_OPTIONS: tuple[Option[Any], ...] = (THRESHOLD, DIVERGENCE, RULE, DRAFT_TOKENS, DRAFT_POLICY)
SAMPLING_OPTIONS: tuple[Option[Any], ...] = (TEMPERATURE, TOP_P, TOP_K, MIN_P, SEED)
REPLY_OPTIONS: tuple[Option[Any], ...] = (
    *DECODING_OPTIONS,
    COMPILE_DRAFT,
    AUTOREGRESSIVE,
    *SAMPLING_OPTIONS,
    MAX_NEW_TOKENS,
    *MODEL_OPTIONS,
    THREADS,
    RAW,
)
"""The options of a reply, which `generate` and `chat` both take."""


def config_values(config: UserConfig, options: Iterable[Option[Any]]) -> dict[str, object]:
    """config.toml's settings, checked against the options it may set (those of the chat command).

    Raises:
        ConfigError: an unknown setting, a value of the wrong type, or one its option's check refuses.
    """
    known = {option.name: option for option in options}
    where = str(config.path)
    unknown = sorted(set(config.options) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {some(unknown)}; known: {', '.join(sorted(known))}")
    return {name: known[name].from_config(value, where) for name, value in config.options.items()}


def pair_specs(
    target: str,
    draft: str,
    quantize_target: Quantization,
    quantize_draft: Quantization,
    device: str,
    dtype: str,
    trust_remote_code: bool,
) -> tuple[ModelSpec, ModelSpec, LoadOptions]:
    """Model options -> (target spec, draft spec, load options)."""
    return (
        ModelSpec(target, quantize_target),
        ModelSpec(draft, quantize_draft),
        LoadOptions(device=device, dtype=dtype, trust_remote_code=trust_remote_code),
    )


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
    )


def decoding_settings(values: Mapping[str, object]) -> DecodingSettings:
    """A command's decoding options (`DECODING_OPTIONS` in `values`) -> `DecodingSettings`.

    Raises:
        SettingsError: a value out of range.
    """
    return DecodingSettings(
        rule=cast(Rule, RULE.of(values)),
        divergence=cast(DivergenceName, DIVERGENCE.of(values)),
        threshold=THRESHOLD.of(values),
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
