"""What a bench run ran on, for report.json's `environment`: versions, device, threads and the loaded
setups. It asks torch about the device, so it belongs to the stage that loads the models, not to
the torch-free report."""

from __future__ import annotations

import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import torch

from fsd_chat.models.pair import ModelPair


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load_average() -> list[float] | None:
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except (AttributeError, OSError):  # no load average on this platform (Windows: no getloadavg)
        return None


def environment(pairs: dict[str, ModelPair]) -> dict[str, object]:
    """Versions, device, threads, the loaded setups (keyed by setup label) and the machine's load
    average when the run finished (runnable processes over the last 1, 5 and 15 minutes, from
    `os.getloadavg`; None where the platform has none): figures measured beside other work are
    read with it."""
    devices = {str(p.device) for p in pairs.values()}
    cuda = [torch.cuda.get_device_name(torch.device(d)) for d in devices if d.startswith("cuda")]
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in ("fsd-chat", "torch", "transformers", "bitsandbytes")},
        "device": sorted(devices),
        "device_name": cuda or [_cpu_name()],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "load_average": _load_average(),
        "setups": {label: pair.describe() for label, pair in pairs.items()},
        "scorer": next(iter(pairs.values())).describe() if pairs else None,
        "argv": sys.argv,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
    }
