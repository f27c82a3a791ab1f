"""A session as a Markdown transcript, and its write.

Each turn's text is contained: it sits in a code fence longer than any backtick run it holds, so a
cut-off code block, a line reading `## Assistant` or an HTML tag in a message stays text and cannot
end the turn, fake another one or run in a browser. Each reply gets its statistics and a provenance
view that renders on GitHub: a legend, then the reply in an HTML `<details>` block (the text
HTML-escaped) where each origin has its own inline mark (GitHub strips colours, so the marks are
underline, bold, italics), and the points where the threshold changed.

Transcripts are conversations, private to their owner: a new file is created 0600; an existing
one is replaced atomically and keeps its mode (see `write_atomic` for links, read-only files, pipes
and devices); a path that is standard output (`-o /dev/stdout >> all.md`) is written through it.
"""

from __future__ import annotations

import html
import os
import re
import secrets
import signal
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsd_chat.conversation.session import (
    ReplyRecord,
    Session,
    Setting,
    describe_setting,
    final_dial,
    marked_pieces,
)
from fsd_chat.decoding.events import Origin
from fsd_chat.decoding.settings import LOOKUP, REGRET
from fsd_chat.models.options import quantization_note
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import counted, visible

MARKS: dict[Origin, tuple[str, str]] = {
    Origin.DRAFT_EXACT: ("", ""),
    Origin.DRAFT_FUZZY: ("<ins>", "</ins>"),
    Origin.TARGET_RESAMPLED: ("<b>", "</b>"),
    Origin.TARGET_BONUS: ("<i>", "</i>"),
    Origin.TARGET: ("", ""),
}
"""How each origin is marked in the provenance view."""

LEGEND = (
    "plain: the target's own token (`target`: a step that drafted nothing, e.g. while the draft policy was "
    "paused) or a draft token the exact test accepted; both follow the target · <ins>underlined</ins>: draft token kept by the relaxed "
    "test where its law departs from the target's (cost > 0) · <b>bold</b>: target token resampled after a rejection · "
    "<i>italic</i>: target bonus token · <sup>⟨…⟩</sup>: the settings changed here"
)


class TranscriptError(FsdChatError):
    """A transcript could not be written."""


def _greedy(settings: dict[str, Any]) -> bool:
    """Whether a stored session decoded greedily (temperature 0, or none saved)."""
    return not settings.get("temperature")


def decoding_summary(settings: dict[str, Any]) -> str:
    """One line of decoding settings, e.g. "fuzzy · js · T 0.050 · k 5", "mixture · T 0.160 · k 5",
    "fuzzy · regret · T 0.500 · k 5" (greedy)."""
    if settings.get("mode") == "autoregressive":
        return "autoregressive (target only)"
    # A stored session may lack any of them (`fsd_chat.conversation.session.settings_from_dict`): shown as "?".
    threshold = settings.get("threshold")
    rule = settings.get("rule", "?")
    parts = [rule]
    # What the rule does not read is not named (see `describe_setting`); an unknown rule shows all.
    # Greedy decoding reads no divergence: every relaxed rule tests the regret (`REGRET`).
    if rule not in ("mixture", "exact"):
        parts.append(REGRET if _greedy(settings) else settings.get("divergence", "?"))
    if rule != "exact":
        parts.append("T ?" if threshold is None else f"T {threshold:.3f}")
    policy = settings.get("draft_policy", "fixed")
    parts.append(f"k {settings.get('draft_tokens', '?')}" + ("" if policy == "fixed" else f" ({policy})"))
    return " · ".join(parts)


def _decoding_cell(settings: dict[str, Any]) -> str:
    """The decoding settings the session started with, and those the dial ended on when it moved
    (each reply's stats line gives the spans of the settings it was decoded under)."""
    start = decoding_summary(settings)
    end = decoding_summary({**settings, **final_dial(settings)})
    return start if end == start else f"{start} at the start; {end} at the end"


def sampling_summary(settings: dict[str, Any]) -> str:
    """One line of sampling settings, e.g. "greedy · max 256 new tokens"."""
    parts = ["greedy" if _greedy(settings) else f"temperature {settings['temperature']:g}"]
    if settings.get("top_k"):
        parts.append(f"top-k {settings['top_k']}")
    if settings.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {settings['top_p']:g}")
    if settings.get("seed") is not None:
        parts.append(f"seed {settings['seed']}")
    parts.append(f"max {settings.get('max_new_tokens')} new tokens")
    return " · ".join(parts)


def cost_summary(cost: float, tokens: int) -> str:
    """A reply's cost (nats; see `fsd_chat.decoding.acceptance`), e.g. "cost 1.23 nats (0.0123/token)";
    "cost 0 (lossless)" when every token followed the target's law."""
    if cost == 0:
        return "cost 0 (lossless)"
    return f"cost {cost:.3g} nats ({cost / max(tokens, 1):.4f}/token)"


