"""A chat session as data: its turns, and per reply the provenance runs and statistics.

No UI and no torch: the TUI builds sessions, `store` persists them, `transcript` renders them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fsd_chat.decoding.events import GenerationStats, Origin, Step
from fsd_chat.decoding.settings import FORMER_DRAFT_POLICIES
from fsd_chat.models.chat_template import Message, Role
from fsd_chat.support.errors import FsdChatError

STREAMING = "streaming"
"""Stored stop reason of a reply written while it streams; read back as `stopped` (its process died)."""
STOPPED = "stopped"


def now() -> str:
    """The local time as an ISO 8601 string with its UTC offset (seconds precision)."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def new_session_id() -> str:
    """A short random session id (8 hex digits), easy to type after `fsd-chat export`."""
    return secrets.token_hex(4)


Setting = tuple[str, str, float]
"""(rule, divergence, threshold) of the controls in force for a step (see `StepStats`)."""

DIVERGENCE_RULES = ("fuzzy", "pure")
"""Rules whose test compares a divergence with T; mixture's T is a KL budget whatever the dial's
divergence, and exact uses neither."""
THRESHOLD_RULES = ("fuzzy", "pure", "mixture")
"""Rules that read T."""


def describe_setting(setting: Setting, previous: Setting | None = None, digits: int = 3) -> str:
    """The part of `setting` a reader needs, e.g. "mixture T 0.160", "fuzzy js T 0.050", "exact";
    given the `previous` setting, only what changed and matters under the rule in force: the
    divergence only where the rule uses one, T only where it reads T ("" when nothing that matters
    changed, e.g. the divergence under mixture). A change of rule names the rule and what it reads.

    Args:
        setting: (rule, divergence, threshold) in force.
        previous: The setting before it (None: name it whole).
        digits: Decimals of T.
    """
    rule, divergence, threshold = setting
    whole = previous is None or previous[0] != rule
    parts = [rule] if whole else []
    if rule in DIVERGENCE_RULES and (whole or previous is None or previous[1] != divergence):
        parts.append(divergence)
    if rule in THRESHOLD_RULES and (whole or previous is None or previous[2] != threshold):
        parts.append(f"T {threshold:.{digits}f}")
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a reply as shown: text of one origin, or (origin None) a ⟨…⟩ mark's words."""

    text: str
    origin: Origin | None


APOSTROPHES = "'\u2019"
"""Characters inside a word as well as letters and digits (`didn't`, `didn’t`)."""


def _in_word(character: str) -> bool:
    """Whether `character` (one or none) can stand inside a word, for `marked_pieces`."""
    return character.isalnum() or (character != "" and character in APOSTROPHES)


def marked_pieces(runs: Sequence[OriginRun], previous: Setting | None = None, digits: int = 3) -> list[Piece]:
    """`runs`' text with a mark naming each change of setting (`describe_setting`, from `previous`,
    the setting before the runs). A change that falls inside a word (a token that continues the
    word before it: `L` then `uminaria`) is marked where the word ends, so that the mark never
    splits a word (`Luminaria⟨tv⟩ was`); changes that meet before a boundary share one mark."""
    pieces: list[Piece] = []
    pending: list[str] = []
    last = ""  # the last character shown
    for run in runs:
        change = "" if previous is None else describe_setting(run.setting, previous, digits)
        previous = run.setting
        if change:
            pending.append(change)
        text = run.text
        if pending and _in_word(last) and _in_word(text[:1]):
            end = next((i for i, c in enumerate(text) if not _in_word(c)), len(text))
            pieces.append(Piece(text[:end], run.origin))
            text = text[end:]
        if pending and text:
            pieces.append(Piece(" · ".join(pending), None))
            pending = []
        if text:
            pieces.append(Piece(text, run.origin))
            last = text[-1]
    if pending:
        pieces.append(Piece(" · ".join(pending), None))
    return pieces


@dataclass(frozen=True, slots=True)
class OriginRun:
    """Consecutive reply text of one origin, decoded under one setting of the controls."""

    text: str
    origin: Origin
    threshold: float
    divergence: str
    rule: str

    @property
    def setting(self) -> Setting:
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

    runs: list[OriginRun] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The reply's text."""
        return "".join(run.text for run in self.runs)

    def snapshot(self) -> ReplyRecord:
        """A copy another thread may serialise while this one keeps growing; a reply still
        streaming is marked `STREAMING`."""
        return ReplyRecord(list(self.runs), dict(self.stats), self.stop_reason or STREAMING)


