"""Running out of accelerator memory: free what the reply held, and say what to try."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.support.errors import DeviceMemoryError

ADVICE = "try a shorter conversation (ctrl+n) or --max-new-tokens, --quantize-target 4bit, or a smaller draft model"

P = ParamSpec("P")
T = TypeVar("T")


class HasModels(Protocol):
    """A decoder and the cached models it holds."""

    @property
    def owned_models(self) -> Sequence[ModelRunner]: ...


D = TypeVar("D", bound=HasModels)


def frees_memory_on_oom(
    generate: Callable[Concatenate[D, P], Iterator[T]],
) -> Callable[Concatenate[D, P], Iterator[T]]:
    """Decorate a decoder's `generate`: torch's out-of-memory error becomes a `DeviceMemoryError`.

    The decoder's KV caches (`owned_models`: a draft with another tokenizer's too) are dropped and
    the allocator's cached blocks released first, so the next reply starts from free memory and the
    conversation stays usable.

    Raises (from the decorated generator):
        DeviceMemoryError: the device ran out of memory; the message names the KV cache's size in
            tokens and what to try.
    """

    @functools.wraps(generate)
    def guarded(decoder: D, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        with frees_memory(decoder, "during the reply"):
            yield from generate(decoder, *args, **kwargs)

    return guarded


@contextlib.contextmanager
def frees_memory(decoder: HasModels, doing: str) -> Iterator[None]:
    """Within it, torch's out-of-memory error becomes a `DeviceMemoryError` (see
    `frees_memory_on_oom`), its message saying what the decoder was `doing`."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        models = decoder.owned_models
        context = max((model.seen for model in models), default=0)
        for model in models:
            model.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        detail = (str(exc).strip().splitlines() or ["out of memory"])[0]
        raise DeviceMemoryError(
            f"out of GPU memory {doing}, with {context} tokens in the KV cache ({detail}): {ADVICE}"
        ) from None
