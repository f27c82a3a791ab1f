"""A causal LM bound to its KV cache: feed only unseen tokens, roll back to an accepted prefix, and
keep what a new sequence shares with the last one (prefix reuse: a chat's next prompt starts with
its previous one).

Uses transformers' `DynamicCache`. Rollback is `DynamicCache.crop(-n)` (drop the last n tokens). A
model is admitted only when transformers says its cache can be cropped without a trace
(`Cache.is_croppable`, which transformers' own assisted generation asks): recurrent state (Mamba,
the hybrid layers of Falcon-H1 or Qwen3-Next) is refused, KV-sharing layers (Gemma 3n, Gemma 4)
are admitted. Some layers know only once they hold state, so it is asked after a one-token probe.
Sliding-window layers (Gemma 2/3, gpt-oss, Mistral-style models) get a plain `DynamicLayer` that keeps
every token's keys and values, not transformers' `DynamicSlidingWindowLayer`, which trims itself to
the window and so cannot go back to an older prefix (its `activate_past_recording` only keeps the
past until the next crop). The window is still applied: transformers' masking
(`masking_utils.create_sliding_window_causal_mask`) builds the sliding mask from
`config.sliding_window` whatever the cache layer, over the full length a `DynamicLayer` reports, so
the attention reads the same keys as with a trimmed cache. Rollback and prefix reuse are then the
full-attention ones, exact at any length, at the memory of a full cache for those layers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from fsd_chat.support.errors import UnsupportedCacheError

COMPILED_TOKENS = 2
"""Longest forward pass `CompiledModel` compiles: one token per draft step, two for a catch-up."""


def context_length(model: PreTrainedModel) -> int | None:
    """The model's context window in tokens (None when its config does not say)."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def input_device(model: PreTrainedModel) -> torch.device:
    """Where `model`'s input ids go: the device of its input embeddings (with `device_map="auto"`
    its other layers may sit on other devices)."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)  # typed as a Module attribute, which may be a Module
    return weight.device


class CachedModel:
    """One model and the KV cache of the sequence it has seen.

    Invariant: the cache holds the first `seen` tokens of the last sequence buffer fed (`fed`).

    Args:
        model: A causal LM (transformers `PreTrainedModel`).
        vocab_size: Logits beyond this index are dropped (a padded lm_head is larger than the
            tokenizer's vocabulary).

    Raises:
        UnsupportedCacheError: the model's cache cannot be rolled back (`Cache.is_croppable` is
            false after a one-token forward pass: recurrent / linear-attention state, as in Mamba
            or Falcon-H1), or the model keeps its state elsewhere than in the cache it is given.
    """

    compile_error: str | None = None
    """Why compiled forward passes fell back to eager ones (only `CompiledModel` compiles)."""

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device = input_device(model)
        self.cache: Cache = self._new_cache()
        self.seen = 0
        self.fed: torch.Tensor | None = None
        """The buffer of the last forward pass (shape [1, capacity]): the cache holds its first `seen` tokens."""
        self._check_rollback()

    def _new_cache(self) -> Cache:
        cache = DynamicCache(config=self.model.config)
        # Whole KV for sliding-window (and chunked) layers: the mask applies the window (module docstring).
        cache.layers = [
            DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers
        ]
        return cache

    def reset(self) -> None:
        """Start a new sequence with an empty cache."""
        self.cache = self._new_cache()
        self.seen = 0

    def _prefix_reusable(self) -> bool:
        # A layer that trims what it holds cannot go back to an arbitrary earlier prefix. Exactly
        # DynamicLayer: the trimming layers subclass it.
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def keep_prefix(self, seq: torch.Tensor, length: int) -> int:
        """Start the sequence `seq[0, :length]`, keeping the cached tokens it begins with: the cache
        is rolled back to the longest common prefix of the cached sequence and the new one (emptied
        when the model's layers cannot be rolled back that far).

        Args:
            seq: The new token buffer, shape [1, capacity] int64 on the model's device.
            length: Its tokens to compare (those the caller will feed).

        Returns:
            The tokens kept (the new `seen`).
        """
        common = 0
        if self.fed is not None and self.seen and self._prefix_reusable():
            n = min(self.seen, length)
            differ = torch.nonzero(self.fed[0, :n] != seq[0, :n])
            common = int(differ[0, 0]) if len(differ) else n
        if common == 0:
            self.reset()
        else:
            self.rollback(common)
        return self.seen

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
        out = self.model(
            input_ids=seq[:, self.seen : upto],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        if getattr(out, "cache", None) is not self.cache:
            raise UnsupportedCacheError(
                f"{type(self.model).__name__} does not use a transformers DynamicCache, "
                "which speculative decoding needs to roll back rejected tokens"
            )
        self.seen = upto
        self.fed = seq
        return out.logits[0, -keep:, : self.vocab_size].float()

    def rollback(self, length: int) -> None:
        """Drop cached tokens beyond `length` (no-op when the cache holds fewer)."""
        drop = self.seen - length
        if drop > 0:
            self.cache.crop(-drop)
            self.seen = length

    @torch.inference_mode()
    def _check_rollback(self) -> None:
        cache = self._new_cache()
        probe = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        out = self.model(input_ids=probe, cache=cache, use_cache=True, logits_to_keep=1)
        if getattr(out, "cache", None) is not cache or not cache.is_croppable:
            kinds = sorted({type(layer).__name__ for layer in cache.layers})
            raise UnsupportedCacheError(
                f"{type(self.model).__name__} keeps state ({', '.join(kinds)}) that cannot be "
                "rolled back to an accepted prefix; speculative decoding needs a KV cache that can"
            )


class CompiledModel(CachedModel):
    """A model whose one-token forward passes are compiled (`torch.compile`) over a static KV cache.

    A draft model's forward pass over one token is mostly framework overhead on a CPU and kernel
    launches on a GPU; compiling it (on CUDA with CUDA graphs, mode "reduce-overhead") removes most
    of both. The static cache (transformers' `StaticCache`) keeps tensor shapes and addresses fixed:
    rolling back only moves each layer's write position, and the slots beyond it are masked out
    until they are overwritten. A 2-token forward pass (the draft's catch-up after a fully accepted
    block) is compiled too, as a second graph; longer ones (the prompt) run eagerly over the same
    cache.

    If compilation fails (no C++ compiler, an unsupported operator), the model runs eagerly from
    then on and `compile_error` says why.

    Args:
        model: A causal LM whose cache layers are all full-attention (no sliding window).
        vocab_size: See `CachedModel`.
        capacity: Tokens the static cache holds (the decoder's context is capped to it).

    Raises:
        UnsupportedCacheError: the model has sliding-window or recurrent layers.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int, capacity: int) -> None:
        self.capacity = capacity
        super().__init__(model, vocab_size)
        cuda = self.device.type == "cuda"
        self._compiled = torch.compile(model.forward, mode="reduce-overhead" if cuda else None, dynamic=False)

    def reset(self) -> None:
        """Start a new sequence: the write position goes back to 0 (the cache is reused)."""
        self._move_to(0)

    def _new_cache(self) -> StaticCache:
        return StaticCache(config=self.model.config, max_cache_len=self.capacity)

    @torch.inference_mode()
    def forward(self, seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        """See `CachedModel.forward`; `upto` must not exceed `capacity`."""
        kwargs = {
            # A view whose strides do not depend on the buffer's length: the compiled function is
            # guarded on strides, and each reply's buffer has its own length.
            "input_ids": seq[0, self.seen : upto].unsqueeze(0),
            "cache": self.cache,
            # Given explicitly: the model would otherwise read the write position back from the device.
            "cache_position": torch.arange(self.seen, upto, device=self.device),
            "use_cache": True,
            "logits_to_keep": keep,
        }
        out = None
        if upto - self.seen <= COMPILED_TOKENS and self.compile_error is None:
            try:
                out = self._compiled(**kwargs)
            except Exception as exc:  # compilation failures come in many types; fall back to eager
                self.compile_error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        if out is None:
            out = self.model(**kwargs)
        self.seen = upto
        self.fed = seq
        return out.logits[0, -keep:, : self.vocab_size].float()

    def rollback(self, length: int) -> None:
        """Move the write position back to `length` (no-op when the cache holds fewer)."""
        if length < self.seen:
            self._move_to(length)

    def _move_to(self, length: int) -> None:
        for layer in self._layers:
            if layer.is_initialized:
                # In place: CUDA graphs captured the tensor's address.
                layer.cumulative_length.fill_(length)
        self.seen = length

    def _prefix_reusable(self) -> bool:
        return True  # rolling back only moves the write position

    def _check_rollback(self) -> None:
        # Exactly StaticLayer: the sliding-window static layers subclass it.
        self._layers = [layer for layer in self.cache.layers if type(layer) is StaticLayer]
        if len(self._layers) < len(self.cache.layers):
            kinds = sorted({type(layer).__name__ for layer in self.cache.layers})
            raise UnsupportedCacheError(
                f"--compile needs full-attention layers only; {type(self.model).__name__} has {', '.join(kinds)}"
            )