class ReplyBuilder:
    """Folds a decoder's `Step`s into a `ReplyRecord` and running `GenerationStats`, with each
    setting's span: `stats["spans"]` lists, in order, {"rule", "divergence", "threshold",
    "tokens"} for each stretch of steps decoded under one setting (a new span where the dial moved)."""

    def __init__(self) -> None:
        self.record = ReplyRecord()
        self.totals = GenerationStats()
        self.spans: list[dict[str, Any]] = []
        self._last_origin = Origin.TARGET
        self._last_setting: Setting = ("", "", 0.0)

    def add(self, step: Step) -> None:
        """Append one step's tokens (merged into runs) and fold in its statistics."""
        s = step.stats
        setting: Setting = (s.rule, s.divergence, s.threshold)
        if step.flushed:
            # Held-back text of the previous step's last token, in that token's run.
            self._append(step.flushed, self._last_origin, self._last_setting)
        for token in step.tokens:
            self._last_origin, self._last_setting = token.origin, setting
            self._append(token.text, token.origin, setting)
        last = self.spans[-1] if self.spans else None
        if last is not None and (last["rule"], last["divergence"], last["threshold"]) == setting:
            last["tokens"] += s.emitted
        else:
            self.spans.append(
                {"rule": s.rule, "divergence": s.divergence, "threshold": s.threshold, "tokens": s.emitted}
            )
        self.totals.add(step)
        self.record.stats = {**self.totals.to_dict(), "spans": [dict(span) for span in self.spans]}
        if step.stop_reason is not None:
            self.record.stop_reason = str(step.stop_reason)

    def _append(self, text: str, origin: Origin, setting: Setting) -> None:
        if not text:
            return
        runs = self.record.runs
        rule, divergence, threshold = setting
        if runs and runs[-1].origin == origin and runs[-1].setting == setting:
            runs[-1] = OriginRun(runs[-1].text + text, origin, threshold, divergence, rule)
        else:
            runs.append(OriginRun(text, origin, threshold, divergence, rule))


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
            draft_tokens, draft_policy, temperature, top_k, top_p, seed, max_new_tokens, mode), and
            under "dial" the dial's settings (`DIAL_FIELDS`) as it was last moved (see `final_dial`).
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


class MalformedSessionError(FsdChatError):
    """A stored session cannot be repaired into a valid conversation."""


def repair_turns(turns: list[Turn]) -> tuple[list[Turn], list[str]]:
    """Make stored turns a valid conversation: user and assistant turns alternating, every
    assistant turn with a finished reply.

    A reply left `streaming` (its process died) becomes `stopped`; a user turn not followed by a
    reply gets an empty stopped one (what a crash mid-reply left in older versions); consecutive
    assistant turns are joined into one reply. Nothing stored is dropped.

    Returns:
        The repaired turns and one line per kind of repair made (empty when none was needed).

    Raises:
        MalformedSessionError: a turn with an unknown role, or an assistant turn without its reply.
    """
    repaired: list[Turn] = []
    repairs: set[str] = set()
    for turn in turns:
        if turn.role not in ("user", "assistant"):
            raise MalformedSessionError(
                f"a turn has the role {turn.role!r} (only user and assistant are stored)"
            )
        if turn.role == "assistant":
            if turn.reply is None:
                raise MalformedSessionError("an assistant turn has no reply record")
            if turn.reply.stop_reason in (None, STREAMING):
                turn.reply.stop_reason = STOPPED
                repairs.add("a reply interrupted while streaming is marked stopped")
            previous = repaired[-1] if repaired else None
            if previous is not None and previous.role == "assistant" and previous.reply is not None:
                previous.reply.runs += turn.reply.runs
                previous.reply.stop_reason = turn.reply.stop_reason
                previous.content += turn.content
                repairs.add("consecutive replies are joined")
                continue
        elif repaired and repaired[-1].role == "user":
            repaired.append(_empty_reply(repaired[-1].created))
            repairs.add("a message without a reply gets an empty stopped one")
        repaired.append(turn)
    if repaired and repaired[-1].role == "user":
        repaired.append(_empty_reply(repaired[-1].created))
        repairs.add("a message without a reply gets an empty stopped one")
    return repaired, sorted(repairs)


def _empty_reply(created: str) -> Turn:
    return Turn("assistant", "", created, ReplyRecord(stop_reason=STOPPED))


_NUMBER = (float, int)
_KINDS = {
    str: "text",
    float: "a number",
    int: "a whole number",
    bool: "true or false",
    list: "a list",
    dict: "a JSON object",
}
MODEL_FIELDS: dict[str, tuple[type, ...]] = {
    "target": (str,),
    "draft": (str,),
    "quantize_target": (str,),
    "quantize_draft": (str,),
    "device": (str,),
    "dtype": (str,),
}
SETTING_FIELDS: dict[str, tuple[type, ...]] = {
    "rule": (str,),
    "divergence": (str,),
    "threshold": _NUMBER,
    "draft_tokens": (int,),
    "draft_policy": (str,),
    "adaptive": (bool,),
    "temperature": _NUMBER,
    "top_k": (int,),
    "top_p": _NUMBER,
    "seed": (int, type(None)),
    "max_new_tokens": (int,),
    "mode": (str,),
    "dial": (dict,),
}
DIAL_FIELDS: dict[str, tuple[type, ...]] = {
    "rule": (str,),
    "divergence": (str,),
    "threshold": _NUMBER,
    "draft_tokens": (int,),
    "draft_policy": (str,),
}
"""The decoding settings the dial moves, as `Session.settings["dial"]` stores them."""
STAT_FIELDS: dict[str, tuple[type, ...]] = {
    "tokens": (int,),
    "tokens_per_second": _NUMBER,
    "drafted": (int,),
    "acceptance_rate": _NUMBER,
    "mean_accepted_length": _NUMBER,
    "fuzzy_share": _NUMBER,
    "thresholds": (list,),
    "cost": _NUMBER,
    "spans": (list,),
}
SPAN_FIELDS: dict[str, tuple[type, ...]] = {
    "rule": (str,),
    "divergence": (str,),
    "threshold": _NUMBER,
    "tokens": (int,),
}
RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "origin": (str,),
    "threshold": _NUMBER,
    "divergence": (str,),
    "rule": (str,),
}


