"""The torch device and dtype a `--device` / `--dtype` value names, and where a target's layers go
(one device, or spread over several GPUs)."""

from __future__ import annotations

import torch

from fsd_chat.models.options import LoadOptions, check_device_name, check_dtype_name
from fsd_chat.support.errors import ModelLoadError


def resolve_device(device: str) -> torch.device:
    """The torch device for a `--device` value.

    Raises:
        ModelLoadError: CUDA was asked for but is not available, or the value is malformed.
    """
    check_device_name(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but this torch build sees no CUDA GPU")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s)")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype for a `--dtype` value on `device`.

    Raises:
        ModelLoadError: unknown dtype name.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    check_dtype_name(dtype)
    return getattr(torch, dtype)


def target_device_map(options: LoadOptions) -> str | None:
    """ "auto" (accelerate spreads the target's layers over every GPU) when `--device` is auto or
    cuda and there are several GPUs; None (the whole model on one device) otherwise. An explicit
    cuda:N keeps the target on that GPU."""
    several_gpus = torch.cuda.is_available() and torch.cuda.device_count() > 1
    return "auto" if several_gpus and options.device in ("auto", "cuda") else None
