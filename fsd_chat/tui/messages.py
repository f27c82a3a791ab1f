"""Messages posted from worker threads to the UI (`post_message` does not block the thread)."""

from __future__ import annotations

from textual.message import Message

from fsd_chat.decoding.events import Step


class LoadProgress(Message):
    """The model loader moved on to a new phase."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class StepsDecoded(Message):
    """Decoding steps of generation number `generation` (stale generations are ignored), batched:
    the worker posts at most about 30 batches a second, and always the reply's last step."""

    def __init__(self, generation: int, steps: tuple[Step, ...]) -> None:
        super().__init__()
        self.generation = generation
        self.steps = steps


class SaveFailed(Message):
    """Saving the session failed (it is retried on the next save)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class SaveRecovered(Message):
    """Saving works again after a failure: everything pending was written."""