def checked_fields(
    what: str, data: object, fields: dict[str, tuple[type, ...]], required: tuple[str, ...]
) -> dict[str, Any]:
    """`data`, a JSON object read from a stored row (which an edit or damage may have changed), once
    its `required` keys are there and every key of `fields` it has holds a value of its types
    (other keys are kept: a newer fsd-chat may add some).

    Raises:
        MalformedSessionError: not an object, a key missing, or a value of the wrong type (one line
            naming `what` and the key).
    """
    if not isinstance(data, dict):
        raise MalformedSessionError(f"its {what} field is not a JSON object ({type(data).__name__})")
    missing = [key for key in required if key not in data]
    if missing:
        raise MalformedSessionError(f"{', '.join(missing)} missing from its {what}")
    for key, types in fields.items():
        value = data.get(key)
        # bool is an int to Python, never a count or a threshold here.
        if key in data and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise MalformedSessionError(f"{key} = {value!r:.40} in its {what} is not {_KINDS[types[0]]}")
    return data


def models_from_dict(data: object) -> dict[str, str]:
    """A session's `models` as stored (each a string; files of early versions have none).

    Raises:
        MalformedSessionError: see `checked_fields`.
    """
    return checked_fields("models", data, MODEL_FIELDS, ())


def settings_from_dict(data: object) -> dict[str, Any]:
    """A session's `settings` as stored (each of its type; any may be missing, which a transcript
    shows as "?": files of early versions have none), with today's name of its draft policy: the
    former names of `FORMER_DRAFT_POLICIES`, and the `adaptive` flag that sessions saved before
    draft policies have instead (true: "heuristic", false: "fixed").

    Raises:
        MalformedSessionError: see `checked_fields`.
    """
    settings = checked_fields("settings", data, SETTING_FIELDS, ())
    policy = settings.get("draft_policy")
    if policy is None and "adaptive" in settings:
        policy = "heuristic" if settings.pop("adaptive") else "fixed"
    if policy is not None:
        settings["draft_policy"] = FORMER_DRAFT_POLICIES.get(policy, policy)
    if "dial" in settings:
        checked_fields("dial settings", settings["dial"], DIAL_FIELDS, ())
    return settings


def final_dial(settings: dict[str, Any]) -> dict[str, Any]:
    """The dial's settings (`DIAL_FIELDS`) the session ended with: `settings["dial"]`, saved as the
    dial moves, over the settings it started with (all a session saved before the dial was saved
    has; any may be missing from a file of an early version)."""
    return {
        key: value for key, value in {**settings, **settings.get("dial", {})}.items() if key in DIAL_FIELDS
    }


def reply_from_dict(data: object) -> ReplyRecord:
    """A `ReplyRecord` from its `asdict` form, as stored.

    Raises:
        MalformedSessionError: a field is missing or of the wrong type, or a run's origin is unknown.
    """
    record = checked_fields("reply", data, {"runs": (list,), "stats": (dict,)}, ())
    stats = record.get("stats", {})
    drafted = ("drafted", "acceptance_rate", "mean_accepted_length", "fuzzy_share", "thresholds")
    required = ("tokens", "tokens_per_second", "drafted") if stats else ()
    checked_fields(
        "reply statistics", stats, STAT_FIELDS, required + (drafted if stats.get("drafted") else ())
    )
    if not all(isinstance(t, _NUMBER) for t in stats.get("thresholds", [])):
        raise MalformedSessionError("its reply statistics have thresholds that are not numbers")
    for span in stats.get("spans", []):  # absent from replies saved before spans were counted
        checked_fields("reply's setting spans", span, SPAN_FIELDS, tuple(SPAN_FIELDS))
    runs = []
    for run in record.get("runs", []):
        r = checked_fields("reply runs", run, RUN_FIELDS, tuple(RUN_FIELDS))
        try:
            origin = Origin(r["origin"])
        except ValueError:
            raise MalformedSessionError(f"a reply run has the unknown origin {r['origin']!r:.40}") from None
        runs.append(OriginRun(r["text"], origin, float(r["threshold"]), r["divergence"], r["rule"]))
    stop_reason = record.get("stop_reason")
    if stop_reason is not None and not isinstance(stop_reason, str):
        raise MalformedSessionError(f"a reply has the stop reason {stop_reason!r:.40}")
    return ReplyRecord(runs=runs, stats=dict(stats), stop_reason=stop_reason)
