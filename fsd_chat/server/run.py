"""`fsd-chat serve`'s work once its options are checked: bind the address, load the pair, start the
decoding worker and run the app under uvicorn until interrupted."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

from fsd_chat.decoding.controls import Controls
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.server.app import ServeOptions, create_app
from fsd_chat.server.engine import Engine
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.threads import apply_threads

GRACEFUL_SECONDS = 5
"""Seconds uvicorn waits, on Ctrl+C, for the replies in flight before closing their connections."""


class ServeError(FsdChatError):
    """The server cannot listen where it was asked (a port in use, an unknown host)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` (port 0: a free one, see `getsockname`).

    Raises:
        ServeError: the address cannot be resolved or bound.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url(sock: socket.socket) -> str:
    """The API's base URL on the bound socket, e.g. http://127.0.0.1:8000/v1."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def run_server(
    target: ModelSpec,
    draft: ModelSpec,
    load: LoadOptions,
    options: ServeOptions,
    *,
    host: str,
    port: int,
    queue_size: int,
    threads: int | None,
    autoregressive: bool,
    compiled: bool | None,
    announce: Callable[[str], None],
) -> None:
    """Serve the pair until interrupted (Ctrl+C, SIGTERM).

    Args:
        target, draft, load: The models and how to load them.
        options: What requests default to and what they may name.
        host, port: Where to listen.
        queue_size: Most requests waiting while one decodes.
        threads: torch CPU threads (None: the thread policy's choice).
        autoregressive: Target-only decoding (`fsd` objects are then checked, and change nothing).
        compiled: Compile the models' decoding steps (None: on a CUDA device only).
        announce: Gets one line once the server listens.

    Raises:
        ServeError: the address cannot be bound.
        FsdChatError: the models cannot be loaded.
    """
    import uvicorn

    sock = bind(host, port)  # before the load, which may take minutes: a busy port fails at once
    try:
        pair = load_pair(target, draft, load)
        if pair.device.type == "cpu":
            apply_threads(threads)
        controls = Controls(options.settings)
        decoder = pair.decoder(controls, autoregressive=autoregressive, compiled=compiled)
        engine = Engine(decoder, controls, queue_size)
        try:
            app = create_app(pair, engine, options)
            config = uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,  # no request lines: nothing of the conversations is written
                timeout_graceful_shutdown=GRACEFUL_SECONDS,
            )
            announce(f"serving {options.model_id} ({pair.describe()}) at {url(sock)}")
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            engine.close()
    finally:
        sock.close()
