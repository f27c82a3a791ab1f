"""The chat killed mid-reply (kill -9, SIGTERM) in a process of its own: the session stays valid
and keeps the reply up to its last save."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls
from fsd_chat.models.pair import ModelPair
from tests.conftest import DRAFT_DIR, TARGET_DIR
from tests.tui.chat_process import MAX_NEW_TOKENS, PROMPT, SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def stored_reply(path: Path) -> tuple[str, str] | None:
    """(text, stop reason) of the stored reply row, once it holds some text."""
    if not path.exists():
        return None
    try:
        row = sqlite3.connect(path).execute("SELECT reply FROM turns WHERE role = 'assistant'").fetchone()
    except sqlite3.Error:
        return None
    if row is None:
        return None
    reply = json.loads(row[0])
    text = "".join(run["text"] for run in reply["runs"])
    return (text, reply["stop_reason"]) if text else None


def run_until_streamed(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start the chat process and wait until its reply is stored while streaming."""
    env = {**os.environ, "FSD_CHAT_DATA_DIR": str(tmp_path / "data"), "FSD_CHAT_CONFIG_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "tests.tui.chat_process", str(TARGET_DIR), str(DRAFT_DIR)]
    process = subprocess.Popen(command, cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while (stored := stored_reply(tmp_path / "data" / "sessions.sqlite3")) is None:
        assert process.poll() is None, "the chat process ended early"
        assert time.monotonic() < deadline, "no streaming reply was saved"
        time.sleep(0.1)
    assert stored[1] == "streaming"
    return process, stored[0]


def reply_start(pair: ModelPair, chars: int) -> str:
    """The start of the reply the chat process decodes (greedy: the same every time): its steps'
    texts, in order, until they hold at least `chars` characters (or the reply ends). A stored
    reply of `chars` characters is the chat's iff this starts with it; the rest of the reply (up to
    MAX_NEW_TOKENS) is not decoded."""
    decoder = pair.speculative(Controls(SETTINGS))
    text = ""
    for step in decoder.generate(pair.tokenizer(PROMPT).input_ids, max_new_tokens=MAX_NEW_TOKENS):
        text += step.text
        if len(text) >= chars:
            break
    return text


@pytest.mark.slow
def test_kill_9_mid_reply_keeps_the_reply_up_to_the_last_save(pair: ModelPair, tmp_path: Path) -> None:
    process, streamed = run_until_streamed(tmp_path)
    process.kill()
    process.wait(30)
    store = SessionStore(tmp_path / "data" / "sessions.sqlite3")
    (summary,) = store.summaries()
    session = store.load(summary.id)
    assert [t.role for t in session.turns] == ["user", "assistant"]
    reply = session.turns[1].reply
    assert reply is not None and reply.stop_reason == "stopped"  # shown as stopped on resume
    assert len(reply.text) >= len(streamed) and reply_start(pair, len(reply.text)).startswith(reply.text)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_the_reply_as_stopped(pair: ModelPair, tmp_path: Path, signum: int) -> None:
    process, streamed = run_until_streamed(tmp_path)
    process.send_signal(signum)
    assert process.wait(30) == 128 + signum
    stored = stored_reply(tmp_path / "data" / "sessions.sqlite3")
    assert stored is not None and stored[1] == "stopped"  # written by the chat itself, not repaired
    text = stored[0]
    assert len(text) >= len(streamed) and reply_start(pair, len(text)).startswith(text)
