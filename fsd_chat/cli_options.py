"""Command-line options shared by `chat`, `generate` and `bench` (typer `Annotated` aliases), and
their conversion into the library's settings objects.

Each command lists the aliases it takes; `pair_specs`, `decoding_settings` and `sampling_config`
turn the values into `ModelSpec`s / `LoadOptions`, `DecodingSettings` and `SamplingConfig`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from fsd_chat.decoding.settings import (
    DEFAULT_DRAFT_TOKENS,
    DecodingSettings,
    DivergenceName,
    Rule,
    SamplingConfig,
)
from fsd_chat.errors import SettingsError
from fsd_chat.model_options import LoadOptions, ModelSpec, Quantization

MODELS = "Models"
DECODING = "Decoding"
SAMPLING = "Sampling"

TargetOpt = Annotated[
    str,
    typer.Option(
        "--target", help="Target model: a Hugging Face Hub id or a local directory.", rich_help_panel=MODELS
    ),
]
DraftOpt = Annotated[
    str,
    typer.Option("--draft", help="Draft model sharing the target's tokenizer.", rich_help_panel=MODELS),
]
QuantizeTargetOpt = Annotated[
    Quantization,
    typer.Option(
        "--quantize-target", help="bitsandbytes quantization of the target.", rich_help_panel=MODELS
    ),
]
QuantizeDraftOpt = Annotated[
    Quantization,
    typer.Option("--quantize-draft", help="bitsandbytes quantization of the draft.", rich_help_panel=MODELS),
]
DeviceOpt = Annotated[
    str,
    typer.Option("--device", help="auto (CUDA when available), cpu, cuda or cuda:N.", rich_help_panel=MODELS),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="auto (bf16/fp16 on CUDA, float32 on CPU), float32, bfloat16 or float16.",
        rich_help_panel=MODELS,
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="torch CPU threads (default: the cores idle at the start, one fewer in the chat).",
        rich_help_panel=MODELS,
    ),
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code", help="Let model repositories run their own code.", rich_help_panel=MODELS
    ),
]
ThresholdOpt = Annotated[
    float,
    typer.Option(
        "--threshold",
        "-T",
        help="Threshold T: divergence units for fuzzy/pure, nats per token for mixture; 0 = exact SD.",
        rich_help_panel=DECODING,
    ),
]
DivergenceOpt = Annotated[
    DivergenceName,
    typer.Option("--divergence", help="Divergence D(p, q) for the fuzzy test.", rich_help_panel=DECODING),
]
RuleOpt = Annotated[
    Rule,
    typer.Option(
        "--rule",
        help="exact (standard SD), fuzzy (SD test or D ≤ T; FSD), pure (D ≤ T only; the paper's code) "
        "or mixture (SD against (1 − λ)p + λq, at most T nats per token).",
        rich_help_panel=DECODING,
    ),
]
DraftTokensOpt = Annotated[
    int,
    typer.Option("--draft-tokens", "-k", help="Draft length k.", rich_help_panel=DECODING),
]
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile/--no-compile",
        help="Compile the draft's one-token forward passes (torch.compile; CUDA graphs on a GPU) over a "
        "static KV cache: the first reply waits for compilation, later draft steps run faster.",
        rich_help_panel=DECODING,
    ),
]
AdaptiveOpt = Annotated[
    bool,
    typer.Option(
        "--adaptive-k",
        help="Adapt k each step (+2 on a full accept, −1 on a rejection).",
        rich_help_panel=DECODING,
    ),
]
TemperatureOpt = Annotated[
    float,
    typer.Option("--temperature", help="0 = greedy.", rich_help_panel=SAMPLING),
]
TopPOpt = Annotated[
    float, typer.Option("--top-p", help="Nucleus sampling mass (1 = off).", rich_help_panel=SAMPLING)
]
TopKOpt = Annotated[
    int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).", rich_help_panel=SAMPLING)
]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Random seed.", rich_help_panel=SAMPLING)]
MaxNewTokensOpt = Annotated[
    int, typer.Option("--max-new-tokens", help="Cap on generated tokens per reply.", rich_help_panel=SAMPLING)
]

MAX_NEW_TOKENS = 10_000_000
"""Upper bound of `--max-new-tokens`: beyond any context window (a reply ends when the window is full
anyway), and small enough for every place the number goes (buffers, SQLite, transformers)."""

DEFAULT_THRESHOLD = DecodingSettings().threshold
DEFAULT_DIVERGENCE: DivergenceName = DecodingSettings().divergence
DEFAULT_RULE: Rule = DecodingSettings().rule
DEFAULT_K = DEFAULT_DRAFT_TOKENS


def check_max_new_tokens(value: int) -> int:
    """`--max-new-tokens` (tokens): the one rule of generate, chat and bench; returns the value.

    Raises:
        SettingsError: outside 1..MAX_NEW_TOKENS.
    """
    if not 1 <= value <= MAX_NEW_TOKENS:
        raise SettingsError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS:,}, got {value}")
    return value


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


def decoding_settings(
    rule: Rule, divergence: DivergenceName, threshold: float, draft_tokens: int, adaptive: bool
) -> DecodingSettings:
    """Decoding options -> `DecodingSettings` (raises SettingsError when out of range)."""
    return DecodingSettings(
        rule=rule, divergence=divergence, threshold=threshold, draft_tokens=draft_tokens, adaptive=adaptive
    )


def sampling_config(temperature: float, top_k: int, top_p: float, seed: int | None) -> SamplingConfig:
    """Sampling options -> `SamplingConfig` (raises SettingsError when out of range)."""
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
