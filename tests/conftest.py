"""Shared fixtures: the real offline model pair from ../shared/models, loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fsd_chat.models import LoadOptions, ModelPair, ModelSpec, load_pair

MODELS_DIR = Path(
    os.environ.get("FSD_CHAT_MODELS", Path(__file__).resolve().parents[1] / ".." / "shared" / "models")
)
TARGET_DIR = MODELS_DIR / "stories260K"
DRAFT_DIR = MODELS_DIR / "stories260K-draft"

# The test models are tiny: a second intra-op thread only adds synchronisation, and on a shared
# 2-core machine it oversubscribes the cores (measured: hundreds of times slower under load).
torch.set_num_threads(1)

if not TARGET_DIR.is_dir():  # pragma: no cover - a broken checkout, not a test outcome
    raise RuntimeError(f"offline models not found at {MODELS_DIR} (set FSD_CHAT_MODELS)")


@pytest.fixture(scope="session")
def target_dir() -> Path:
    """Directory of the stories260K target (a real pretrained Llama)."""
    return TARGET_DIR


@pytest.fixture(scope="session")
def draft_dir() -> Path:
    """Directory of its distilled draft."""
    return DRAFT_DIR


@pytest.fixture(scope="session")
def pair() -> ModelPair:
    """The offline pair on the CPU in float32 (shared: decoders never modify the models)."""
    return load_pair(
        ModelSpec(str(TARGET_DIR)), ModelSpec(str(DRAFT_DIR)), LoadOptions(device="cpu", dtype="float32")
    )
