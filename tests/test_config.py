"""config.toml and the XDG folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from fsd_chat.cli import app, main
from fsd_chat.cli.chat import CONFIG_OPTIONS, with_config
from fsd_chat.cli.option import config_values
from fsd_chat.support.config import ConfigError, config_dir, data_dir, load_config, sessions_path
from fsd_chat.tui.keys import check_keymap, key_rows


def test_env_overrides_the_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "d"))
    assert config_dir() == tmp_path / "c"
    assert data_dir() == tmp_path / "d"
    assert sessions_path() == tmp_path / "d" / "sessions.sqlite3"


def test_missing_file_is_an_empty_config(tmp_path: Path) -> None:
    config = load_config(tmp_path / "config.toml")
    assert config.options == {} and config.keymap == {}


def test_options_and_keymap(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('target = "/m/t"\nthreshold = 0.2\ndraft_tokens = 6\n[keymap]\nstop = "ctrl+x"\n')
    config = load_config(path)
    assert config.options == {"target": "/m/t", "threshold": 0.2, "draft_tokens": 6}
    assert config.keymap == {"stop": "ctrl+x"}
    check_keymap(config.keymap)
    assert ("ctrl+x", "stop", "Stop the reply (the partial reply is kept)") in key_rows(config.keymap)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("threshold = ", "invalid TOML"),
        (
            "thresold = 0.1",
            "unknown setting\\(s\\) thresold \\(did you mean thresold → threshold\\?\\); known: autoregressive, compile",
        ),
        (
            "tempreature = 0.7",
            "unknown setting\\(s\\) tempreature \\(did you mean tempreature → temperature\\?\\)",
        ),
        ("resume = 'abcd'", "unknown setting\\(s\\) resume"),  # per run, not a default
        ('threshold = "high"', "threshold = 'high' has the wrong type"),
        ("draft_tokens = true", "draft_tokens = True has the wrong type"),
        ("raw = 1", "raw = 1 has the wrong type"),
        (
            'dtype = "float64"',
            "config.toml: dtype: unknown dtype 'float64'; use auto, float32, bfloat16, float16",
        ),
        (
            'divergence = "hellinger"',
            "config.toml: divergence: unknown divergence 'hellinger'; use kl, reverse-kl, js, tv",
        ),
        ('device = "mps"', "config.toml: device: unsupported device 'mps'"),
        (
            "max_new_tokens = 0",
            "config.toml: max_new_tokens: --max-new-tokens must be in 1..10,000,000, got 0",
        ),
        ("[keymap]\nstop = 3", "\\[keymap\\] maps binding ids to key strings"),
        ("compile_draft = true", "the setting compile_draft is now called compile"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        config_values(load_config(path), CONFIG_OPTIONS)


BAD_DECODING_VALUES = [
    ("threshold = -0.5", "threshold must be a finite number ≥ 0"),
    ("threshold = inf", "threshold must be a finite number ≥ 0"),
    ("draft_tokens = 0", "draft length k must be in 1..32, got 0"),
    ("draft_tokens = 33", "draft length k must be in 1..32, got 33"),
    ("temperature = -1", "temperature must be 0 (greedy) or a finite number"),
    ("top_p = 1.5", "top-p must be in"),
    ("top_p = 0", "top-p must be in"),
    ("top_k = -1", "top-k must be ≥ 0"),
    ("min_p = 2", "min-p must be in [0, 1]"),
    ("seed = -1", "seed must be in 0..2^64 − 1"),
    ("threads = 0", "--threads must be ≥ 1, got 0"),
]
"""config.toml decoding values out of range, and what the settings' own check says of each."""


@pytest.mark.parametrize("command", ["chat", "serve"])
@pytest.mark.parametrize(("line", "message"), BAD_DECODING_VALUES)
def test_bad_decoding_value_names_the_file_and_key(
    command: str,
    line: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The real command, reading a real config.toml in a temporary XDG config folder: refused in
    # one line (exit 2) before any model loads or the chat opens, naming the file and the key.
    monkeypatch.delenv("FSD_CHAT_CONFIG_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "data"))
    path = tmp_path / "fsd-chat" / "config.toml"
    path.parent.mkdir()
    path.write_text(f'target = "nowhere"\n{line}\n')
    with pytest.raises(SystemExit) as exit_info:
        main([command])
    out, err = capsys.readouterr()
    key = line.split(" = ")[0]
    assert exit_info.value.code == 2 and out == ""
    assert err.startswith(f"fsd-chat: error: {path}: {key}: "), err
    assert message in err and err.count("\n") == 1, err


def test_config_values_are_converted_like_flags(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('threshold = 1\ntemperature = 0\nraw = true\nseed = 7\ntranscripts_dir = "~/t"\n')
    values = config_values(load_config(path), CONFIG_OPTIONS)
    assert values == {"threshold": 1.0, "temperature": 0.0, "raw": True, "seed": 7, "transcripts_dir": "~/t"}
    assert isinstance(values["threshold"], float)


def chat_values(args: list[str], config: str, tmp_path: Path) -> dict[str, object]:
    """The chat's settings from `args` (parsed by the real command) and config.toml's `config`."""
    path = tmp_path / "config.toml"
    path.write_text(config)
    command = typer.main.get_command(app).commands["chat"]  # type: ignore[attr-defined]
    ctx = command.make_context("chat", args)
    return with_config(ctx, ctx.params, config_values(load_config(path), CONFIG_OPTIONS))


def test_a_flag_turns_a_config_default_off_for_one_run(tmp_path: Path) -> None:
    config = (
        'raw = true\nautoregressive = true\ntrust_remote_code = true\ncompile = true\ndtype = "float16"\n'
    )
    switches = ("raw", "autoregressive", "trust_remote_code", "compile")
    values = chat_values([], config, tmp_path)
    assert [values[name] for name in switches] == [True] * 4 and values["dtype"] == "float16"
    off = ["--no-raw", "--no-autoregressive", "--no-trust-remote-code", "--no-compile", "--dtype", "auto"]
    values = chat_values(off, config, tmp_path)
    assert [values[name] for name in switches] == [False] * 4 and values["dtype"] == "auto"
    assert chat_values(["--raw"], "raw = false\n", tmp_path)["raw"] is True


def test_config_keys_are_the_chat_options() -> None:
    command = typer.main.get_command(app).commands["chat"]  # type: ignore[attr-defined]
    flags = {param.name for param in command.params}
    assert {option.name for option in CONFIG_OPTIONS} == flags - {"resume", "debug"}


def test_unknown_binding_id_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown binding id\\(s\\) stopp; known: quit, send"):
        check_keymap({"stopp": "ctrl+x"})
