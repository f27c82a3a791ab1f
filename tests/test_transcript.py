"""Markdown transcripts and their atomic write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsd_chat.decoding.events import Origin
from fsd_chat.session import ReplyRecord, Run, Session, Turn
from fsd_chat.transcript import TranscriptError, default_path, provenance_html, render_markdown, write_atomic


def session() -> Session:
    """A session whose reply has every speculative origin, a T change and HTML-like text."""
    reply = ReplyRecord(
        runs=[
            Run("Once <b>", Origin.DRAFT_EXACT, 0.1, "js", "fuzzy"),
            Run(" upon", Origin.DRAFT_FUZZY, 0.1, "js", "fuzzy"),
            Run(" a\n\ntime", Origin.TARGET_RESAMPLED, 0.1, "js", "fuzzy"),
            Run(" there", Origin.TARGET_BONUS, 0.14, "js", "fuzzy"),
        ],
        stats={
            "tokens": 9,
            "tokens_per_second": 812.34,
            "acceptance_rate": 0.75,
            "mean_accepted_length": 3.0,
            "fuzzy_share": 0.125,
            "drafted": 8,
            "thresholds": [0.1, 0.14],
        },
        stop_reason="stopped",
    )
    return Session(
        id="feed0001",
        created="2025-03-04T05:06:07+00:00",
        models={
            "target": "/m/target",
            "draft": "/m/draft",
            "quantize_target": "4bit",
            "quantize_draft": "none",
            "device": "cpu",
            "dtype": "float32",
        },
        settings={
            "rule": "fuzzy",
            "divergence": "js",
            "threshold": 0.1,
            "draft_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 3,
            "max_new_tokens": 64,
        },
        turns=[Turn("user", "Tell me"), Turn("assistant", "Once <b> upon a\n\ntime there", reply=reply)],
    )


def test_markdown_has_header_turns_stats_and_provenance() -> None:
    text = render_markdown(session())
    assert text.startswith("# fsd-chat session feed0001\n")
    assert "| Date | 2025-03-04T05:06:07+00:00 |" in text
    assert "| Target | `/m/target` (4bit) |" in text
    assert "| Device | cpu float32 |" in text
    assert "| Decoding | fuzzy · js · T 0.100 · k 4 |" in text
    assert "| Sampling | temperature 0.7 · top-p 0.9 · seed 3 · max 64 new tokens |" in text
    assert "## User\n\nTell me\n" in text
    assert (
        "> 9 tokens · 812.3 tokens/s · acceptance 75% · mean accepted length 3.00 · fuzzy 12% · "
        "T 0.100 → 0.140 · stopped" in text
    )
    block = text[text.index("<details>") : text.index("</details>")]
    assert "\n\n" not in block.split("<p>", 1)[1]  # no blank line ends the HTML block early


def test_provenance_marks_each_origin_and_the_threshold_change() -> None:
    html = provenance_html(session().turns[1].reply)  # type: ignore[arg-type]
    assert html == (
        "Once &lt;b&gt;<ins> upon</ins><b> a<br>\n<br>\ntime</b><sup>⟨js T 0.140⟩</sup><i> there</i>"
    )


def test_atomic_write_and_unwritable_paths(tmp_path: Path) -> None:
    path = default_path(tmp_path / "out", session())
    assert path.name == "fsd-chat-2025-03-04-0506-feed0001.md"
    written = write_atomic(path, "hello")
    assert written == path and path.read_text() == "hello"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not the 0600 of a temporary file
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    with pytest.raises(TranscriptError, match="cannot write"):
        write_atomic(tmp_path / "out", "a folder is not a file")
    (tmp_path / "blocker").write_text("")
    with pytest.raises(TranscriptError, match="cannot write"):
        write_atomic(tmp_path / "blocker" / "t.md", "under a file")
