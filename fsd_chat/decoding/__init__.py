"""The decoding core: pure torch + transformers, no UI imports.

Public entry points: `SpeculativeDecoder`, `AutoregressiveDecoder` (both yield `Step` events),
`Controls` (thread-safe live settings) and `SamplingConfig`.
"""

from fsd_chat.decoding.autoregressive import AutoregressiveDecoder
from fsd_chat.decoding.controls import Controls, DecodingSettings
from fsd_chat.decoding.events import GenerationStats, Origin, Step, StepStats, StopReason, Token
from fsd_chat.decoding.sampling import SamplingConfig
from fsd_chat.decoding.speculative import SpeculativeDecoder

__all__ = [
    "AutoregressiveDecoder",
    "Controls",
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
