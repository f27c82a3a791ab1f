"""Text crossing fsd-chat's boundary: UTF-8 checks on what comes in, terminal-safe and JSON-safe
forms of what goes out.

Python decodes command-line arguments and file names with `surrogateescape`: a byte that is not
UTF-8 becomes a lone surrogate (0xff -> U+DCFF), which tokenizers and SQLite cannot encode. Such
text is refused with one line naming the byte, wherever it enters.

Model output, file names and error messages are data: on a terminal their control characters
(escape sequences could clear the screen or set the window title) are shown as visible symbols.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path

from fsd_chat.support.errors import FsdChatError

# C0 controls except tab and newline, DEL, and the C1 controls (U+0080–U+009F, 8-bit CSI among them).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_JSON_UNESCAPED_CONTROL = re.compile("[\x7f-\x9f]")


class TextError(FsdChatError):
    """Text that fsd-chat cannot take: not UTF-8, or empty where something is needed."""


def _bad_byte(char: str) -> str:
    code = ord(char)
    return f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"


def require_utf8(text: str, what: str) -> str:
    """Return `text` if it encodes as UTF-8.

    Args:
        text: The text, as Python decoded it (undecodable bytes are lone surrogates).
        what: What the text is, for the message ("the prompt").

    Raises:
        TextError: the text holds bytes that were not valid UTF-8 (one line naming the first).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TextError(
            f"{what} is not valid UTF-8 ({_bad_byte(text[exc.start])} at character {exc.start + 1})"
        ) from None
    return text


def decode_utf8(data: bytes, what: str) -> str:
    """Decode UTF-8 bytes strictly.

    Raises:
        TextError: invalid UTF-8, with the line number and the offending byte.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TextError(f"{what}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x})") from None


def read_utf8(path: Path) -> str:
    """A text file's content.

    Raises:
        TextError: the file is not valid UTF-8 (path, line and byte in the message).
        OSError: the file cannot be read.
    """
    return decode_utf8(path.read_bytes(), str(path))


def read_settings_file(path: Path) -> dict[str, object]:
    """A TOML file of settings (config.toml, a theme), parsed.

    The file is opened without blocking and must be a regular file: a named pipe would hang the
    chat before its screen opens, a device would never end.

    Raises:
        FileNotFoundError: there is no such file.
        OSError: it cannot be read, or is not a regular file (strerror says so).
        UnicodeDecodeError: it is not UTF-8.
        tomllib.TOMLDecodeError: it is not TOML.
        RecursionError: it nests arrays or tables deeper than the parser recurses.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        data = file.read()
    return tomllib.loads(data.decode("utf-8"))


def visible(text: str) -> str:
    """`text` with control characters other than newline and tab replaced by visible symbols
    (ESC -> ␛, CR -> ␍, DEL -> ␡, C1 controls -> �), safe to write to a terminal."""

    def symbol(match: re.Match[str]) -> str:
        code = ord(match.group())
        if code < 0x20:
            return chr(0x2400 + code)  # the Unicode "control pictures" block
        return "\u2421" if code == 0x7F else "\ufffd"

    return _CONTROL.sub(symbol, text)


def some(items: list[str], shown: int = 3) -> str:
    """The first `shown` of `items` and how many more, for messages that quote a list of the user's
    (100,000 unknown settings, 10,000 matching sessions) in one line of sane length."""
    more = f", … {len(items) - shown:,} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def renamed_note(value: str, renamed: Mapping[str, str]) -> str:
    """ " (now called 'new')" when `value` is a former name in `renamed` (former -> current name), else
    "": what a refusal of a retired spelling adds, so that the user's one line names its successor."""
    return f" (now called {renamed[value]!r})" if value in renamed else ""


def one_line(text: str) -> str:
    """`text` as one visible line (for error messages, which quote paths and library errors)."""
    return " ".join(visible(text).split("\n")).replace("\t", " ")


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_json(value: object, *, indent: int | None = None) -> str:
    """Strict JSON: infinities and NaN (a divergence can be infinite) become null, since JSON has
    no such numbers; DEL and C1 controls are escaped like the C0 ones, so the text is kept
    exactly and still cannot drive a terminal."""
    dumped = json.dumps(_finite(value), ensure_ascii=False, allow_nan=False, indent=indent)
    return _JSON_UNESCAPED_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", dumped)


def counted(count: int, noun: str) -> str:
    """`count` and the noun in the number it takes: "1 token", "0 tokens", "2,048 tokens"."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"
