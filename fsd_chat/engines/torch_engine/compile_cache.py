"""torch.compile's artifacts kept between runs, so that a second start of the same models compiles
as little as torch allows (issue 36: "no reply waits for compilation").

torch keeps its own caches (inductor's FX graph cache, AOTAutograd's) in a temporary folder that a
fresh machine or a cleaned /tmp loses; `torch.compiler.save_cache_artifacts` serialises what this
process compiled into one blob, and `load_cache_artifacts` puts it back before compiling, after
which compilation finds its kernels instead of building them. The blob is a file in the user's
cache folder (`support.config.cache_dir`), one per key: the models' identity (their config and
dtype, which fix the graphs' shapes and code; the weights do not enter a compiled graph), the
torch and transformers versions, and the device (its name and compute capability on CUDA). A file
of another key would only miss in torch's own caches, which key their entries themselves; the key
keeps one configuration's file from overwriting another's.

Used by the whole step's compiled path (`step_graph.CapturedSteps(compile=True)`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fsd_chat.support.config import cache_dir

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel

FOLDER = "compiled"
"""The artifacts' folder inside the user's cache folder."""


def device_identity(device: torch.device) -> str:
    """The device as compiled code depends on it: the GPU's name and compute capability on CUDA,
    the machine's architecture on the CPU."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda {torch.cuda.get_device_name(device)} sm{major}{minor}"
    return f"{device.type} {platform.machine()}"


def artifact_key(models: Sequence[PreTrainedModel], device: torch.device, kind: str) -> str:
    """The key of the artifacts that compiling `kind` (e.g. "whole-step") over `models` on
    `device` leaves: a hash of the models' configs and dtypes, the versions and the device."""
    identity = {
        "kind": kind,
        "models": [{"config": model.config.to_dict(), "dtype": str(model.dtype)} for model in models],
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "device": device_identity(device),
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def artifact_path(
    models: Sequence[PreTrainedModel], device: torch.device, kind: str, folder: Path | None = None
) -> Path:
    """Where the artifacts of `artifact_key` are kept (`folder`: default the user's cache folder's
    `FOLDER`)."""
    return (folder or cache_dir() / FOLDER) / f"{kind}-{artifact_key(models, device, kind)}.bin"


def load(path: Path) -> bool:
    """Put the artifacts kept at `path` back into torch's caches, before compiling; whether there
    were any. A missing, unreadable or damaged file is a cache miss, never an error."""
    try:
        blob = path.read_bytes()
    except OSError:
        return False
    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception:  # a damaged or truncated blob fails in torch's unpickling, in many types
        return False
    return info is not None


def save(path: Path) -> bool:
    """Keep what this process compiled at `path` (replaced whole: a reader never sees half a
    file); whether anything was written. A folder that cannot be written is no error: the next
    start compiles again."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    blob, _ = saved
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(blob)
        partial.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        return False
    return True
