"""Logging set-up, a leaf module every command imports: the libraries' own logs are quietened, and
unexpected errors (bugs, not bad input) go to a log file in the data folder with their traceback,
so that the chat can show one line and stay usable while the details are kept."""

from __future__ import annotations

import logging
import os
import traceback
from datetime import datetime
from pathlib import Path

from fsd_chat.support.config import data_dir


def quiet_libraries() -> None:
    """Silence transformers' progress bars and the advisory logs of transformers and bitsandbytes
    (bitsandbytes' 8-bit matmul logs a warning on every call on the CPU)."""
    from transformers.utils import logging as hf_logging  # heavy: imported when a command runs

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def log_path() -> Path:
    """The error log: `fsd-chat.log` in the data folder."""
    return data_dir() / "fsd-chat.log"


def log_exception(error: BaseException, context: str) -> str:
    """Append `error`'s traceback to the log (private to its owner, like the sessions).

    Args:
        error: The exception (with its traceback).
        context: What was being done, e.g. "decoding a reply".

    Returns:
        The traceback as text (for `--debug`).
    """
    text = "".join(traceback.format_exception(error))
    path = log_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as log:
            log.write(f"--- {datetime.now().astimezone().isoformat(timespec='seconds')} {context}\n{text}")
    except OSError:
        pass  # the log is a convenience: failing to write it must not end the chat
    return text
