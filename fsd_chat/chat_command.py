"""The `chat`, `history` and `export` commands.

Only light modules are imported here; Textual, torch and transformers load inside `chat`.
Settings come from the command line, else config.toml, else the built-in defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fsd_chat import cli_options as o
from fsd_chat.config import ConfigError, check_chat_options, load_config, sessions_path, user_themes_dir
from fsd_chat.errors import ModelLoadError
from fsd_chat.log import quiet_libraries
from fsd_chat.store import SessionStore
from fsd_chat.text import one_line
from fsd_chat.transcript import export_transcript, render_markdown

CHAT = "Chat"

SystemOpt = Annotated[
    str | None, typer.Option("--system", help="System prompt (first turn).", rich_help_panel=CHAT)
]
ThemeOpt = Annotated[
    str | None,
    typer.Option("--theme", help="fsd-dark, fsd-light, fsd-okabe-ito or a user theme.", rich_help_panel=CHAT),
]
TranscriptsDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--transcripts-dir",
        help="Folder the export dialog suggests (default: the current directory).",
        rich_help_panel=CHAT,
    ),
]
ResumeOpt = Annotated[
    str | None,
    typer.Option("--resume", help="Continue a saved session (its id or a prefix).", rich_help_panel=CHAT),
]
RawOpt = Annotated[
    bool, typer.Option("--raw", help="Plain-text turns, no chat template.", rich_help_panel=CHAT)
]
AutoregressiveOpt = Annotated[
    bool, typer.Option("--autoregressive", help="Target-only decoding (no draft).", rich_help_panel=CHAT)
]
DebugOpt = Annotated[
    bool,
    typer.Option(
        "--debug",
        help="After the chat ends, print the tracebacks of unexpected errors (always logged to "
        "fsd-chat.log in the data folder).",
        rich_help_panel=CHAT,
    ),
]
OptionalTargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        help="Target model: a Hugging Face Hub id or a local directory (default: from config.toml, or "
        "the resumed session's).",
        rich_help_panel=o.MODELS,
    ),
]
OptionalDraftOpt = Annotated[
    str | None,
    typer.Option("--draft", help="Draft model sharing the target's tokenizer.", rich_help_panel=o.MODELS),
]


def _with_config(ctx: typer.Context, values: dict[str, Any], config: dict[str, object]) -> dict[str, Any]:
    """Option values with config.toml filling in every option not given on the command line."""
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


def chat(
    ctx: typer.Context,
    target: OptionalTargetOpt = None,
    draft: OptionalDraftOpt = None,
    threshold: o.ThresholdOpt = o.DEFAULT_THRESHOLD,
    divergence: o.DivergenceOpt = o.DEFAULT_DIVERGENCE,
    rule: o.RuleOpt = o.DEFAULT_RULE,
    draft_tokens: o.DraftTokensOpt = o.DEFAULT_K,
    draft_policy: o.DraftPolicyOpt = o.DEFAULT_DRAFT_POLICY,
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
    raw: RawOpt = False,
    autoregressive: AutoregressiveOpt = False,
    system: SystemOpt = None,
    theme: ThemeOpt = None,
    transcripts_dir: TranscriptsDirOpt = None,
    resume: ResumeOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Chat in a full-screen terminal UI with a live threshold dial (the default command)."""
    config = load_config()
    v = _with_config(ctx, dict(ctx.params), config.options)
    check_chat_options(v)
    if resume is not None and not resume.strip():
        raise ConfigError("--resume needs a session id or a prefix of one (fsd-chat history lists them)")
    store = SessionStore(sessions_path())
    session = store.load(resume) if resume is not None else None
    target_source = v["target"] or (session.models["target"] if session else None)
    draft_source = v["draft"] or (session.models["draft"] if session else None)
    if not target_source or not draft_source:
        raise ConfigError(
            "no model pair: pass --target and --draft (or set target and draft in "
            f"{config.path}, or --resume a session)"
        )
    settings = o.decoding_settings(
        v["rule"], v["divergence"], float(v["threshold"]), v["draft_tokens"], v["draft_policy"]
    )
    sampling = o.sampling_config(float(v["temperature"]), v["top_k"], float(v["top_p"]), v["seed"])
    for source in (target_source, draft_source):
        _check_local(source)
    specs = o.pair_specs(
        target_source,
        draft_source,
        v["quantize_target"],
        v["quantize_draft"],
        v["device"],
        v["dtype"],
        v["trust_remote_code"],
    )

    from fsd_chat.tui.app import ChatOptions, FsdChatApp
    from fsd_chat.tui.keys import check_keymap

    check_keymap(config.keymap)
    quiet_libraries()
    options = ChatOptions(
        target=specs[0],
        draft=specs[1],
        load=specs[2],
        store=store,
        settings=settings,
        sampling=sampling,
        max_new_tokens=v["max_new_tokens"],
        raw=v["raw"],
        autoregressive=v["autoregressive"],
        system=v["system"] if v["system"] is not None else (session.system if session else None),
        theme=v["theme"],
        transcripts_dir=Path(v["transcripts_dir"] or Path.cwd()).expanduser(),
        resume=session,
        keymap=config.keymap,
        user_themes_dir=user_themes_dir(),
        threads=v["threads"],
        compile_draft=v["compile_draft"],
    )
    app = FsdChatApp(options)
    app.run()
    if debug:
        for text in app.tracebacks:
            sys.stderr.write(text)
    if app.return_code:  # a crash (1) or an ending signal (128 + its number)
        raise SystemExit(app.return_code)


def history() -> None:
    """List the saved chat sessions, most recent first."""
    # Listing reads: it must not create the database on a machine that never chatted.
    summaries = SessionStore(sessions_path()).summaries() if sessions_path().exists() else []
    if not summaries:
        print("no saved sessions yet")
        return
    for s in summaries:
        models = f"{Path(s.target).name} + {Path(s.draft).name}"
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
    if not sessions_path().exists():  # reading must not create the database
        raise ConfigError(f"no saved sessions yet ({sessions_path()} does not exist)")
    markdown = render_markdown(SessionStore(sessions_path()).load(session_id))
    written = export_transcript(markdown, output)
    if written:
        print(written)
