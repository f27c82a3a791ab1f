"""The `fsd-chat serve` command: its own help, its options' one-line errors (exit 2), unknown command
names, and the real command serving until interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from tests.test_cli_generate import run_cli
from tests.test_server_hostile import interruptible


def test_serve_help_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["serve", "--help"], capsys)
    assert code == 0
    assert "OpenAI-compatible" in out and "--api-key" in out and "--queue-size" in out
    assert "--theme" not in out  # the chat's own options are not the server's


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hisotry"], "unknown command 'hisotry' (did you mean history?); the commands: bench, chat,"),
        (["srve", "--target", "x"], "unknown command 'srve' (did you mean serve?)"),
        (["serve", "--target", "x", "--port", "70000"], "--port must be in 0..65535"),
        (["serve", "--target", "x", "--queue-size", "0"], "--queue-size must be in 1..10,000"),
        (["serve", "--target", "x", "--api-key", " "], "--api-key is empty"),
        (["serve", "--target", "x", "--api-key", "k", "--api-key-file", "f"], "not both"),
        (["serve", "--target", "x", "--api-key-file", "/nonexistent/key"], "--api-key-file: cannot read"),
        (["serve", "--target", "x", "--api-key-file", "/dev/null"], "--api-key-file: /dev/null holds no key"),
        (["serve", "--target", "x", "--threshold", "-1"], "threshold must be a finite number ≥ 0"),
        (["serve", "--target", "x", "--rule", "lossy"], "unknown rule 'lossy'"),
    ],
)
def test_bad_input_is_one_line(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path))  # no user config.toml
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == ""
    assert err.startswith("fsd-chat: error: ") and message in err and err.count("\n") == 1


def test_an_empty_key_variable_is_an_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a server without a key: whoever set FSD_CHAT_API_KEY meant to have one."""
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("FSD_CHAT_API_KEY", " ")
    code, _, err = run_cli(["serve", "--target", "x"], capsys)
    assert code == 2 and "FSD_CHAT_API_KEY is set but empty" in err and err.count("\n") == 1


def test_config_toml_settings_reach_serve(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.toml is checked as for the chat: a bad value there fails serve in the same one line."""
    (tmp_path / "config.toml").write_text('target = "x"\nrule = "lossy"\n')
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path))
    code, _, err = run_cli(["serve"], capsys)
    assert (
        code == 2 and err.startswith("fsd-chat: error: ") and "config.toml: rule: unknown rule 'lossy'" in err
    )


@pytest.mark.slow
def test_serve_runs_until_interrupted(target_dir: Path, draft_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FSD_CHAT_CONFIG_DIR": str(tmp_path), "FSD_CHAT_DATA_DIR": str(tmp_path)}
    command = [
        sys.executable,
        "-m",
        "fsd_chat",
        "serve",
        "--target",
        str(target_dir),
        "--draft",
        str(draft_dir),
    ]
    command += ["--device", "cpu", "--threads", "1", "--port", "0", "--api-key", "k"]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=interruptible
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        assert found, line
        client = OpenAI(base_url=found.group(1), api_key="k", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["stories260K"]
        reply = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=5)
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    # uvicorn shuts down gracefully, then raises the signal again: Ctrl+C's usual 128 + SIGINT.
    assert process.returncode == 128 + signal.SIGINT, err
    assert out == "" and "Traceback" not in err
