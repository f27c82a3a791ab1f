"""What went wrong while loading a model, in one line: damaged or pickled weights, a checkpoint
that does not hold the model's weights, a quantized forward pass that fails, memory."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from fsd_chat.engines.torch_engine.kv_cache import input_device
from fsd_chat.models.options import ModelSpec
from fsd_chat.support.errors import DeviceMemoryError, ModelLoadError
from fsd_chat.support.text import some

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel


def weight_files(source: str) -> list[Path]:
    """The weights files of a local model directory (empty for a Hub id)."""
    folder = Path(source)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))


def damaged_file(source: str) -> str:
    """The first local safetensors file whose header cannot be read (else the model source)."""
    for path in weight_files(source):
        if path.suffix == ".safetensors":
            try:
                with safe_open(path, framework="pt"):
                    pass
            except (SafetensorError, OSError):
                return str(path)
    return source


def refused_pickle(spec: ModelSpec, exc: pickle.UnpicklingError) -> str:
    # torch's message is a page long; its one useful line names the global it refused.
    found = re.search(r"WeightsUnpickler error: ([^.\n]+)", str(exc))
    reason = found.group(1) if found else first_line(exc)
    return (
        f"{spec.source}: refused to load its pickled weights (pytorch_model.bin), which would run code "
        f"({reason}); use a safetensors copy"
    )


def check_load_report(spec: ModelSpec, source: str, report: dict[str, Any]) -> None:
    """Refuse a model whose checkpoint lacks weights or has the wrong shapes: transformers would fill
    them with random values and the model would write gibberish. Unexpected extra tensors alone are
    harmless (they are ignored) and only named when something else is wrong."""
    missing = sorted(report.get("missing_keys") or ())
    mismatched = sorted(
        str(key[0] if isinstance(key, tuple) else key) for key in report.get("mismatched_keys") or ()
    )
    unexpected = sorted(report.get("unexpected_keys") or ())
    if not missing and not mismatched:
        return
    files = ", ".join(str(p) for p in weight_files(source)) or spec.source
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors ({some(missing)})")
    if mismatched:
        problems.append(f"{len(mismatched)} tensors of the wrong shape ({some(mismatched)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors ({some(unexpected)})")
    raise ModelLoadError(f"{files} does not hold this model's weights: {'; '.join(problems)}")


def check_quantized_forward(spec: ModelSpec, model: PreTrainedModel) -> None:
    # Some bitsandbytes kernels accept the weights at load time and fail only on the first
    # forward pass (e.g. the CPU 4-bit kernel needs layer widths divisible by 32): fail here,
    # with a clear message, rather than mid-reply.
    token = torch.zeros((1, 1), dtype=torch.long, device=input_device(model))
    try:
        with torch.inference_mode():
            model(input_ids=token, use_cache=False)
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(spec, exc) from None
    except (RuntimeError, AssertionError, ValueError, NotImplementedError) as exc:
        raise load_failure(spec, exc) from exc


def out_of_memory(spec: ModelSpec, exc: BaseException) -> DeviceMemoryError:
    return DeviceMemoryError(
        f"{spec.source} did not fit in GPU memory while loading ({first_line(exc)}): try "
        "--quantize-target 4bit (or 8bit), a smaller draft model, or --device cpu"
    )


def load_failure(spec: ModelSpec, exc: BaseException) -> ModelLoadError:
    if spec.quantization != "none":
        return ModelLoadError(f"{spec.quantization} quantization of {spec.source} failed: {first_line(exc)}")
    return ModelLoadError(f"could not load {spec.source}: {first_line(exc)}")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
