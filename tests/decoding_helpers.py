"""Small helpers for decoding tests: run a decoder to the end and collect what it emitted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fsd_chat.decoding import GenerationStats, Step


@dataclass
class Collected:
    """Everything one generation emitted."""

    steps: list[Step] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [t.id for s in self.steps for t in s.tokens]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    @property
    def origins(self) -> list[str]:
        return [str(t.origin) for s in self.steps for t in s.tokens]


def collect(steps: Iterable[Step], prompt_ids: list[int] | None = None) -> Collected:
    """Consume a decoder's steps (of a reply to `prompt_ids`, kept for recomputations)."""
    run = Collected(prompt_ids=list(prompt_ids or []))
    for step in steps:
        run.steps.append(step)
        run.stats.add(step)
    return run
