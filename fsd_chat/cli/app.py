"""The `fsd-chat` command: chat (default), generate, bench, serve, history, export.

Heavy modules (torch, transformers, Textual) are imported inside the commands so that `--help`
stays fast. Every `FsdChatError` and usage error ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import atexit
import difflib
import gc
import os
import sys
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup
from typer.exceptions import Abort, TyperException

from fsd_chat.cli import bench, chat, generate, serve
from fsd_chat.support import start_gc
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.text import one_line, require_utf8


class OutputClosed(Exception):
    """Standard output was closed by its reader (`fsd-chat history | head -1`)."""


class _Group(TyperGroup):
    """fsd-chat's commands. A broken pipe leaves as `OutputClosed`: click would turn it (an
    OSError) into exit code 1 before `main` sees it."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context, not exported
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:
            raise OutputClosed from exc


app = typer.Typer(
    cls=_Group,
    name="fsd-chat",
    help="Chat with local language models through Fuzzy Speculative Decoding.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Inherited by every command's context: -h is --help everywhere.
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXIT_BAD_INPUT = 2
EXIT_OUTPUT_ERROR = 1

# At exit, after every later-registered exit handler: the objects still tracked are frozen, so the
# interpreter's last garbage collections skip them. They walk every object torch and transformers
# made (0.65-0.8 s at the end of each `fsd-chat` process, after its output is out; 0.15-0.25 s so,
# `scripts/bench_llama_memory.py`). What they would find is cyclic garbage, whose memory the system
# takes back with the process, and whose finalizers Python does not promise to run at exit; what
# fsd-chat must write is flushed or committed before (`main` flushes stdout itself).
atexit.register(gc.freeze)


@app.callback()
def root() -> None:
    """Chat with local language models through Fuzzy Speculative Decoding.

    Without a command, `chat` runs: fsd-chat --target MODEL --draft MODEL.
    """


app.command("generate")(generate.generate)
app.command("chat")(chat.chat)
app.command("history")(chat.history)
app.command("export")(chat.export)
app.command("bench")(bench.bench)
app.command("serve")(serve.serve)


def main(argv: list[str] | None = None) -> None:
    """Entry point: `fsd-chat [COMMAND] ...`; without a command, `chat` is meant."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)
    assert isinstance(command, TyperGroup)  # an app of several commands
    commands = set(command.commands)
    try:
        # Prompts, system prompts, session ids, theme names: every argument is text, refused here
        # with one line rather than by a tokenizer or SQLite halfway through.
        for position, arg in enumerate(args, 1):
            require_utf8(arg, f"command-line argument {position}")
        if args and not args[0].startswith("-") and args[0] not in commands:
            # The chat takes no arguments, only options: a first word is a command's name.
            raise FsdChatError(unknown_command(args[0], sorted(commands)))
        if not args or (args[0] not in commands and args[0] not in ("--help", "-h")):
            args.insert(0, "chat")
        with start_gc.paused():  # until the models are loaded (`load_pair`)
            status = command.main(args, prog_name="fsd-chat", standalone_mode=False)
        # Flushed here, not at interpreter exit, so that a full disk is reported like any other error.
        sys.stdout.flush()
    except FsdChatError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except Abort:
        _fail("aborted", 130, prefix="fsd-chat: ")
    except TyperException as exc:  # usage errors: bad option values, missing arguments
        _fail(exc.format_message() if hasattr(exc, "format_message") else str(exc), EXIT_BAD_INPUT)
    except (BrokenPipeError, OutputClosed):
        _discard_stdout()
        return
    except OSError as exc:  # writing the output failed: a full disk, a closed terminal
        where = f"{exc.filename}: " if exc.filename else "writing the output: "
        _fail(f"{where}{exc.strerror or exc}", EXIT_OUTPUT_ERROR)
    if isinstance(status, int) and status:
        raise SystemExit(status)


def unknown_command(name: str, commands: list[str]) -> str:
    """One line for a first argument that names no command: the closest one, and the list."""
    close = difflib.get_close_matches(name, commands, n=1)
    guess = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown command {name!r}{guess}; the commands: {', '.join(commands)} (chat when none is given)"


def _discard_stdout() -> None:
    # Output that cannot be written is dropped, so the interpreter's final flush fails no more
    # (the recipe of Python's signal documentation, "Note on SIGPIPE").
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (tests capture it)
        pass
    finally:
        os.close(devnull)


def _fail(message: str, code: int, prefix: str = "fsd-chat: error: ") -> NoReturn:
    try:
        sys.stdout.flush()  # what was written before the error still goes out
    except OSError:
        _discard_stdout()
    # Messages quote paths, model names and library errors: one visible line, never markup.
    print(prefix + one_line(message), file=sys.stderr)
    raise SystemExit(code) from None
