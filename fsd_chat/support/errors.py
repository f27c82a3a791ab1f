"""Errors that end in a one-line explanation for the user (CLI: exit code 2; TUI: a notification)."""


class FsdChatError(Exception):
    """Base class: the message is a complete, one-line explanation meant for the user."""


class ModelLoadError(FsdChatError):
    """A model or tokenizer could not be loaded (missing path, non-causal model, failed quantization)."""


class IncompatibleModelsError(FsdChatError):
    """The draft and target models do not share a tokenizer/vocabulary."""


class ContextLengthError(FsdChatError):
    """The prompt (plus at least one new token) does not fit in a model's context window."""


class UnsupportedCacheError(FsdChatError):
    """A model's KV cache cannot be rolled back, so speculative decoding cannot run on it."""


class SettingsError(FsdChatError, ValueError):
    """A decoding or sampling setting is out of range (threshold, draft length, temperature...)."""


class DeviceMemoryError(FsdChatError):
    """The accelerator ran out of memory (loading a model, or during a reply)."""


class NonFiniteError(FsdChatError):
    """A model's next-token law is not a law (NaN or inf logits, most often a float16 overflow):
    the reply ends there, keeping what it emitted."""
