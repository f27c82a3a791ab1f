"""The static KV cache layers of `kv_cache.StaticModel`: transformers' `StaticLayer` and
`StaticCache` written at given positions. Apart from `kv_cache` so that what imports it (the torch
engine's modules, the models layer) imports no transformers: these subclass transformers' classes,
and only the transformers engine makes them."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer


class PositionedLayer(StaticLayer):
    """A full-attention static cache layer that writes a forward pass's keys and values at the
    positions its cache holds for that pass (`PositionedCache.positions`, a device tensor), and
    keeps no write position of its own.

    transformers' `StaticLayer.update` writes at its `cumulative_length` (a device counter: an
    `arange`, an `add` and an `add_` a layer besides the two `index_copy_`), which rolling back
    must then set in every layer; here the step's positions are given once a pass, so a layer
    costs its two `index_copy_` (2 operators, 2 kernels on a GPU), and rolling back is nothing:
    the next pass writes over the rejected slots. What lies beyond the sequence is hidden by the
    attention mask (`PositionedCache.mask`).
    """

    def __init__(self, max_cache_len: int, cache: PositionedCache) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.cache = cache

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys and values [1, kv heads, w, head dim] at the pass's w positions; the
        buffers back, [1, kv heads, capacity, head dim], or their first `PositionedCache.window`
        slots (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values, positions = self.keys, self.values, self.cache.positions
        assert keys is not None and values is not None  # allocated above
        keys.index_copy_(2, positions, key_states)
        values.index_copy_(2, positions, value_states)
        window = self.cache.window
        if window is None:
            return keys, values
        return keys[:, :, :window], values[:, :, :window]


class PositionedCache(StaticCache):
    """transformers' `StaticCache` with its full-attention layers `PositionedLayer`s (other layers
    are kept as they are, for `StaticModel` to refuse), written at `positions`.

    Attributes:
        positions: [w] int64 on the model's device, the positions of the next forward pass's
            tokens (set before each pass).
        window: The slots the next passes attend over, the first `window` (None: the whole
            capacity; `StaticModel.attending`).
        unmasked: The next passes are one query at the window's last slot, which attends to
            every slot of it: their attention takes no mask (`StaticModel.attending`).
    """

    positions: torch.Tensor
    window: int | None = None
    unmasked: bool = False

    def __init__(self, config: Any, max_cache_len: int) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.layers = [
            PositionedLayer(max_cache_len, self) if type(layer) is StaticLayer else layer
            for layer in self.layers
        ]
