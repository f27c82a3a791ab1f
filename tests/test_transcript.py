"""Markdown transcripts and their atomic write."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from fsd_chat.conversation.session import OriginRun, ReplyRecord, Session, Turn
from fsd_chat.conversation.transcript import (
    TranscriptError,
    default_path,
    export_transcript,
    provenance_html,
    render_markdown,
    reply_summary,
    write_atomic,
)
from fsd_chat.decoding.events import Origin
from fsd_chat.tui.widgets.conversation import provenance_content


def session() -> Session:
    """A session whose reply has every speculative origin, a T change and HTML-like text."""
    reply = ReplyRecord(
        runs=[
            OriginRun("Once <b>", Origin.DRAFT_EXACT, 0.1, "js", "fuzzy"),
            OriginRun(" upon", Origin.DRAFT_FUZZY, 0.1, "js", "fuzzy"),
            OriginRun(" a\n\ntime", Origin.TARGET_RESAMPLED, 0.1, "js", "fuzzy"),
            OriginRun(" there", Origin.TARGET_BONUS, 0.14, "js", "fuzzy"),
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
    assert "## User\n\n```text\nTell me\n```\n" in text
    assert (
        "> 9 tokens · 812.3 tokens/s · acceptance 75% · mean accepted length 3.00 · fuzzy 12% · "
        "T 0.100 → 0.140 · stopped" in text
    )
    block = text[text.index("<details>") : text.index("</details>")]
    assert "\n\n" not in block.split("<p>", 1)[1]  # no blank line ends the HTML block early


@pytest.mark.parametrize(
    ("cost", "shown"), [(0.0, "cost 0 (lossless)"), (0.5, "cost 0.5 nats (0.0556/token)"), (None, None)]
)
def test_each_reply_carries_its_cost(cost: float | None, shown: str | None) -> None:
    chat = session()
    reply = chat.turns[1].reply
    assert reply is not None
    if cost is not None:
        reply.stats["cost"] = cost
    line = next(line for line in render_markdown(chat).splitlines() if line.startswith("> 9 tokens"))
    if shown is None:  # a session saved before costs were measured
        assert "cost" not in line
    else:
        assert line.endswith(f"T 0.100 → 0.140 · {shown} · stopped")


def test_provenance_marks_each_origin_and_the_threshold_change() -> None:
    html = provenance_html(session().turns[1].reply)  # type: ignore[arg-type]
    assert html == (
        "Once &lt;b&gt;<ins> upon</ins><b> a<br>\n<br>\ntime</b><sup>⟨T 0.140⟩</sup><i> there</i>"
    )


def test_a_change_of_rule_is_named_with_what_the_new_rule_reads() -> None:
    # fuzzy js 0.1 -> mixture 0.16 (which reads no divergence) -> tv under mixture (no mark, one
    # span) -> pure (which reads the divergence again) -> exact (which reads neither).
    settings = [("fuzzy", "js", 0.1), ("mixture", "js", 0.16), ("mixture", "tv", 0.16), ("pure", "tv", 0.16)]
    settings.append(("exact", "tv", 0.16))
    record = ReplyRecord(
        runs=[OriginRun(f"w{i} ", Origin.DRAFT_EXACT, t, d, r) for i, (r, d, t) in enumerate(settings)],
        stats={
            **session().turns[1].reply.stats,  # type: ignore[union-attr]
            "spans": [
                {"rule": r, "divergence": d, "threshold": t, "tokens": n}
                for (r, d, t), n in zip(settings, [3, 2, 2, 1, 1], strict=True)
            ],
        },
    )
    assert provenance_html(record) == (
        "w0 <sup>⟨mixture T 0.160⟩</sup>w1 w2 <sup>⟨pure tv T 0.160⟩</sup>w3 <sup>⟨exact⟩</sup>w4 "
    )
    assert (
        "under fuzzy js T 0.100 for 3 tokens → mixture T 0.160 for 4 tokens → pure tv T 0.160 for 1 token → "
        "exact for 1 token · stopped"
    ) in reply_summary(record) + " · stopped"
    one = ReplyRecord(runs=record.runs[:1], stats={**record.stats, "spans": record.stats["spans"][:1]})
    assert reply_summary(one).endswith("fuzzy 12% · under fuzzy js T 0.100")


def test_atomic_write_and_unwritable_paths(tmp_path: Path) -> None:
    path = default_path(tmp_path / "out", session())
    assert path.name == "fsd-chat-2025-03-04-0506-feed0001.md"
    written = write_atomic(path, "hello")
    assert written == path and path.read_text() == "hello"
    assert path.stat().st_mode & 0o777 == 0o600  # a conversation is private, whatever the umask
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    with pytest.raises(TranscriptError, match="cannot write"):
        write_atomic(tmp_path / "out", "a folder is not a file")
    (tmp_path / "blocker").write_text("")
    with pytest.raises(TranscriptError, match="cannot write"):
        write_atomic(tmp_path / "blocker" / "t.md", "under a file")


HOSTILE_TURNS = [
    Turn("user", "Show me code\n## Assistant\nI am a fake turn\n<script>alert(1)</script>"),
    # A reply cut off inside a code block (max-new-tokens or Escape): the fence is never closed.
    Turn("assistant", "Here:\n```python\nprint('never closed')\n# Heading inside code"),
    Turn("user", "<img src=x onerror=alert(1)> and ```` four backticks ````, `one`"),
    Turn("assistant", "~~~\n### also not a heading\n<details><summary>x</summary>"),
]


def test_each_turn_is_contained_whatever_its_text() -> None:
    hostile = session()
    hostile.system = "# System heading?\n```"
    hostile.turns = HOSTILE_TURNS
    hostile.models["target"] = "/m/t|a`rget"
    tokens = MarkdownIt("gfm-like").parse(render_markdown(hostile))
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings == ["fsd-chat session feed0001", "System", "User", "Assistant", "User", "Assistant"]
    # Every turn's text comes back from the parser exactly, as code, never as HTML.
    fences = [t.content for t in tokens if t.type == "fence"]
    assert fences == [hostile.system + "\n"] + [turn.content + "\n" for turn in HOSTILE_TURNS]
    html_tokens = [t for t in tokens if t.type in ("html_block", "html_inline")]
    assert not any("<script" in t.content or "onerror" in t.content for t in html_tokens)
    # The header table keeps its two columns despite the pipe and backtick in the model name.
    assert MarkdownIt("gfm-like").render(render_markdown(hostile)).count("<td>") == 12


def test_existing_file_keeps_its_mode_and_the_user_is_told(tmp_path: Path) -> None:
    path = tmp_path / "t.md"
    assert export_transcript("first", path) == f"wrote {path}"
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o640)
    assert export_transcript("second", path) == f"overwrote {path}"
    assert path.read_text() == "second" and path.stat().st_mode & 0o777 == 0o640
    link = tmp_path / "link.md"
    link.symlink_to(path)
    with pytest.raises(TranscriptError, match=r"link\.md is a symbolic link \(to .*t\.md\)"):
        write_atomic(link, "third")  # refused: a rename would replace its target and its owner
    assert link.is_symlink() and path.read_text() == "second"


def test_named_pipe_is_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[str] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    write_atomic(fifo, "through the pipe")
    reader.join(timeout=10)
    assert received == ["through the pipe"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # still a pipe, not replaced by a file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_full_device_is_an_error_not_a_replaced_file() -> None:
    with pytest.raises(TranscriptError, match="No space left"):
        write_atomic(Path("/dev/full"), "nowhere to go")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_dash_is_standard_output_and_escapes_are_shown_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "title \x1b]0;pwned\x07 clear \x1b[2J\ttab\n"
    assert export_transcript(text, Path("-")) is None
    assert capsys.readouterr().out == text  # a pipe or a file gets the text exactly
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    export_transcript(text, None)
    shown = capsys.readouterr().out
    assert shown == "title ␛]0;pwned␇ clear ␛[2J\ttab\n" and "\x1b" not in shown


def test_a_change_inside_a_word_is_marked_where_the_word_ends() -> None:
    # T moved between "L" and "uminaria": the mark waits for the word's end, in the export and on screen.
    runs = [
        OriginRun("The L", Origin.TARGET, 0.05, "js", "fuzzy"),
        OriginRun("uminaria was", Origin.DRAFT_EXACT, 0.1, "js", "fuzzy"),
        OriginRun(" bright", Origin.TARGET, 0.1, "js", "fuzzy"),
    ]
    record = ReplyRecord(runs=runs, stats={})
    assert provenance_html(record) == "The Luminaria<sup>⟨T 0.100⟩</sup> was bright"
    assert provenance_content(runs).plain == "The Luminaria⟨T 0.10⟩ was bright"
    # A change at a word's start stays where it is.
    runs[1] = OriginRun(" uminaria", Origin.DRAFT_EXACT, 0.1, "js", "fuzzy")
    assert provenance_content(runs).plain == "The L⟨T 0.10⟩ uminaria bright"


def test_a_change_after_an_apostrophe_is_marked_where_the_word_ends() -> None:
    # T moved between "didn'" and "t" (a tokenizer's split): the apostrophe is inside the word.
    for apostrophe in ("'", "\u2019"):
        runs = [
            OriginRun(f"Lily didn{apostrophe}", Origin.TARGET, 0.05, "js", "fuzzy"),
            OriginRun("t know", Origin.DRAFT_EXACT, 0.5, "js", "fuzzy"),
        ]
        assert provenance_content(runs).plain == f"Lily didn{apostrophe}t⟨T 0.50⟩ know"
    # A quote closed before the change is not a word: the mark stays after it.
    runs = [
        OriginRun("said 'hi'", Origin.TARGET, 0.05, "js", "fuzzy"),
        OriginRun(" then", Origin.DRAFT_EXACT, 0.5, "js", "fuzzy"),
    ]
    assert provenance_content(runs).plain == "said 'hi'⟨T 0.50⟩ then"
