"""Logging set-up, a leaf module every command imports: the libraries' own logs are quietened, and
unexpected errors (bugs, not bad input) go to a log file in the data folder with their traceback,
so that the chat can show one line and stay usable while the details are kept; llama.cpp's warnings
and errors are kept there too (`LLAMA_CPP_LOG`)."""

from __future__ import annotations

import logging
import os
import traceback
from datetime import datetime
from pathlib import Path

from fsd_chat.support.config import data_dir

LLAMA_CPP_LOG = "llama.cpp"
"""The logger llama.cpp's own log lines go to (`fsd_chat.engines.llama_cpp` bridges them), named,
like transformers' and bitsandbytes', after the library that writes them."""


def quiet_libraries() -> None:
    """Silence the advisory logs of bitsandbytes (its 8-bit matmul logs a warning on every call on
    the CPU), and keep llama.cpp's log off the terminal; transformers is quietened where the
    transformers engine loads (`quiet_transformers`): a process on llama.cpp never imports it."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # llama.cpp's warnings and errors (a model it cannot load, a context longer than the model was
    # trained on) are worth keeping, never on the terminal, which the chat draws on; its info and
    # debug lines (a line per tensor at load, the timings) are dropped before they are formatted.
    llama_cpp = logging.getLogger(LLAMA_CPP_LOG)
    llama_cpp.setLevel(logging.WARNING)
    llama_cpp.addHandler(_ERROR_LOG)  # once: a handler already there is not added again


def quiet_transformers() -> None:
    """Silence transformers' progress bars and advisory logs (called as the transformers engine
    loads, which imports transformers)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


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
    _append(context, text)
    return text


def _append(context: str, text: str) -> None:
    """Append an entry, `text` under a line with the time and `context`, to the log, created
    private to its owner (like the sessions)."""
    path = log_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as log:
            log.write(f"--- {datetime.now().astimezone().isoformat(timespec='seconds')} {context}\n{text}")
    except OSError:
        pass  # the log is a convenience: failing to write it must not end the chat


class _ErrorLogHandler(logging.Handler):
    """Appends each record to the error log as an entry of its own (opened per record: the records
    kept are warnings and errors, a few a run)."""

    def emit(self, record: logging.LogRecord) -> None:
        _append(f"{record.name} {record.levelname.lower()}", f"{record.getMessage()}\n")


_ERROR_LOG = _ErrorLogHandler()
