"""A session as a Markdown transcript, and its write.

Each turn's text is contained: it sits in a code fence longer than any backtick run it holds, so a
cut-off code block, a line reading `## Assistant` or an HTML tag in a message stays text and cannot
end the turn, fake another one or run in a browser. Each reply gets its statistics and a provenance
view that renders on GitHub: a legend, then the reply in an HTML `<details>` block (the text
HTML-escaped) where each origin has its own inline mark (GitHub strips colours, so the marks are
underline, bold, italics), and the points where the threshold changed.

Transcripts are conversations, private to their owner: a new file is created 0600; an existing
one is replaced atomically and keeps its mode; a named pipe or a device is written in place.
"""

from __future__ import annotations

import html
import os
import re
import secrets
import stat
import sys
from pathlib import Path
from typing import Any

from fsd_chat.decoding.events import Origin
from fsd_chat.errors import FsdChatError
from fsd_chat.session import ReplyRecord, Session
from fsd_chat.text import visible

MARKS: dict[Origin, tuple[str, str]] = {
    Origin.DRAFT_EXACT: ("", ""),
    Origin.DRAFT_FUZZY: ("<ins>", "</ins>"),
    Origin.TARGET_RESAMPLED: ("<b>", "</b>"),
    Origin.TARGET_BONUS: ("<i>", "</i>"),
    Origin.TARGET: ("", ""),
}
"""How each origin is marked in the provenance view."""

LEGEND = (
    "plain: draft token accepted by the exact test · <ins>underlined</ins>: draft token accepted only "
    "because D ≤ T (fuzzy) · <b>bold</b>: target token resampled after a rejection · "
    "<i>italic</i>: target bonus token · <sup>⟨…⟩</sup>: the settings changed here"
)


class TranscriptError(FsdChatError):
    """A transcript could not be written."""


def decoding_summary(settings: dict[str, Any]) -> str:
    """One line of decoding settings, e.g. "fuzzy · js · T 0.050 · k 5"."""
    if settings.get("mode") == "autoregressive":
        return "autoregressive (target only)"
    parts = [settings["rule"], settings["divergence"], f"T {settings['threshold']:.3f}"]
    # Sessions saved before draft policies had an `adaptive` flag instead.
    policy = settings.get("draft_policy", "adaptive" if settings.get("adaptive") else "fixed")
    parts.append(f"k {settings['draft_tokens']}" + ("" if policy == "fixed" else f" ({policy})"))
    return " · ".join(parts)


def sampling_summary(settings: dict[str, Any]) -> str:
    """One line of sampling settings, e.g. "greedy · max 256 new tokens"."""
    parts = ["greedy" if not settings.get("temperature") else f"temperature {settings['temperature']:g}"]
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
    """A reply's statistics in one line (tokens, tokens/s, acceptance, τ, fuzzy share, T, cost,
    end)."""
    s = record.stats
    if not s:
        return "no tokens"
    parts = [f"{s['tokens']} tokens", f"{s['tokens_per_second']:.1f} tokens/s"]
    if s["drafted"]:
        parts += [
            f"acceptance {s['acceptance_rate']:.0%}",
            f"mean accepted length {s['mean_accepted_length']:.2f}",
            f"fuzzy {s['fuzzy_share']:.0%}",
            "T " + " → ".join(f"{t:.3f}" for t in s["thresholds"]),
        ]
        if "cost" in s:  # absent from sessions saved before costs were measured
            parts.append(cost_summary(s["cost"], s["tokens"]))
    if record.stop_reason == "stopped":
        parts.append("stopped")
    elif record.stop_reason:
        parts.append(f"ended: {record.stop_reason}")
    return " · ".join(parts)


def _escape(text: str) -> str:
    # Newlines become <br> so that the HTML block has no blank line (which would end it).
    return html.escape(text, quote=False).replace("\n", "<br>\n")


def provenance_html(record: ReplyRecord) -> str:
    """The reply with each run marked by origin, and ⟨…⟩ where the settings changed."""
    out: list[str] = []
    previous = None
    for run in record.runs:
        if previous is not None and run.setting != previous:
            out.append(f"<sup>⟨{run.divergence} T {run.threshold:.3f}⟩</sup>")
        previous = run.setting
        start, end = MARKS[run.origin]
        out.append(f"{start}{_escape(run.text)}{end}")
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


def _draft_kind(models: dict[str, Any]) -> str:
    # Sessions saved before mapped drafts have no kind: their drafts shared the target's tokenizer.
    return " · vocabulary mapped onto the target's" if models.get("draft_kind") == "mapped" else ""


def render_markdown(session: Session) -> str:
    """The whole session as Markdown: a header table, then every turn."""
    m = session.models
    lines = [
        f"# fsd-chat session {session.id}",
        "",
        "| | |",
        "|---|---|",
        f"| Date | {session.created} |",
        f"| Target | {_code_cell(str(m.get('target', '')))} ({m.get('quantize_target', 'none')}) |",
        f"| Draft | {_code_cell(str(m.get('draft', '')))} ({m.get('quantize_draft', 'none')}){_draft_kind(m)} |",
        f"| Device | {m.get('device', '')} {m.get('dtype', '')} |",
        f"| Decoding | {decoding_summary(session.settings)} |",
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
    """Where a transcript goes by default: `fsd-chat-<date>-<id>.md` in `directory`."""
    stamp = session.created[:16].replace(":", "").replace("T", "-")
    return directory / f"fsd-chat-{stamp}-{session.id}.md"


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path`; returns the absolute path.

    A regular file or a new path is written through a temporary file in the same folder and a
    rename, so a reader never sees half a file: a new file is created 0600 (a conversation is
    private), an existing one keeps its mode. A named pipe or a character device (`/dev/stdout`)
    is written in place: renaming over it would replace it with a file nobody reads.

    Raises:
        TranscriptError: the folder cannot be created or written, the path is a folder, or the
            write fails (a full disk).
    """
    path = path.expanduser().absolute()
    try:
        existing = path.stat()
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        if existing is not None and (stat.S_ISFIFO(existing.st_mode) or stat.S_ISCHR(existing.st_mode)):
            with open(path, "w", encoding="utf-8") as stream:
                stream.write(text)
            return path
        mode = 0o600 if existing is None else stat.S_IMODE(existing.st_mode)
        # A link to a file: replace the file it points to, and keep the link.
        target = Path(os.path.realpath(path)) if existing is not None else path
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
                f.write(text)
                os.fchmod(f.fileno(), mode)  # not left to the umask: an existing file keeps its mode exactly
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


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
    if output is None or output == STDOUT:
        sys.stdout.write(visible(text) if sys.stdout.isatty() else text)
        return None
    replaced = output.expanduser().is_file()
    path = write_atomic(output, text)
    return f"{'overwrote' if replaced else 'wrote'} {path}"
