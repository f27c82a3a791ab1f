"""User settings: `config.toml` in the XDG config dir, and where sessions and user themes live.

Folders come from platformdirs (`~/.config/fsd-chat`, `~/.local/share/fsd-chat` on Linux);
`FSD_CHAT_CONFIG_DIR` / `FSD_CHAT_DATA_DIR` override them (tests point them at temporary folders).
The file holds defaults for the `fsd-chat chat` options (named as the options, with underscores)
and a `[keymap]` table of binding id -> keys::

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

from fsd_chat.cli_options import check_max_new_tokens
from fsd_chat.errors import FsdChatError
from fsd_chat.model_options import check_device_name, check_dtype_name, check_quantization

APP_NAME = "fsd-chat"
ENV_CONFIG_DIR = "FSD_CHAT_CONFIG_DIR"
ENV_DATA_DIR = "FSD_CHAT_DATA_DIR"

OPTION_TYPES: dict[str, type | tuple[type, ...]] = {
    "target": str,
    "draft": str,
    "quantize_target": str,
    "quantize_draft": str,
    "device": str,
    "dtype": str,
    "trust_remote_code": bool,
    "threshold": (int, float),
    "divergence": str,
    "rule": str,
    "draft_tokens": int,
    "draft_policy": str,
    "compile_draft": bool,
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "seed": int,
    "max_new_tokens": int,
    "raw": bool,
    "autoregressive": bool,
    "system": str,
    "theme": str,
    "transcripts_dir": str,
    "threads": int,
}
"""Settings `config.toml` may hold, with their TOML types (the chat command's option names)."""


class ConfigError(FsdChatError):
    """config.toml cannot be read or holds an unknown or mistyped setting."""


def config_dir() -> Path:
    """The config folder: $FSD_CHAT_CONFIG_DIR, else the platform's user config dir."""
    return Path(os.environ.get(ENV_CONFIG_DIR) or platformdirs.user_config_dir(APP_NAME))


def data_dir() -> Path:
    """The data folder (sessions): $FSD_CHAT_DATA_DIR, else the platform's user data dir."""
    return Path(os.environ.get(ENV_DATA_DIR) or platformdirs.user_data_dir(APP_NAME))


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
        options: Defaults for the chat command's options, by option name.
        keymap: Binding id -> comma-separated keys (Textual's `App.set_keymap` format).
        path: The file they came from (it may not exist).
    """

    options: dict[str, object] = field(default_factory=dict)
    keymap: dict[str, str] = field(default_factory=dict)
    path: Path | None = None


def load_config(path: Path | None = None) -> UserConfig:
    """Read config.toml (default: in `config_dir()`); a missing file is an empty config.

    Raises:
        ConfigError: invalid TOML, an unknown setting, or a value of the wrong type.
    """
    path = path or config_dir() / "config.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return UserConfig(path=path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from None
    keymap = data.pop("keymap", {})
    if not isinstance(keymap, dict) or not all(isinstance(v, str) for v in keymap.values()):
        raise ConfigError(f'{path}: [keymap] maps binding ids to key strings, e.g. stop = "escape"')
    unknown = sorted(set(data) - set(OPTION_TYPES))
    if unknown:
        raise ConfigError(
            f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(OPTION_TYPES))}"
        )
    for key, value in data.items():
        expected = OPTION_TYPES[key]
        # bool is an int in Python, but `threshold = true` is surely a mistake.
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ConfigError(f"{path}: {key} = {value!r} has the wrong type")
    return UserConfig(options=data, keymap=keymap, path=path)


def check_chat_options(values: dict[str, object]) -> None:
    """Check the chat's model and length options, from the command line or config.toml, before the
    screen opens (typer checks flags, but config.toml's values arrive unchecked; the decoding and
    sampling settings check themselves when built).

    Raises:
        ModelLoadError: an unknown device, dtype or quantization.
        SettingsError: max_new_tokens out of range.
    """
    check_device_name(str(values["device"]))
    check_dtype_name(str(values["dtype"]))
    check_quantization(str(values["quantize_target"]))
    check_quantization(str(values["quantize_draft"]))
    max_new_tokens = values["max_new_tokens"]
    assert isinstance(max_new_tokens, int)  # typer and load_config both check the type
    check_max_new_tokens(max_new_tokens)
