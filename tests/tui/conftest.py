"""TUI test fixtures: config and data folders in tmp_path, so no test touches the user's."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the config and data folders at tmp_path."""
    monkeypatch.setenv("FSD_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path / "data"))
