"""The `fsd-chat` command: chat (default), generate, bench, history, export.

Heavy modules (torch, transformers, Textual) are imported inside the commands so that `--help`
stays fast. Every `FsdChatError` and usage error ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, NoReturn

import typer
from typer.exceptions import Abort, TyperException

from fsd_chat import cli_options as o
from fsd_chat.errors import FsdChatError
from fsd_chat.text import one_line, require_utf8

app = typer.Typer(
    name="fsd-chat",
    help="Chat with local language models through Fuzzy Speculative Decoding.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_BAD_INPUT = 2
EXIT_OUTPUT_ERROR = 1


@app.callback()
def root() -> None:
    """Chat with local language models through Fuzzy Speculative Decoding.

    Without a command, `chat` runs: fsd-chat --target MODEL --draft MODEL.
    """


def quiet_libraries() -> None:
    """Silence transformers' progress bars and the advisory logs of transformers and bitsandbytes
    (bitsandbytes' 8-bit matmul logs a warning on every call on the CPU)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


@app.command()
def generate(
    prompt: Annotated[
        str, typer.Argument(help="The prompt (a user turn for chat models); - reads it from standard input.")
    ],
    target: o.TargetOpt,
    draft: o.DraftOpt,
    threshold: o.ThresholdOpt = o.DEFAULT_THRESHOLD,
    divergence: o.DivergenceOpt = o.DEFAULT_DIVERGENCE,
    rule: o.RuleOpt = o.DEFAULT_RULE,
    draft_tokens: o.DraftTokensOpt = o.DEFAULT_K,
    adaptive_k: o.AdaptiveOpt = False,
    compile_draft: o.CompileOpt = False,
    temperature: o.TemperatureOpt = 0.0,
    top_p: o.TopPOpt = 1.0,
    top_k: o.TopKOpt = 0,
    seed: o.SeedOpt = None,
    max_new_tokens: o.MaxNewTokensOpt = 256,
    quantize_target: o.QuantizeTargetOpt = "none",
    quantize_draft: o.QuantizeDraftOpt = "none",
    device: o.DeviceOpt = "auto",
    dtype: o.DtypeOpt = "auto",
    trust_remote_code: o.TrustRemoteCodeOpt = False,
    threads: o.ThreadsOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="Plain text prompt, no chat template.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON Lines: one object per step, then a summary.")
    ] = False,
    autoregressive: Annotated[
        bool, typer.Option("--autoregressive", help="Target-only decoding (the baseline).")
    ] = False,
) -> None:
    """Stream one reply to PROMPT, coloured by token origin on a terminal."""
    from fsd_chat.generate import prompt_text, run_generate

    o.check_max_new_tokens(max_new_tokens)
    settings = o.decoding_settings(rule, divergence, threshold, draft_tokens, adaptive_k)
    sampling = o.sampling_config(temperature, top_k, top_p, seed)
    specs = o.pair_specs(target, draft, quantize_target, quantize_draft, device, dtype, trust_remote_code)
    text = prompt_text(prompt, sys.stdin.buffer)
    quiet_libraries()
    run_generate(
        text,
        *specs,
        settings=settings,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        raw=raw,
        as_json=as_json,
        autoregressive=autoregressive,
        threads=threads,
        compile_draft=compile_draft,
    )


# Commands defined in their own modules register below this line.
from fsd_chat import chat_cli  # noqa: E402  (registered after `app` exists)

app.command("chat")(chat_cli.chat)
app.command("history")(chat_cli.history)
app.command("export")(chat_cli.export)

from fsd_chat.bench import command as bench_command  # noqa: E402

app.command("bench")(bench_command.bench)


def main(argv: list[str] | None = None) -> None:
    """Entry point: `fsd-chat [COMMAND] ...`; without a command, `chat` is meant."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)
    commands = set(command.commands)  # type: ignore[attr-defined]
    try:
        # Prompts, system prompts, session ids, theme names: every argument is text, refused here
        # with one line rather than by a tokenizer or SQLite halfway through.
        for position, arg in enumerate(args, 1):
            require_utf8(arg, f"command-line argument {position}")
        if "chat" in commands and (not args or (args[0] not in commands and args[0] not in ("--help", "-h"))):
            args.insert(0, "chat")
        status = command.main(args, prog_name="fsd-chat", standalone_mode=False)
        # Flushed here, not at interpreter exit, so that a full disk is reported like any other error.
        sys.stdout.flush()
    except FsdChatError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except Abort:
        _fail("aborted", 130, prefix="fsd-chat: ")
    except TyperException as exc:  # usage errors: bad option values, missing arguments
        _fail(exc.format_message() if hasattr(exc, "format_message") else str(exc), EXIT_BAD_INPUT)
    except BrokenPipeError:
        _discard_stdout()
        return
    except OSError as exc:  # writing the output failed: a full disk, a closed terminal
        where = f"{exc.filename}: " if exc.filename else "writing the output: "
        _fail(f"{where}{exc.strerror or exc}", EXIT_OUTPUT_ERROR)
    if isinstance(status, int) and status:
        raise SystemExit(status)


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
