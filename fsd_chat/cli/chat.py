"""The `chat`, `history` and `export` commands.

Only light modules are imported here; Textual, torch and transformers load inside `chat`, and the
saved sessions' modules inside the commands that read them: every command imports this module, and
`generate`, `serve` and `bench` do not need them (0.8 MB of a `generate`'s peak).
Settings come from the command line, else config.toml, else the built-in defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fsd_chat.cli import options as o
from fsd_chat.cli.option import Option, config_values, takes
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.default_model import HOW_TO_GET
from fsd_chat.support.config import ConfigError, load_config, sessions_path, user_themes_dir
from fsd_chat.support.errors import ModelLoadError
from fsd_chat.support.log import quiet_libraries
from fsd_chat.support.text import one_line

SYSTEM = Option("system", ("--system",), str, None, "System prompt (first turn).", o.CHAT)
THEME = Option(
    "theme",
    ("--theme",),
    str,
    None,
    "fsd-dark, fsd-light, fsd-okabe-ito or a user theme.",
    o.CHAT,
)
TRANSCRIPTS_DIR = Option(
    "transcripts_dir",
    ("--transcripts-dir",),
    str,
    None,
    "Folder the export dialog suggests (default: the current directory).",
    o.CHAT,
)
CONFIG_OPTIONS: tuple[Option[Any], ...] = (
    o.TARGET.replace(help=o.TARGET.help + " Default: config.toml's, or the resumed session's."),
    o.DRAFT,
    *o.REPLY_OPTIONS,
    SYSTEM,
    THEME,
    TRANSCRIPTS_DIR,
)
"""The chat's options that config.toml may set (the other two, --resume and --debug, are per run)."""


def with_config(ctx: typer.Context, values: dict[str, Any], config: dict[str, object]) -> dict[str, Any]:
    """Option values with config.toml's (checked) filling in every option not given on the command
    line."""
    merged = dict(values)
    for name, value in config.items():
        source = ctx.get_parameter_source(name)
        # By name: typer vendors its own click, whose ParameterSource is not click's.
        if source is None or source.name != "COMMANDLINE":
            merged[name] = value
    return merged


def _check_local(source: str) -> None:
    """A path-like model source must exist (checked before the TUI starts)."""
    if source.startswith((".", "/", "~")) and not Path(source).expanduser().exists():
        raise ModelLoadError(f"model path not found: {source}")


@takes(*CONFIG_OPTIONS)
def chat(
    ctx: typer.Context,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume", help="Continue a saved session (its id or a prefix).", rich_help_panel=o.CHAT
        ),
    ] = None,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="After the chat ends, print the tracebacks of unexpected errors (always logged to "
            "fsd-chat.log in the data folder).",
            rich_help_panel=o.CHAT,
        ),
    ] = False,
    **values: Any,
) -> None:
    """Chat in a full-screen terminal UI with a live threshold dial (the default command)."""
    from fsd_chat.conversation.session import final_dial
    from fsd_chat.conversation.store import SessionStore

    config = load_config()
    v = with_config(ctx, values, config_values(config, CONFIG_OPTIONS))
    if resume is not None and not resume.strip():
        raise ConfigError("--resume needs a session id or a prefix of one (fsd-chat history lists them)")
    store = SessionStore(sessions_path())
    session = store.load(resume) if resume is not None else None
    target_source = o.TARGET.get(v) or (session.models.get("target") if session else None)
    # No draft model given: prompt lookup (drafts copied from the conversation).
    draft_source = o.DRAFT.get(v) or (session.models.get("draft") if session else None) or LOOKUP
    if not target_source:
        raise ConfigError(
            f"no target model: pass --target (and --draft, or prompt lookup drafts), set target in {config.path}, "
            f"or --resume a session; {HOW_TO_GET}"
        )
    if session is not None:
        # The dial the session ended with, over config.toml's and the defaults (not over flags).
        v = with_config(ctx, v, final_dial(session.settings))
    settings = o.decoding_settings(v)
    sampling = o.sampling_request(v)
    for source in (target_source, draft_source):
        _check_local(source)
    specs = o.model_specs(target_source, draft_source, v)

    from fsd_chat.conversation.controller import ChatOptions
    from fsd_chat.tui.app import FsdChatApp
    from fsd_chat.tui.keys import check_keymap

    check_keymap(config.keymap)
    quiet_libraries()
    system = SYSTEM.get(v)
    options = ChatOptions(
        target=specs[0],
        draft=specs[1],
        load=specs[2],
        store=store,
        settings=settings,
        threshold_given=o.THRESHOLD.get(v) is not None,
        sampling=sampling,
        max_new_tokens=o.MAX_NEW_TOKENS.of(v),
        raw=o.RAW.of(v),
        autoregressive=o.AUTOREGRESSIVE.of(v),
        system=system if system is not None else (session.system if session else None),
        theme=THEME.get(v),
        transcripts_dir=Path(TRANSCRIPTS_DIR.get(v) or Path.cwd()).expanduser(),
        resume=session,
        keymap=config.keymap,
        user_themes_dir=user_themes_dir(),
        threads=o.THREADS.get(v),
        threads_batch=o.THREADS_BATCH.get(v),
        compiled=o.COMPILE.of(v),
        whole_step=o.WHOLE_STEP.of(v),
    )
    app = FsdChatApp(options)
    app.run()
    if debug:
        for text in app.tracebacks:
            sys.stderr.write(text)
    for note in app.exit_notes:
        print(note, file=sys.stderr)
    if app.return_code:  # a crash or an unsaved session (1), or an ending signal (128 + its number)
        raise SystemExit(app.return_code)


def history() -> None:
    """List the saved chat sessions, most recent first."""
    from fsd_chat.conversation.store import SessionStore

    summaries = SessionStore(sessions_path()).summaries(
        on_damaged=lambda reason: print(f"fsd-chat: warning: {one_line(reason)}", file=sys.stderr)
    )
    if not summaries:
        print("no saved sessions yet")
        return
    for s in summaries:
        models = Path(s.target).name + (" (target only)" if s.draft is None else f" + {Path(s.draft).name}")
        # Titles are the user's text and paths are the user's: shown, never obeyed, by the terminal.
        print(
            one_line(f"{s.id}  {s.updated[:16].replace('T', ' ')}  {s.turns:3d} turns  {models}  {s.title}")
        )


def export(
    session_id: Annotated[str, typer.Argument(metavar="SESSION", help="Session id (or a prefix).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of to stdout (- is stdout).")
    ] = None,
) -> None:
    """Write a saved session as a Markdown transcript."""
    from fsd_chat.conversation.store import SessionStore
    from fsd_chat.conversation.transcript import ending_signals_raise, export_transcript, render_markdown

    markdown = render_markdown(SessionStore(sessions_path()).load(session_id))
    with ending_signals_raise():
        written = export_transcript(markdown, output)
    if written:
        print(written)
