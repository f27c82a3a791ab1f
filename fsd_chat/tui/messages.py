"""Messages posted from worker threads to the UI (`post_message` does not block the thread)."""

from __future__ import annotations

from textual.message import Message


class LoadProgress(Message):
    """The model loader moved on to a new phase."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class StepsReady(Message):
    """Generation number `generation` (stale ones are ignored) buffered steps for the UI, or
    (`ended`) its decoder finished."""

    def __init__(self, generation: int, *, ended: bool = False) -> None:
        super().__init__()
        self.generation = generation
        self.ended = ended


class SaveFailed(Message):
    """Saving the session failed (it is retried on the next save)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class SaveRecovered(Message):
    """Saving works again after a failure: everything pending was written."""


class PromptReady(Message):
    """Generation number `generation` built its prompt, leaving out the `dropped` oldest messages."""

    def __init__(self, generation: int, dropped: int) -> None:
        super().__init__()
        self.generation = generation
        self.dropped = dropped


class PromptFailed(Message):
    """Generation number `generation` could not build its prompt (`error` says why)."""

    def __init__(self, generation: int, error: Exception) -> None:
        super().__init__()
        self.generation = generation
        self.error = error


class PrefillProgress(Message):
    """Generation number `generation` has read `done` of its prompt's `total` tokens (a long prefill)."""

    def __init__(self, generation: int, done: int, total: int) -> None:
        super().__init__()
        self.generation = generation
        self.done = done
        self.total = total
