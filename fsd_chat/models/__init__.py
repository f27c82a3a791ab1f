"""The models layer: loading a target/draft pair (`loading`), saying in one line why a load failed
(`load_errors`), the loaded pair and its decoders (`pair`), the model options (`options`) and chat
templates (`chat_template`)."""

from fsd_chat.models.loading import (
    Progress,
    check_bitsandbytes_cuda,
    check_compatible,
    load_pair,
    resolve_device,
    resolve_dtype,
    target_device_map,
)
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair

__all__ = [
    "LoadOptions",
    "ModelPair",
    "ModelSpec",
    "Progress",
    "check_bitsandbytes_cuda",
    "check_compatible",
    "load_pair",
    "resolve_device",
    "resolve_dtype",
    "target_device_map",
]
