"""The chat, history and export commands through the real CLI entry point (`fsd-chat`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from fsd_chat.cli import app
from fsd_chat.conversation.store import SessionStore
from fsd_chat.support.config import config_dir, sessions_path
from tests.test_cli_generate import run_cli as run
from tests.test_store import make_session


def test_history_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["history"], capsys) == (0, "no saved sessions yet\n", "")
    code, _, err = run(["export", "abcd"], capsys)
    assert code == 2 and err.startswith("fsd-chat: error: no saved sessions yet")
    assert not sessions_path().exists()  # reading created nothing
    session = make_session("abcd1234")
    SessionStore(sessions_path()).append_turns(session, session.turns)
    code, out, _ = run(["history"], capsys)
    assert code == 0 and out.startswith("abcd1234  ") and "2 turns  t + d  Hello" in out
    code, out, _ = run(["export", "abcd"], capsys)
    assert code == 0 and out.startswith("# fsd-chat session abcd1234\n") and "## Assistant" in out
    target = tmp_path / "t.md"
    code, out, _ = run(["export", "abcd1234", "-o", str(target)], capsys)
    assert code == 0 and out.strip() == f"wrote {target}"
    assert target.read_text().startswith("# fsd-chat session abcd1234")
    code, _, err = run(["export", "nope"], capsys)
    assert code == 2 and err == "fsd-chat: error: no saved session 'nope'; `fsd-chat history` lists them\n"


def test_chat_errors_before_the_tui_starts(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    # No command: `chat` is meant.
    code, _, err = run(["--target", str(missing), "--draft", str(target_dir)], capsys)
    assert code == 2 and err == f"fsd-chat: error: model path not found: {missing}\n"
    code, _, err = run(["chat"], capsys)
    assert code == 2 and err.startswith("fsd-chat: error: no target model: pass --target")
    code, _, err = run(["chat", "--resume", "nope"], capsys)
    assert code == 2 and err.startswith("fsd-chat: error: no saved sessions yet")  # and none is created
    assert not sessions_path().exists()
    code, _, err = run(["--resume", " ", "--target", str(target_dir), "--draft", str(target_dir)], capsys)
    assert code == 2 and err == (
        "fsd-chat: error: --resume needs a session id or a prefix of one (fsd-chat history lists them)\n"
    )


def test_config_fills_in_and_flags_override(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_dir().mkdir(parents=True)
    (config_dir() / "config.toml").write_text(
        f'target = "{target_dir}"\ndraft = "{tmp_path / "gone"}"\nthreshold = -1.0\n'
    )
    code, _, err = run([], capsys)  # target, draft and threshold all from the config
    assert code == 2 and "config.toml: threshold: threshold must be a finite number ≥ 0" in err
    # config.toml is checked whole when it is read: a flag does not hide a bad setting.
    code, _, err = run(["--threshold", "0.2"], capsys)
    assert code == 2 and "config.toml: threshold: " in err
    (config_dir() / "config.toml").write_text(f'target = "{target_dir}"\ndraft = "{tmp_path / "gone"}"\n')
    code, _, err = run(["--threshold", "0.2"], capsys)  # the draft is the config's
    assert code == 2 and err == f"fsd-chat: error: model path not found: {tmp_path / 'gone'}\n"
    (config_dir() / "config.toml").write_text('[keymap]\nstopp = "x"\n')
    code, _, err = run(["--target", str(target_dir), "--draft", str(target_dir)], capsys)
    assert code == 2 and "unknown binding id(s) stopp" in err
    for keys in ("ctrl+shift+alt+banana", "", "f5,"):
        (config_dir() / "config.toml").write_text(f'[keymap]\nhelp = "{keys}"\n')
        code, _, err = run(["--target", str(target_dir), "--draft", str(target_dir)], capsys)
        assert code == 2 and err.count("\n") == 1 and "[keymap]: help = " in err and "unknown key" in err
    (config_dir() / "config.toml").write_text("colour = 1\n")
    code, _, err = run(["history"], capsys)  # other commands do not read config.toml
    assert code == 0


COMMANDS: list[str] = list(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS)], ids=["fsd-chat", *COMMANDS])
def test_short_help_on_every_command(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([*command, "-h"], capsys)
    assert (code, err) == (0, "") and f"Usage: fsd-chat {' '.join(command)}".rstrip() in out
    assert run([*command, "--help"], capsys) == (0, out, "")


@pytest.mark.parametrize(
    ("setting", "flag", "message"),
    [
        (
            'dtype = "float64"',
            ["--dtype", "float64"],
            "unknown dtype 'float64'; use auto, float32, bfloat16, float16",
        ),
        ('rule = "lossy"', ["--rule", "lossy"], "unknown rule 'lossy'; use exact, fuzzy, pure, mixture"),
        ("max_new_tokens = 0", ["--max-new-tokens", "0"], "--max-new-tokens must be in 1..10,000,000, got 0"),
    ],
)
def test_a_bad_config_value_fails_like_the_flag(
    target_dir: Path, setting: str, flag: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pair = ["--target", str(target_dir), "--draft", str(target_dir)]
    code, _, err = run([*pair, *flag], capsys)
    assert code == 2 and err == f"fsd-chat: error: {message}\n"
    config_dir().mkdir(parents=True)
    (config_dir() / "config.toml").write_text(setting + "\n")
    code, _, err = run(pair, capsys)  # before the screen opens: run() would not return otherwise
    key = setting.split(" = ")[0]
    assert code == 2 and err == f"fsd-chat: error: {config_dir() / 'config.toml'}: {key}: {message}\n"
