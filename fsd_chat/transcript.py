"""A session as a Markdown transcript, and its atomic write.

Each reply gets its statistics and a provenance view that renders on GitHub: a legend, then the
reply in an HTML `<details>` block where each origin has its own inline mark (GitHub strips colours,
so the marks are underline, bold, italics), and the points where the threshold changed.
"""

from __future__ import annotations

import html
import os
import secrets
from pathlib import Path
from typing import Any

from fsd_chat.decoding.events import Origin
from fsd_chat.errors import FsdChatError
from fsd_chat.session import ReplyRecord, Session

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


def reply_summary(record: ReplyRecord) -> str:
    """A reply's statistics in one line (tokens, tokens/s, acceptance, τ, fuzzy share, T, end)."""
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


def render_markdown(session: Session) -> str:
    """The whole session as Markdown: a header table, then every turn."""
    m = session.models
    lines = [
        f"# fsd-chat session {session.id}",
        "",
        "| | |",
        "|---|---|",
        f"| Date | {session.created} |",
        f"| Target | `{m.get('target', '')}` ({m.get('quantize_target', 'none')}) |",
        f"| Draft | `{m.get('draft', '')}` ({m.get('quantize_draft', 'none')}) |",
        f"| Device | {m.get('device', '')} {m.get('dtype', '')} |",
        f"| Decoding | {decoding_summary(session.settings)} |",
        f"| Sampling | {sampling_summary(session.settings)} |",
        "",
    ]
    if session.system:
        lines += ["## System", "", session.system, ""]
    for turn in session.turns:
        lines += [f"## {turn.role.capitalize()}", "", turn.content or "*(empty)*", ""]
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
    """Write `text` to `path` through a temporary file in the same folder and a rename, so a
    reader never sees half a file; returns the absolute path.

    Raises:
        TranscriptError: the folder cannot be created or written, or the path is a folder.
    """
    path = path.expanduser().absolute()
    # Not tempfile.mkstemp: its 0600 mode would stay on the transcript; "x" honours the umask.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "x", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise TranscriptError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