def reply_summary(record: ReplyRecord) -> str:
    """A reply's statistics in one line (tokens, tokens/s, time to the first token, acceptance, τ,
    fuzzy share, T, cost, end)."""
    s = record.stats
    if not s:
        return "no tokens"
    parts = [counted(s["tokens"], "token"), f"{s['tokens_per_second']:.1f} tokens/s"]
    if "first_token_seconds" in s:  # absent from sessions saved before it was measured
        parts.append(f"first token {s['first_token_seconds']:.2f} s")
    if s["drafted"]:
        parts += [
            f"acceptance {s['acceptance_rate']:.0%}",
            f"mean accepted length {s['mean_accepted_length']:.2f}",
            f"fuzzy {s['fuzzy_share']:.0%}",
            dial_summary(s),
        ]
        if "cost" in s:  # absent from sessions saved before costs were measured
            parts.append(cost_summary(s["cost"], s["tokens"]))
        if s.get("lookup_hits"):
            parts.append(f"lookup hits {s['lookup_hits']} of {counted(s['steps'], 'step')}")
    if record.stop_reason == "stopped":
        parts.append("stopped")
    elif record.stop_reason:
        parts.append(f"ended: {record.stop_reason}")
    return " · ".join(parts)


def dial_summary(stats: dict[str, Any]) -> str:
    """The settings a reply was decoded under and the tokens each decided, e.g. "under fuzzy js
    T 0.100 for 8 tokens → mixture T 0.160 for 32 tokens" (each later span names what changed: see
    `describe_setting`); the thresholds alone for a reply saved before spans were counted."""
    spans = stats.get("spans")
    if not spans:
        return "T " + " → ".join(f"{t:.3f}" for t in stats["thresholds"])
    parts: list[tuple[str, int]] = []
    previous: Setting | None = None
    for span in spans:
        setting: Setting = (span["rule"], span["divergence"], span["threshold"])
        change = describe_setting(setting, previous)
        if parts and not change:  # a change that does not matter under the rule: one span
            parts[-1] = (parts[-1][0], parts[-1][1] + span["tokens"])
        else:
            parts.append((change, span["tokens"]))
        previous = setting
    if len(parts) == 1:
        return f"under {parts[0][0]}"
    return "under " + " → ".join(f"{label} for {counted(tokens, 'token')}" for label, tokens in parts)


def _escape(text: str) -> str:
    # Newlines become <br> so that the HTML block has no blank line (which would end it).
    return html.escape(text, quote=False).replace("\n", "<br>\n")


def provenance_html(record: ReplyRecord) -> str:
    """The reply with each run marked by origin, and ⟨…⟩ where the settings changed."""
    out: list[str] = []
    for piece in marked_pieces(record.runs):
        if piece.origin is None:
            out.append(f"<sup>⟨{html.escape(piece.text)}⟩</sup>")
        else:
            start, end = MARKS[piece.origin]
            out.append(f"{start}{_escape(piece.text)}{end}")
    return "".join(out)


