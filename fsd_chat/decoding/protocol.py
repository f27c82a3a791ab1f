"""`Decoder`: what the chat, `generate` and the bench may rely on of a decoder.

`SpeculativeDecoder` and `AutoregressiveDecoder` both satisfy it; `fsd_chat.models.pair.ModelPair.decoder`
returns one or the other. It is runtime-checkable, so a wrapper (a test's paced decoder) can be
checked with `isinstance`; that check sees only that the members exist, not their types.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from fsd_chat.decoding.events import Step
from fsd_chat.decoding.settings import SamplingConfig


@runtime_checkable
class Decoder(Protocol):
    """Decodes replies, one `Step` event at a time, over models it keeps loaded between replies."""

    @property
    def context(self) -> int | None:
        """The context window in tokens that a prompt and its reply share (None: not known)."""
        ...

    @property
    def compile_error(self) -> str | None:
        """Why a model asked to run compiled runs eagerly, in one line: compiling it was refused
        (set when the decoder is made) or failed (set during a reply: read it after one); None
        when neither happened, or when nothing was asked to compile."""
        ...

    def generate(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop_strings: tuple[str, ...] = (),
    ) -> Iterator[Step]:
        """Yield one `Step` per target forward pass; the last has `stop_reason` set.

        Args:
            prompt_ids: Prompt token ids (non-empty).
            max_new_tokens: Exact cap on generated tokens (≥ 1).
            sampling: Temperature / top-k / top-p / seed (default: greedy).
            stop_strings: Texts that end the reply once generated.

        Raises:
            ContextLengthError: the prompt does not fit the context window.
            SettingsError: max_new_tokens < 1 or an empty prompt.
            UnsupportedCacheError: a model's KV cache cannot be rolled back.
            DeviceMemoryError: the device ran out of memory (the KV caches are freed).
        """
        ...

    def read_ahead(self, prompt_ids: list[int]) -> None:
        """Feed the target's KV cache `prompt_ids` now, so that a prompt starting with them
        prefills only the rest: the chat calls it when a reply ends, with the conversation as the
        next prompt will begin, while the user types. Nothing when the caches are not kept between
        replies (`reuse_prefix` off).

        Args:
            prompt_ids: The tokens a later prompt will start with.

        Raises:
            UnsupportedCacheError, DeviceMemoryError: as `generate`.
        """
        ...
