"""What a sweep runs and what it measures, as plain records: the methods, a setup (how the pair is
loaded), a configuration (one method at one setting), a measurement (one timed generation and its
quality) and the sweep's result.

Torch-free (the standard library and fsd-chat's step statistics only), so that the stages that
analyse measurements (metrics, curves, report, plot, terminal) load without torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from fsd_chat.decoding.events import GenerationStats
from fsd_chat.decoding.settings import DivergenceName, DraftPolicyName, Rule
from fsd_chat.models.options import Quantization

Method = Literal[
    "autoregressive",
    "exact",
    "hf-assisted",
    "hf-assisted-default",
    "hf-prompt-lookup",
    "hf-ensemble",
    "hf-autoregressive",
    "hf-static",
    "llama.cpp",
    "llama.cpp-lookup",
    "fuzzy",
    "pure",
    "mixture",
]
BASELINES: tuple[Method, ...] = (
    "autoregressive",
    "exact",
    "hf-assisted",
    "hf-assisted-default",
    "hf-prompt-lookup",
    "hf-ensemble",
    "hf-autoregressive",
    "hf-static",
    "llama.cpp",
    "llama.cpp-lookup",
)
"""The methods of `--baselines`. `hf-ensemble` is transformers' own lossy verification
(`generate(assistant_model=..., assistant_ensemble_weight=w)`), run at every `--ensemble-weights` w;
`hf-autoregressive` is transformers' plain `generate` (eager, dynamic cache) and `hf-static`
`generate(cache_implementation="static")`, whose decode step transformers compiles on CUDA.
`llama.cpp` is llama.cpp's own decoding of the target's GGUF file and `llama.cpp-lookup` its prompt
lookup decoding (`fsd_chat.bench.llama_baselines`), for a pair on the llama.cpp engine."""
LLAMA_CPP_METHODS: tuple[Method, ...] = ("llama.cpp", "llama.cpp-lookup")
"""The methods llama-cpp-python runs itself, on a `Llama` of their own (`bench.llama_baselines`)."""
HF_TARGET_ONLY: tuple[Method, ...] = ("hf-autoregressive", "hf-static")
"""transformers' target-only baselines (no draft, no k)."""
TARGET_ONLY: tuple[Method, ...] = ("autoregressive", *HF_TARGET_ONLY, "llama.cpp")
"""The methods that decode with the target alone: compared with each other at no k."""
HF_METHODS: tuple[Method, ...] = (
    "hf-assisted",
    "hf-assisted-default",
    "hf-prompt-lookup",
    "hf-ensemble",
    *HF_TARGET_ONLY,
)
"""The methods transformers' `generate` runs, on models of their own (`bench.methods`)."""
UNMETERED: tuple[Method, ...] = ("hf-static",)
"""The methods run without the forward meters' hooks (they would be traced into transformers'
compiled step): their forward counts are their tokens, their forward times unknown."""
UNCOUNTED_DRAFTS: tuple[Method, ...] = (*TARGET_ONLY, "hf-prompt-lookup", "llama.cpp-lookup")
"""The methods with no drafted-token count: target-only decoding, and transformers' and
llama-cpp-python's prompt lookup, whose drafts they do not count. Every other method's mean k is a figure, 0 where it
drafted nothing (a draft policy that paused throughout)."""
HF_ASSISTED: tuple[Method, ...] = ("hf-assisted", "hf-assisted-default", "hf-ensemble")
"""The baselines that run transformers' assisted generation with the draft model."""
FSD_RULES: tuple[Method, ...] = ("fuzzy", "pure", "mixture")
"""The lossy rules a sweep can run (`--rules`); each draws one curve per divergence (if any) and k."""
RULE_OF: dict[Method, Rule] = {
    "exact": "exact",
    "fuzzy": "fuzzy",
    "pure": "pure",
    "mixture": "mixture",
}
"""The acceptance rule of each method that runs fsd-chat's speculative decoder."""
DIVERGENCE_RULES: tuple[Method, ...] = ("fuzzy", "pure")
"""The rules whose threshold is a divergence bound, swept over `--divergences` × `--thresholds`."""