def fenced(text: str) -> list[str]:
    """`text` as a fenced code block whose fence is longer than any backtick run in it (so nothing in
    the text can close it), as lines."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}text", *text.split("\n"), fence]


def _code_cell(text: str) -> str:
    # An inline code span in a table cell: one line, its pipes escaped (GFM splits cells on them
    # even inside code), delimiters longer than any backtick run inside.
    text = " ".join(text.splitlines()).replace("|", "\\|")
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _draft_cell(models: dict[str, Any], settings: dict[str, Any]) -> str:
    """The draft model, its quantization and its kind, prompt lookup (no draft model), or none
    (target-only decoding drafts nothing, whatever draft was loaded)."""
    if settings.get("mode") == "autoregressive":
        return "none (target only)"
    draft = str(models.get("draft", ""))
    if draft == LOOKUP:
        return "prompt lookup (no draft model)"
    # Sessions saved before mapped drafts have no kind: their drafts shared the target's tokenizer.
    mapped = " · vocabulary mapped onto the target's" if models.get("draft_kind") == "mapped" else ""
    return f"{_code_cell(draft)}{quantization_note(str(models.get('quantize_draft', 'none')))}{mapped}"


def render_markdown(session: Session) -> str:
    """The whole session as Markdown: a header table, then every turn."""
    m = session.models
    lines = [
        f"# fsd-chat session {session.id}",
        "",
        "| | |",
        "|---|---|",
        f"| Date | {session.created} |",
        f"| Target | {_code_cell(str(m.get('target', '')))}{quantization_note(str(m.get('quantize_target', 'none')))} |",
        f"| Draft | {_draft_cell(m, session.settings)} |",
        f"| Device | {m.get('device', '')} {m.get('dtype', '')} |",
        f"| Decoding | {_decoding_cell(session.settings)} |",
        f"| Sampling | {sampling_summary(session.settings)} |",
        "",
    ]
    if session.system:
        lines += ["## System", "", *fenced(session.system), ""]
    for turn in session.turns:
        body = fenced(turn.content) if turn.content else ["*(empty)*"]
        lines += [f"## {turn.role.capitalize()}", "", *body, ""]
        if turn.reply is not None:
            lines += [f"> {reply_summary(turn.reply)}", ""]
            if turn.reply.runs:
                lines += [
                    "<details><summary>Provenance</summary>",
                    "",
                    f"<p>{LEGEND}</p>",
                    f"<p>{provenance_html(turn.reply)}</p>",
                    "</details>",
                    "",
                ]
    return "\n".join(lines)


def default_path(directory: Path, session: Session) -> Path:
    """Where a transcript goes by default: `fsd-chat-<date>-<id>.md` in `directory`. The id and
    date come from the store, which an edit may have changed: anything but letters, digits, ".",
    "-" and "_" becomes "_", so the name holds no "/" and cannot climb out of `directory`
    (`../../x`)."""
    stamp = session.created[:16].replace(":", "").replace("T", "-")
    return directory / _SAFE_NAME.sub("_", f"fsd-chat-{stamp}-{session.id}.md")


_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path`; returns the absolute path.

    A new path, or a regular file of the user's that they may write, is written through a
    temporary file in the same folder and a rename, so a reader never sees half a file: a new file
    is created 0600 (a conversation is private), an existing one keeps its mode. A file without
    write permission is refused, as the shell's `>` refuses it. A symbolic link is refused (a
    rename would replace the file it points to, and give it a new owner): the path of the file
    itself is asked for. A named pipe, a device (`/dev/null`) or another user's file that the user
    may write is written in place: it keeps its kind and its owner.

    Raises:
        TranscriptError: the path is a link, a folder or read-only; its folder cannot be created
            or written; or the write fails (a full disk).
    """
    path = path.expanduser().absolute()
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror or exc}") from None
    if existing is not None and stat.S_ISLNK(existing.st_mode):
        raise TranscriptError(
            f"{path} is a symbolic link (to {os.readlink(path)}): fsd-chat does not write through links; "
            "give the path of the file itself"
        )
    try:
        if existing is not None and (not stat.S_ISREG(existing.st_mode) or existing.st_uid != os.geteuid()):
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
            with open(fd, "w", encoding="utf-8") as stream:
                stream.write(text)
            return path
        if existing is not None and not os.access(path, os.W_OK):
            raise TranscriptError(
                f"cannot write {path}: it is read-only (chmod u+w it, or choose another name)"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        mode = 0o600 if existing is None else stat.S_IMODE(existing.st_mode)
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
                f.write(text)
                os.fchmod(f.fileno(), mode)  # not left to the umask: an existing file keeps its mode exactly
            os.replace(tmp, path)
        except (
            BaseException
        ):  # an error, ctrl+c, or SIGTERM/SIGHUP (which `fsd_chat.cli` raises as SystemExit)
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


@contextmanager
def ending_signals_raise() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise SystemExit(128 + the signal's number), as ctrl+c raises
    KeyboardInterrupt, so that a write in progress removes its temporary file (by default they end
    the process at once, leaving it). For the command line's main thread; the chat has its own
    handlers.
    """

    def end(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {signum: signal.signal(signum, end) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


STDOUT = Path("-")


def export_transcript(text: str, output: Path | None) -> str | None:
    """Write a transcript to standard output (`output` None or "-") or to `output`.

    On a terminal, control characters in the text are shown as visible symbols; a file or a pipe
    gets the text exactly.

    Returns:
        What to tell the user when a file was written ("wrote PATH", or "overwrote PATH" when it
        replaced a file), else None.

    Raises:
        TranscriptError: the file cannot be written.
        OSError: standard output cannot be written.
    """
    if output is None or output == STDOUT or _is_stdout(output):
        sys.stdout.write(visible(text) if sys.stdout.isatty() else text)
        return None
    replaced = output.expanduser().is_file()
    path = write_atomic(output, text)
    return f"{'overwrote' if replaced else 'wrote'} {path}"


def _is_stdout(path: Path) -> bool:
    """Whether `path` names the file standard output already is (`/dev/stdout`, `/dev/fd/1`):
    writing there through standard output keeps how the shell opened it (`>>` appends)."""
    try:
        return os.path.samestat(os.stat(path.expanduser()), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):  # no such file, or no real standard output (tests capture it)
        return False
