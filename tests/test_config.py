"""config.toml and the XDG folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsd_chat.config import ConfigError, config_dir, data_dir, load_config, sessions_path
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
        ("thresold = 0.1", "unknown setting\\(s\\) thresold"),
        ('threshold = "high"', "threshold = 'high' has the wrong type"),
        ("draft_tokens = true", "draft_tokens = True has the wrong type"),
        ("[keymap]\nstop = 3", "\\[keymap\\] maps binding ids to key strings"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_unknown_binding_id_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown binding id\\(s\\) stopp; known: quit, send"):
        check_keymap({"stopp": "ctrl+x"})
