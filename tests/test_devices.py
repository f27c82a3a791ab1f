"""Device and dtype choice. This machine and CI have no GPU, so the CUDA cases patch torch.cuda's
queries (is_available, device_count, is_bf16_supported): mocks standing in for hardware that
cannot run here. The real CUDA path needs a GPU machine; CI never has one."""

from __future__ import annotations

import pytest
import torch

from fsd_chat.models.devices import resolve_device, resolve_dtype, target_device_map
from fsd_chat.models.options import LoadOptions
from fsd_chat.support.errors import ModelLoadError


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)


def test_cpu_only_machine() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert target_device_map(LoadOptions()) is None
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        resolve_device("cuda:0")
    with pytest.raises(ModelLoadError, match="unsupported device"):
        resolve_device("mps")
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))


def test_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1, bf16=False)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16
    assert resolve_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16
    assert target_device_map(LoadOptions()) is None
    with pytest.raises(ModelLoadError, match="only 1 GPU"):
        resolve_device("cuda:1")


def test_several_gpus_spread_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert target_device_map(LoadOptions(device="auto")) == "auto"
    assert target_device_map(LoadOptions(device="cuda")) == "auto"
    assert target_device_map(LoadOptions(device="cuda:2")) is None
    assert target_device_map(LoadOptions(device="cpu")) is None
    assert resolve_device("cuda:3") == torch.device("cuda:3")
