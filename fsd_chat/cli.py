"""The `fsd-chat` command: chat (default), generate, bench, history, export.

Heavy modules (torch, transformers, Textual) are imported inside the commands so that `--help`
stays fast. Every `FsdChatError` and usage error ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer.exceptions import Abort, TyperException

from fsd_chat import cli_options as o
from fsd_chat.errors import FsdChatError

app = typer.Typer(
    name="fsd-chat",
    help="Chat with local language models through Fuzzy Speculative Decoding.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_BAD_INPUT = 2


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
    prompt: Annotated[str, typer.Argument(help="The prompt (a user turn for chat models).")],
    target: o.TargetOpt,
    draft: o.DraftOpt,
    threshold: o.ThresholdOpt = o.DEFAULT_THRESHOLD,
    divergence: o.DivergenceOpt = o.DEFAULT_DIVERGENCE,
    rule: o.RuleOpt = o.DEFAULT_RULE,
    draft_tokens: o.DraftTokensOpt = o.DEFAULT_K,
    draft_policy: o.DraftPolicyOpt = o.DEFAULT_DRAFT_POLICY,
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
    raw: Annotated[bool, typer.Option("--raw", help="Plain text prompt, no chat template.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON Lines: one object per step, then a summary.")
    ] = False,
    autoregressive: Annotated[
        bool, typer.Option("--autoregressive", help="Target-only decoding (the baseline).")
    ] = False,
) -> None:
    """Stream one reply to PROMPT, coloured by token origin on a terminal."""
    from fsd_chat.generate import run_generate

    settings = o.decoding_settings(rule, divergence, threshold, draft_tokens, draft_policy)
    sampling = o.sampling_config(temperature, top_k, top_p, seed)
    specs = o.pair_specs(target, draft, quantize_target, quantize_draft, device, dtype, trust_remote_code)
    quiet_libraries()
    run_generate(
        prompt,
        *specs,
        settings=settings,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        raw=raw,
        as_json=as_json,
        autoregressive=autoregressive,
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
    if "chat" in commands and (not args or (args[0] not in commands and args[0] not in ("--help", "-h"))):
        args.insert(0, "chat")
    try:
        status = command.main(args, prog_name="fsd-chat", standalone_mode=False)
    except FsdChatError as exc:
        print(f"fsd-chat: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    except Abort:
        print("fsd-chat: aborted", file=sys.stderr)
        raise SystemExit(130) from None
    except TyperException as exc:  # usage errors: bad option values, missing arguments
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        print(f"fsd-chat: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    except BrokenPipeError:
        sys.stderr.close()
        return
    if isinstance(status, int) and status:
        raise SystemExit(status)
