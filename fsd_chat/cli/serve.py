"""The `fsd-chat serve` command: an OpenAI-compatible server over one model pair, with the dial per
request (`fsd_chat.server`, imported when the command runs, since it loads torch and FastAPI).

Its model, decoding and sampling options are the chat's (the same declarations and checks), and
config.toml fills in those not given, as for the chat.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer

from fsd_chat.cli import options as o
from fsd_chat.cli.chat import CONFIG_OPTIONS, with_config
from fsd_chat.cli.option import Option, config_values, takes
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.support.config import ConfigError, load_config
from fsd_chat.support.errors import SettingsError
from fsd_chat.support.log import quiet_libraries
from fsd_chat.support.text import one_line

SERVER = "Server"
MAX_QUEUE = 10_000
"""Most requests `--queue-size` lets wait: far beyond what one decoder clears in a client's patience."""

KEY_VARIABLE = "FSD_CHAT_API_KEY"
"""The environment variable that gives the key when neither --api-key nor --api-key-file does: a
key on the command line is visible to every user of the machine (`ps`)."""

MAX_KEY_FILE = 4096
"""Most bytes read from --api-key-file (a key, not a document)."""


def _check_port(port: int) -> int:
    if not 0 <= port <= 65535:
        raise SettingsError(f"--port must be in 0..65535 (0: any free port), got {port}")
    return port


def _check_queue(size: int) -> int:
    if not 1 <= size <= MAX_QUEUE:
        raise SettingsError(f"--queue-size must be in 1..{MAX_QUEUE:,}, got {size}")
    return size


def _check_key(key: str) -> str:
    if not key.strip():
        raise SettingsError("--api-key is empty: give a key, or leave the option out")
    return key


HOST = Option(
    "host",
    ("--host",),
    str,
    "127.0.0.1",
    "Address to listen on (0.0.0.0: every interface; then set --api-key).",
    SERVER,
)
PORT = Option("port", ("--port",), int, 8000, "Port to listen on (0: any free port).", SERVER, _check_port)
API_KEY = Option(
    "api_key",
    ("--api-key",),
    str,
    None,
    "Key every request must send (Authorization: Bearer KEY); compared in constant time.",
    SERVER,
    _check_key,
)
API_KEY_FILE = Option(
    "api_key_file",
    ("--api-key-file",),
    str,
    None,
    f"File holding the key (its first line); or set {KEY_VARIABLE}. Both keep it out of `ps`.",
    SERVER,
)
QUEUE_SIZE = Option(
    "queue_size",
    ("--queue-size",),
    int,
    16,
    "Requests that may wait while one reply decodes; beyond them a request gets 429.",
    SERVER,
    _check_queue,
)
SERVE_OPTIONS: tuple[Option[Any], ...] = (o.TARGET, o.DRAFT, *o.REPLY_OPTIONS)
"""The chat's options that serve takes too, which config.toml may set for both."""


def api_key(given: str | None, file: str | None) -> str | None:
    """The key requests must send: --api-key, else the first line of --api-key-file, else
    $FSD_CHAT_API_KEY (None: no key).

    Raises:
        SettingsError: both flags are given, the file cannot be read, or its key is empty.
    """
    if given is not None and file is not None:
        raise SettingsError("give --api-key or --api-key-file, not both")
    if file is not None:
        try:
            with Path(file).open("rb") as handle:
                text = handle.read(MAX_KEY_FILE).decode()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SettingsError(f"--api-key-file: cannot read {file}: {reason}") from None
        key = text.splitlines()[0].strip() if text.strip() else ""
        if not key:
            raise SettingsError(f"--api-key-file: {file} holds no key")
        return key
    if given is not None:
        return given
    if (variable := os.environ.get(KEY_VARIABLE)) is not None:
        if not variable.strip():
            raise SettingsError(f"{KEY_VARIABLE} is set but empty: give a key, or unset it")
        return variable.strip()
    return None


@takes(*SERVE_OPTIONS, HOST, PORT, API_KEY, API_KEY_FILE, QUEUE_SIZE)
def serve(ctx: typer.Context, **values: Any) -> None:
    """Serve the models through an OpenAI-compatible API (/v1/chat/completions, /v1/completions),
    with the threshold dial per request."""
    config = config_values(load_config(), CONFIG_OPTIONS)
    taken = {option.name for option in SERVE_OPTIONS}
    v = with_config(ctx, values, {name: value for name, value in config.items() if name in taken})
    target = o.TARGET.get(v)
    if not target:
        raise ConfigError("no target model: pass --target (and --draft, or prompt lookup drafts)")
    settings = o.decoding_settings(v)
    sampling = o.sampling_request(v)
    specs = o.model_specs(target, o.DRAFT.get(v) or LOOKUP, v)
    host = HOST.of(v)
    key = api_key(API_KEY.get(v), API_KEY_FILE.get(v))

    from fsd_chat.server.app import ServeOptions
    from fsd_chat.server.run import is_loopback, run_server

    if not is_loopback(host) and key is None:
        print(
            f"fsd-chat: warning: listening on {one_line(host)} without --api-key: anyone who reaches it may use it",
            file=sys.stderr,
        )
    quiet_libraries()
    run_server(
        *specs,
        ServeOptions(
            model_id=specs[0].name,
            aliases=frozenset({target, Path(target).name}),
            settings=settings,
            sampling=sampling,
            max_new_tokens=o.MAX_NEW_TOKENS.of(v),
            threshold_given=o.THRESHOLD.get(v) is not None,
            raw=o.RAW.of(v),
            api_key=key,
            host=host,
        ),
        host=host,
        port=PORT.of(v),
        queue_size=QUEUE_SIZE.of(v),
        threads=o.THREADS.get(v),
        threads_batch=o.THREADS_BATCH.get(v),
        autoregressive=o.AUTOREGRESSIVE.of(v),
        compiled=o.COMPILE.of(v),
        whole_step=o.WHOLE_STEP.of(v),
        announce=lambda line: print(
            f"fsd-chat: {one_line(line)} (Ctrl+C stops it)", file=sys.stderr, flush=True
        ),
    )
