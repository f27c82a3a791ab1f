"""The decoding core: pure torch + transformers, no UI imports.

Public entry points: `SpeculativeDecoder`, `AutoregressiveDecoder` (both yield `Step` events and
satisfy the `Decoder` protocol), `Controls` (thread-safe live settings), `DecodingSettings` and
`SamplingConfig`.

Names are imported on first use (PEP 562), so that torch-free modules of this package — the
settings the command line parses — load without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_HOMES = {
    "AutoregressiveDecoder": "autoregressive",
    "Controls": "controls",
    "Decoder": "protocol",
    "DecodingSettings": "settings",
    "GenerationStats": "events",
    "Origin": "events",
    "SamplingConfig": "settings",
    "SpeculativeDecoder": "speculative",
    "Step": "events",
    "StepStats": "events",
    "StopReason": "events",
    "Token": "events",
}

__all__ = [
    "AutoregressiveDecoder",
    "Controls",
    "Decoder",
    "DecodingSettings",
    "GenerationStats",
    "Origin",
    "SamplingConfig",
    "SpeculativeDecoder",
    "Step",
    "StepStats",
    "StopReason",
    "Token",
]

if TYPE_CHECKING:
    from fsd_chat.decoding.autoregressive import AutoregressiveDecoder
    from fsd_chat.decoding.controls import Controls
    from fsd_chat.decoding.events import GenerationStats, Origin, Step, StepStats, StopReason, Token
    from fsd_chat.decoding.protocol import Decoder
    from fsd_chat.decoding.settings import DecodingSettings, SamplingConfig
    from fsd_chat.decoding.speculative import SpeculativeDecoder


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"fsd_chat.decoding.{_HOMES[name]}"), name)
