"""Messages posted from worker threads to the UI (`post_message` does not block the thread)."""

from __future__ import annotations

from textual.message import Message

from fsd_chat.decoding.events import Step


class LoadProgress(Message):
    """The model loader moved on to a new phase."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class StepDecoded(Message):
    """One decoding step of generation number `generation` (stale generations are ignored)."""

    def __init__(self, generation: int, step: Step) -> None:
        super().__init__()
        self.generation = generation
        self.step = step
