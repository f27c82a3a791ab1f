"""What to load and where: model sources, quantization and placement options (no torch here, so
the command line parses its options without loading it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsd_chat.models.default_model import resolve_target
from fsd_chat.support.errors import ModelLoadError

Quantization = Literal["none", "8bit", "4bit"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "8bit", "4bit")


def quantization_note(quantization: str) -> str:
    """What follows a model's name to say how bitsandbytes quantized it: " (8bit)", " (4bit)", or
    nothing for an unquantized model (its dtype is said with the device)."""
    return "" if quantization == "none" else f" ({quantization})"


DTYPES = ("auto", "float32", "bfloat16", "float16")

Engine = Literal["auto", "transformers", "llama.cpp"]
ENGINES: tuple[Engine, ...] = ("auto", "transformers", "llama.cpp")
"""`--engine`: auto takes llama.cpp for a GGUF file when llama-cpp-python is installed, else
transformers (`fsd_chat.models.engine_choice`)."""


def check_engine(engine: str) -> Engine:
    """Check an `--engine` value; returns it.

    Raises:
        ModelLoadError: not one of ENGINES.
    """
    if engine not in ENGINES:
        raise ModelLoadError(f"unknown engine {engine!r}; use {', '.join(ENGINES)}")
    return engine


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(device: str) -> str:
    """Check the spelling of a `--device` value (whether the device exists is checked at load);
    returns it (the converter of `--device`, flag or config.toml).

    Raises:
        ModelLoadError: anything but auto, cpu, cuda or cuda:N.
    """
    if not _DEVICE.fullmatch(device):
        raise ModelLoadError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    return device


def check_dtype_name(dtype: str) -> str:
    """Check a `--dtype` value; returns it.

    Raises:
        ModelLoadError: not one of DTYPES.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use {', '.join(DTYPES)}")
    return dtype


def check_quantization(quantization: str) -> Quantization:
    """Check a `--quantize-target` / `--quantize-draft` value; returns it.

    Raises:
        ModelLoadError: not one of QUANTIZATIONS.
    """
    for known in QUANTIZATIONS:
        if quantization == known:
            return known
    raise ModelLoadError(f"unknown quantization {quantization!r}; use {', '.join(QUANTIZATIONS)}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where a model comes from and how it is quantized.

    Attributes:
        source: A Hugging Face Hub id ("HuggingFaceTB/SmolLM2-135M-Instruct"), a local directory, or
            a GGUF file: a `.gguf` path, a folder holding one, a Hub "repo_id:file.gguf" (`gguf_files`).
        quantization: "none", "8bit" (LLM.int8) or "4bit" (NF4), via bitsandbytes.
    """

    source: str
    quantization: Quantization = "none"

    @property
    def name(self) -> str:
        """Short display name: the directory, file or repository name."""
        return Path(self.source.rstrip("/")).name or self.source


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """Placement options shared by both models.

    Attributes:
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        dtype: "auto" (bfloat16 on CUDA where supported, else float16; float32 on the CPU),
            "float32", "bfloat16" or "float16".
        trust_remote_code: Allow model repositories to run their own code (off by default).
        prepack: Prepack the large float32 linear layers of a model on the CPU for oneDNN
            (`fsd_chat.engines.torch_engine.packed_linear`: SmolLM2-135M decodes 1.6× faster). Off only for
            the bench's transformers baselines, which run the models as transformers loads them.
        engine: What runs the models: "transformers", "llama.cpp" (GGUF files, natively
            quantized) or "auto" (llama.cpp for a GGUF file when it is installed).
        threads: llama.cpp's CPU threads (None: torch's thread count, which the commands set from
            `--threads`).
    """

    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    prepack: bool = True
    engine: Engine = "auto"
    threads: int | None = None


def pair_specs(
    target: str,
    draft: str,
    quantize_target: Quantization,
    quantize_draft: Quantization,
    device: str,
    dtype: str,
    trust_remote_code: bool,
    engine: Engine = "auto",
) -> tuple[ModelSpec, ModelSpec, LoadOptions]:
    """Model options -> (target spec, draft spec, load options); target "default" is the default
    chat model (`resolve_target`: fetched first if absent).

    Raises:
        ModelLoadError: the default model could not be fetched.
    """
    return (
        ModelSpec(resolve_target(target), quantize_target),
        ModelSpec(draft, quantize_draft),
        LoadOptions(device=device, dtype=dtype, trust_remote_code=trust_remote_code, engine=engine),
    )