@dataclass(frozen=True, slots=True)
class Setup:
    """How the pair is loaded: compute dtype and bitsandbytes quantization of each model on the
    transformers engine; on llama.cpp, the engine and the GGUF file's type (`engine`, `file_type`,
    set once the pair has loaded: the dtype and bitsandbytes fields do not apply there)."""

    dtype: str
    quantize_target: Quantization = "none"
    quantize_draft: Quantization = "none"
    engine: str = "transformers"
    file_type: str | None = None

    @property
    def label(self) -> str:
        """Short label, e.g. "float32", "bfloat16 · target 4bit" or "llama.cpp Q4_1"."""
        if self.engine != "transformers":
            return f"{self.engine} {self.file_type or 'GGUF'}"
        parts = [self.dtype]
        if self.quantize_target != "none":
            parts.append(f"target {self.quantize_target}")
        if self.quantize_draft != "none":
            parts.append(f"draft {self.quantize_draft}")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class Configuration:
    """One measured configuration.

    Attributes:
        setup: How the models are loaded.
        temperature: Sampling temperature (0 = greedy).
        method: autoregressive, exact, hf-assisted, hf-assisted-default, hf-prompt-lookup,
            hf-ensemble, fuzzy, pure or mixture.
        draft_tokens: Draft length k (None for autoregressive and hf-assisted-default).
        divergence: D of the fuzzy test (fuzzy/pure only).
        threshold: The dial of a lossy method. T: in the divergence's units (fuzzy/pure), or the
            per-token KL budget in nats (mixture; the log-probability regret budget when greedy);
            for hf-ensemble, transformers' `assistant_ensemble_weight` w ∈ (0, 1), the target's
            weight in the law it verifies against (w·p + (1 − w)·q; lossless as w → 1). None for
            the lossless baselines.
        draft_policy: fsd-chat's draft-length policy (exact and the lossy rules; "fixed" otherwise).
        top_k, top_p, min_p: Truncation of both models' laws (0, 1, 0: none), every method alike.
    """

    setup: Setup
    temperature: float
    method: Method
    draft_tokens: int | None = None
    divergence: DivergenceName | None = None
    threshold: float | None = None
    draft_policy: DraftPolicyName = "fixed"
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def sampling(self) -> str:
        """The group's sampling for people, e.g. "temperature 1" or "temperature 0.8 · top-p 0.9"."""
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1.0 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p > 0.0 else []
        return " · ".join(parts)

    @property
    def label(self) -> str:
        """Short label of the method part, e.g. "fuzzy js T=0.2 k=4", "mixture T=0.02 k=4" or
        "exact k=8 latency"."""
        parts: list[str] = [self.method]
        if self.divergence is not None:
            parts.append(self.divergence)
        if self.threshold is not None:
            parts.append(f"{'w' if self.method == 'hf-ensemble' else 'T'}={self.threshold:g}")
        if self.draft_tokens is not None:
            parts.append(f"k={self.draft_tokens}")
        if self.draft_policy != "fixed":
            parts.append(self.draft_policy)
        return " ".join(parts)

    @property
    def setup_label(self) -> str:
        """The label of the setup this row ran on: its setup's, but transformers' baselines run on
        transformers whatever engine runs fsd-chat's rows (their dtype names them)."""
        if self.method in HF_METHODS:
            return replace(self.setup, engine="transformers", file_type=None).label
        return self.setup.label

    @property
    def group(self) -> tuple[Setup, float, int, float, float]:
        """Configurations of one group are compared with each other (same models, same sampling)."""
        return (self.setup, self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def curve(self) -> str | None:
        """The trade-off curve this configuration lies on (its rule, divergence and k, through the
        thresholds, and its draft-length policy), e.g. "fuzzy js k=4", "mixture k=4 latency" or
        "hf-ensemble k=4"; None for the lossless baselines."""
        if self.method not in (*FSD_RULES, "hf-ensemble"):
            return None
        divergence = "" if self.divergence is None else f" {self.divergence}"
        policy = "" if self.draft_policy == "fixed" else f" {self.draft_policy}"
        return f"{self.method}{divergence} k={self.draft_tokens}{policy}"

    @property
    def lossless(self) -> Method:
        """The lossless method this configuration's curve starts from at cost 0: hf-assisted for
        hf-ensemble (w → 1), exact SD for fsd-chat's rules (T = 0)."""
        return "hf-assisted" if self.method == "hf-ensemble" else "exact"

    @property
    def relaxation(self) -> float:
        """How far along its curve the configuration lies from the lossless end (0): T, or 1 − w
        for hf-ensemble (the draft's weight λ); 0 for the lossless baselines."""
        if self.threshold is None:
            return 0.0
        return 1.0 - self.threshold if self.method == "hf-ensemble" else self.threshold


@dataclass(slots=True)
class ForwardTally:
    """Forward passes of one model during one generation (filled in by `meter.ForwardMeter`).

    Attributes:
        calls: Forward passes, the prefill included.
        seconds: Wall-clock seconds in all of them.
        decode_calls: Forward passes after the first (the prefill).
        decode_seconds: Seconds in those.
    """

    calls: int = 0
    seconds: float = 0.0
    decode_calls: int = 0
    decode_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Generation:
    """One timed generation.

    Attributes:
        token_ids: Generated token ids (EOS excluded).
        seconds: Wall-clock seconds of the whole call (prefill included).
        stats: fsd-chat's own step statistics (None for transformers' methods).
        target: The target's forward passes.
        draft: The draft's forward passes.
        costs: Each token's cost in nats (KL of its law from the target's; greedy: regret), for
            hf-ensemble, whose costs transformers does not report (see `bench.methods`); None
            otherwise (fsd-chat's decoders carry theirs in `stats`; hf-assisted is lossless).
        first_token_seconds: Wall-clock seconds from the call to its first token, the time to first
            token (the prompt's prefill and the first step); None for a reply without tokens and for
            transformers' methods, whose `generate` hands the tokens over at its end (a streamer
            would synchronise a CUDA device at every step, slowing the baseline it measures).
    """

    token_ids: list[int]
    seconds: float
    stats: GenerationStats | None
    target: ForwardTally
    draft: ForwardTally
    costs: list[float] | None = None
    first_token_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Measurement:
    """One measured generation and its quality.

    Attributes:
        config: The configuration.
        prompt: Index of the prompt in the set.
        repeat: Repeat number (0-based).
        prompt_ids: The prompt's token ids.
        generation: Tokens, time and forward passes.
        nll: Summed target negative log-likelihood of the reply (nats).
        correct: Whether the reply's answer is right (None when the set has no answers).
    """

    config: Configuration
    prompt: int
    repeat: int
    prompt_ids: list[int]
    generation: Generation
    nll: float
    correct: bool | None


@dataclass(frozen=True, slots=True)
class Kernel:
    """A kernel's name (shortened to 80 characters), its device milliseconds in a profiled reply and
    its calls."""

    name: str
    milliseconds: float
    calls: int


@dataclass(frozen=True, slots=True)
class ReplyProfile:
    """One profiled reply of a configuration (`bench.profile`, `bench --profile`), per generated
    token: wall ms, device busy ms (its kernels' time), kernels, µs in cudaGraphLaunch and in host
    waits for the device; kernels a layer pass; the weight bytes its forward passes read, and those
    per wall second over the device's copy bandwidth (`bandwidth_use`; None: none measured)."""

    tokens: int
    wall_ms: float
    busy_ms: float
    kernels: float
    graph_launch_us: float
    host_wait_us: float
    kernels_per_layer: float
    weight_bytes_per_token: float
    bandwidth_use: float | None
    on_device: bool
    """Whether kernels could be recorded (False on the CPU: the kernel columns are 0)."""
    top_kernels: list[Kernel] = field(default_factory=list)


@dataclass(slots=True)
class ConfigurationRecord:
    """What a sweep records of one configuration besides its measurements.

    Attributes:
        warmup_seconds: Wall-clock seconds of its untimed warm-up reply (first-call allocations and,
            where the method compiles, its compilation: kept apart from the measured runs).
        compiled_graphs: Graphs torch.compile compiled during its measured runs
            (torch._dynamo's `unique_graphs` counter), 0 when compilation stayed in the warm-up.
        cut: Whether it ran past its time budget and was stopped (the reply it was in is dropped,
            and it runs no more).
        measured_seconds: Seconds spent in its measured replies, the one it was cut in included.
        profile: One more reply of it under torch.profiler (`bench --profile`; fsd-chat's rows).
    """

    warmup_seconds: float | None = None
    compiled_graphs: int = 0
    cut: bool = False
    measured_seconds: float = 0.0
    profile: ReplyProfile | None = None


@dataclass(frozen=True, slots=True)
class SweepResult:
    """All measurements, and how the sweep ended.

    Attributes:
        runs: The measured generations.
        exit_status: 0 when it ran to the end, else 128 + the signal that cut it short (130:
            Ctrl-C, 143: SIGTERM).
        records: Each configuration's warm-up, compilation and cut (`ConfigurationRecord`).
        cut_after: The seconds a configuration could spend on its warm-up, and on its measured
            replies, before it was cut (None: no budget).
    """

    runs: list[Measurement]
    exit_status: int = 0
    records: dict[Configuration, ConfigurationRecord] = field(default_factory=dict)
    cut_after: float | None = None

    @property
    def interrupted(self) -> bool:
        """Whether a signal cut the sweep short."""
        return self.exit_status != 0
