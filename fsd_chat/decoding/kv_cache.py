"""A causal LM bound to its KV cache: feed only unseen tokens, roll back to an accepted prefix.

Uses transformers' `DynamicCache`. Rollback is `DynamicCache.crop(-n)` (drop the last n tokens).
Sliding-window layers (Gemma 2, Mistral, ...) can be rolled back only while they record their past
(`activate_past_recording`, the mechanism transformers' own assisted generation uses); recording
starts after the prefill so a long prompt does not keep a full-length copy of every window.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from fsd_chat.errors import UnsupportedCacheError

_ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def context_length(model: PreTrainedModel) -> int | None:
    """The model's context window in tokens (None when its config does not say)."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class CachedModel:
    """One model and the KV cache of the sequence it has seen.

    Invariant: the cache holds the first `seen` tokens of the caller's sequence buffer.

    Args:
        model: A causal LM (transformers `PreTrainedModel`).
        vocab_size: Logits beyond this index are dropped (a padded lm_head is larger than the
            tokenizer's vocabulary).

    Raises:
        UnsupportedCacheError: the model's cache has layers that cannot be rolled back
            (recurrent / linear-attention state, as in Mamba).
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device = model.get_input_embeddings().weight.device
        self.cache: DynamicCache = DynamicCache(config=model.config)
        self.seen = 0
        self._check_rollback()

    def reset(self) -> None:
        """Start a new sequence with an empty cache."""
        self.cache = DynamicCache(config=self.model.config)
        self.seen = 0

    @torch.inference_mode()
    def forward(self, seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        """Feed seq[0, seen:upto] and return the logits of the last `keep` fed positions.

        Args:
            seq: Token buffer, shape [1, capacity] int64 on the model's device.
            upto: Feed the tokens before this index (upto > seen).
            keep: Number of trailing positions whose logits are returned.

        Returns:
            Logits, shape [keep, vocab_size], float32.

        Raises:
            UnsupportedCacheError: the model does not keep its state in the cache it is given.
        """
        first = self.seen == 0
        out = self.model(
            input_ids=seq[:, self.seen : upto],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        if getattr(out, "past_key_values", None) is not self.cache:
            raise UnsupportedCacheError(
                f"{type(self.model).__name__} does not use a transformers DynamicCache, "
                "which speculative decoding needs to roll back rejected tokens"
            )
        self.seen = upto
        if first:
            self.cache.activate_past_recording()
        return out.logits[0, -keep:, : self.vocab_size].float()

    def rollback(self, length: int) -> None:
        """Drop cached tokens beyond `length` (no-op when the cache holds fewer)."""
        drop = self.seen - length
        if drop >= 0:
            # crop(0) is not a no-op for sliding-window layers: it trims the recorded past back
            # to the window, which keeps their memory bounded.
            self.cache.crop(-drop)
            self.seen = length

    def _check_rollback(self) -> None:
        unsupported = sorted(
            {type(layer).__name__ for layer in self.cache.layers if not isinstance(layer, _ROLLBACK_LAYERS)}
        )
        if unsupported:
            raise UnsupportedCacheError(
                f"{type(self.model).__name__} keeps state ({', '.join(unsupported)}) that cannot be "
                "rolled back to an accepted prefix; speculative decoding needs a KV cache that can"
            )
