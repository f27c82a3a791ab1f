"""A chat session as data: its turns, and per reply the provenance runs and statistics.

No UI and no torch: the TUI builds sessions, `store` persists them, `transcript` renders them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fsd_chat.chat import Message, Role
from fsd_chat.decoding.events import GenerationStats, Origin, Step


def now() -> str:
    """The local time as an ISO 8601 string with its UTC offset (seconds precision)."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def new_session_id() -> str:
    """A short random session id (8 hex digits), easy to type after `fsd-chat export`."""
    return secrets.token_hex(4)


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive reply text of one origin, decoded under one setting of the controls."""

    text: str
    origin: Origin
    threshold: float
    divergence: str
    rule: str

    @property
    def setting(self) -> tuple[str, str, float]:
        """(rule, divergence, threshold): a change between two runs is marked in the reply."""
        return (self.rule, self.divergence, self.threshold)


@dataclass(slots=True)
class ReplyRecord:
    """An assistant reply's provenance and statistics.

    Attributes:
        runs: The reply text split by origin and setting, in order.
        stats: `GenerationStats.to_dict()` of the reply.
        stop_reason: Why it ended (a `StopReason` value), or None while it streams.
    """

    runs: list[Run] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The reply's text."""
        return "".join(run.text for run in self.runs)


class ReplyBuilder:
    """Folds a decoder's `Step`s into a `ReplyRecord` and running `GenerationStats`."""

    def __init__(self) -> None:
        self.record = ReplyRecord()
        self.totals = GenerationStats()

    def add(self, step: Step) -> None:
        """Append one step's tokens (merged into runs) and fold in its statistics."""
        s = step.stats
        runs = self.record.runs
        for token in step.tokens:
            if not token.text:
                continue
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.origin == token.origin
                and last.setting
                == (
                    s.rule,
                    s.divergence,
                    s.threshold,
                )
            ):
                runs[-1] = Run(last.text + token.text, last.origin, s.threshold, s.divergence, s.rule)
            else:
                runs.append(Run(token.text, token.origin, s.threshold, s.divergence, s.rule))
        self.totals.add(step)
        self.record.stats = self.totals.to_dict()
        if step.stop_reason is not None:
            self.record.stop_reason = str(step.stop_reason)


@dataclass(slots=True)
class Turn:
    """One message of the conversation; assistant turns carry their `ReplyRecord`."""

    role: Role
    content: str
    created: str = field(default_factory=now)
    reply: ReplyRecord | None = None


@dataclass(slots=True)
class Session:
    """A conversation and the configuration it ran under.

    Attributes:
        id: Short id (see `new_session_id`).
        created: ISO timestamp of the session's start.
        models: target, draft, quantize_target, quantize_draft, device, dtype.
        settings: Decoding and sampling settings at the start (rule, divergence, threshold,
            draft_tokens, draft_policy, temperature, top_k, top_p, seed, max_new_tokens, mode).
        system: The system prompt, if any.
        turns: User and assistant turns in order.
    """

    id: str
    created: str
    models: dict[str, str]
    settings: dict[str, Any]
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    @property
    def title(self) -> str:
        """The first user message's first line, shortened (for `fsd-chat history`)."""
        for turn in self.turns:
            if turn.role == "user":
                line = turn.content.strip().splitlines()[0] if turn.content.strip() else ""
                return line if len(line) <= 60 else line[:59] + "…"
        return ""

    def messages(self) -> list[Message]:
        """The conversation as `Message`s for the prompt: the system prompt, then every turn."""
        head = [Message("system", self.system)] if self.system else []
        return head + [Message(t.role, t.content) for t in self.turns]


def reply_from_dict(data: dict[str, Any]) -> ReplyRecord:
    """A `ReplyRecord` from its `asdict` form."""
    runs = [
        Run(r["text"], Origin(r["origin"]), float(r["threshold"]), r["divergence"], r["rule"])
        for r in data.get("runs", [])
    ]
    return ReplyRecord(runs=runs, stats=dict(data.get("stats", {})), stop_reason=data.get("stop_reason"))
