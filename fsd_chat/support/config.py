"""User settings: `config.toml` in the XDG config dir, and where sessions and user themes live.

Folders come from platformdirs (`~/.config/fsd-chat`, `~/.local/share/fsd-chat`, `~/.cache/fsd-chat`
on Linux); `FSD_CHAT_CONFIG_DIR` / `FSD_CHAT_DATA_DIR` / `FSD_CHAT_CACHE_DIR` override them (tests
point them at temporary folders), and `FSD_CHAT_CALIBRATION_DIR` the cache's folder of llama.cpp's
forward times (tests share one a session, apart from the user's).
The file holds defaults for the `fsd-chat chat` options (named as the options, with underscores;
checked like the flags, see `fsd_chat.cli.options`) and a `[keymap]` table of binding id -> keys::

    target = "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    draft = "HuggingFaceTB/SmolLM2-135M-Instruct"
    threshold = 0.2
    theme = "fsd-okabe-ito"
    [keymap]
    raise-threshold = "ctrl+k"
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import read_settings_file

APP_NAME = "fsd-chat"
ENV_CONFIG_DIR = "FSD_CHAT_CONFIG_DIR"
ENV_DATA_DIR = "FSD_CHAT_DATA_DIR"
ENV_CACHE_DIR = "FSD_CHAT_CACHE_DIR"
ENV_CALIBRATION_DIR = "FSD_CHAT_CALIBRATION_DIR"


class ConfigError(FsdChatError):
    """config.toml cannot be read or holds an unknown or mistyped setting."""


def config_dir() -> Path:
    """The config folder: $FSD_CHAT_CONFIG_DIR, else the platform's user config dir."""
    return Path(os.environ.get(ENV_CONFIG_DIR) or platformdirs.user_config_dir(APP_NAME))


def data_dir() -> Path:
    """The data folder (sessions): $FSD_CHAT_DATA_DIR, else the platform's user data dir."""
    return Path(os.environ.get(ENV_DATA_DIR) or platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    """The cache folder (the default chat model, GGUF files converted for a fast start: anything
    here can be fetched or rebuilt again): $FSD_CHAT_CACHE_DIR, else the platform's user cache dir."""
    return Path(os.environ.get(ENV_CACHE_DIR) or platformdirs.user_cache_dir(APP_NAME))


def calibration_dir() -> Path:
    """Where llama.cpp's forward times measured on this machine are kept
    (`fsd_chat.engines.llama_calibration`): $FSD_CHAT_CALIBRATION_DIR, else `cache_dir()`'s
    `forward-times` folder."""
    return Path(os.environ.get(ENV_CALIBRATION_DIR) or cache_dir() / "forward-times")


def sessions_path() -> Path:
    """The SQLite file holding the saved sessions."""
    return data_dir() / "sessions.sqlite3"


def user_themes_dir() -> Path:
    """Where users put their own `*.toml` themes."""
    return config_dir() / "themes"


@dataclass(frozen=True, slots=True)
class UserConfig:
    """The settings of config.toml.

    Attributes:
        options: Defaults for the chat command's options, by option name, as the file has them.
        keymap: Binding id -> comma-separated keys (Textual's `App.set_keymap` format).
        path: The file they came from (it may not exist).
    """

    options: dict[str, object] = field(default_factory=dict)
    keymap: dict[str, str] = field(default_factory=dict)
    path: Path | None = None


def load_config(path: Path | None = None) -> UserConfig:
    """Read config.toml (default: in `config_dir()`); a missing file is an empty config. The options'
    names and values are checked by the command that reads them (`fsd_chat.cli.options.config_values`).

    Raises:
        ConfigError: invalid TOML, or a malformed [keymap].
    """
    path = path or config_dir() / "config.toml"
    try:
        data = read_settings_file(path)
    except FileNotFoundError:
        return UserConfig(path=path)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML (nested too deeply)") from None
    keymap = data.pop("keymap", {})
    if not isinstance(keymap, dict) or not all(isinstance(v, str) for v in keymap.values()):
        raise ConfigError(f'{path}: [keymap] maps binding ids to key strings, e.g. stop = "escape"')
    return UserConfig(options=data, keymap=keymap, path=path)
