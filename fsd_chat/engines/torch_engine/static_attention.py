"""The attention of a model over a static KV cache (`kv_cache.StaticModel`): transformers' SDPA,
with grouped-query attention done inside SDPA (`enable_gqa=True`) on the CPU when a mask is given.

With grouped-query attention (fewer key/value heads than query heads) and a mask, transformers'
`sdpa_attention_forward` copies the keys and values to every query head (`repeat_kv`) before
SDPA, unless the process sets `TRANSFORMERS_SDPA_FORCE_GQA` (`use_gqa_in_sdpa`): on CUDA, SDPA's
fused kernels refuse a mask with `enable_gqa` and fall back to the math kernel. A static cache's
pass attends over its whole capacity under a mask, so that copy is the capacity's keys and values
in every layer of every pass; on the CPU, SDPA's own GQA reads the shared heads in place
(`torch.nn.functional.scaled_dot_product_attention`, `enable_gqa`). Elsewhere (CUDA, no mask, no
GQA) this is transformers' `sdpa_attention_forward` unchanged.

Registered with transformers' `AttentionInterface` (and its mask builder's) under `NAME`, and
made a model's attention once, when a static model wraps it (`use`); its passes over a static
cache say so (`static_cache=True`, which `StaticModel.run` gives, and transformers hands every
attention layer with the model's other keyword arguments). Every other pass of the same model (a
`DynamicCache` of today's steps) runs transformers' `sdpa_attention_forward` unchanged. Switching
once rather than around each pass: the config's attribute reads and writes cost ~150 µs a pass
on the CPU (transformers' config `__getattribute__`/`__setattr__`), and a compiled or captured
step sees one implementation (torch.compile guards on `_attn_implementation`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "fsd_static_sdpa"


def static_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    static_cache: bool = False,
    unmasked: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, with a masked grouped-query pass over a static
    cache on the CPU given to SDPA whole (`enable_gqa=True`) instead of after `repeat_kv`.

    Args:
        module: The attention layer (its `num_key_value_groups`: query heads per key/value head).
        query: [batch, query heads, w, head dim].
        key, value: [batch, key/value heads, kv length, head dim].
        attention_mask: Additive or boolean, broadcastable to [batch, query heads, w, kv length].
        dropout, scaling, kwargs: As `sdpa_attention_forward`'s.
        static_cache: The pass is a static model's (`StaticModel.run`); other passes are
            `sdpa_attention_forward`'s whatever they are.
        unmasked: The pass's one query attends to every key (`PositionedCache.unmasked`): its
            mask, all zeros, is left out, as transformers leaves out a one-token pass's.

    Returns:
        The attention's output [batch, w, query heads, head dim], and None (no weights).
    """
    if unmasked:
        attention_mask = None
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = (
        attention_mask is not None and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    )
    if not (static_cache and grouped and plain and query.device.type == "cpu"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, static_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use(model: PreTrainedModel) -> None:
    """Make `static_sdpa_forward` `model`'s attention where it runs transformers' SDPA (other
    implementations are left as they are): once, when a static model wraps it."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
