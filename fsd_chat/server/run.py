"""`fsd-chat serve`'s work once its options are checked: bind the address, load the pair, warm it
with one short reply, start the decoding worker and run the app under uvicorn until interrupted.

On SIGTERM or Ctrl+C (`Server.shutdown`) the engine ends every reply at once: streams end with an
error event and `[DONE]`, waiting requests get 503, and uvicorn then has little left to wait for.
A connection whose request head has not arrived within HEADER_SECONDS, or whose body stalls for
BODY_SECONDS, is closed (`read_timeout_protocol`): uvicorn has no such timeouts of its own (its
keep-alive timeout starts only after a response, and any byte received resets it).
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import queue
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from fsd_chat.decoding.controls import Controls
from fsd_chat.engines.torch_engine import step_graph
from fsd_chat.models.chat_template import Message, RenderLimits, prompt_ids
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.server.app import ServeOptions, create_app
from fsd_chat.server.engine import Delivery, Engine, Job
from fsd_chat.support.errors import FsdChatError

log = logging.getLogger(__name__)

GRACEFUL_SECONDS = 1
"""Seconds uvicorn waits, on SIGTERM or Ctrl+C, for the responses in flight: the engine has ended
them all at once (`Engine.shutdown`), so only a client that does not read its stream is waited for."""

HEADER_SECONDS = 10.0
"""Seconds a connection may take to send a request's head (line and headers), from its opening or
from the end of the response before (a slowloris client holds a connection open with a head it
never finishes)."""

BODY_SECONDS = 30.0
"""Seconds a request's body may go without a byte arriving (nginx's `client_body_timeout` is 60 s):
a client that announces a body and sends it slowly, or not at all, holds a connection and a
request handler waiting on it."""

WARM_TOKENS = 8
"""Tokens of the reply decoded at the start, before the server listens (`warm_up`)."""


class _ReadTimeouts(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not whole `head_seconds`
    after the connection opened or the last response ended, or whose body goes `body_seconds`
    without a byte (the request's handler then reads a disconnect)."""

    head_seconds = HEADER_SECONDS
    body_seconds = BODY_SECONDS
    _timer: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        # IDLE: the request line or headers are not all in; SEND_BODY: the body is not (a request
        # answered is past both; between requests uvicorn's keep-alive timeout closes a silent
        # connection first).
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.head_seconds)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Bytes of a head change nothing (a slowloris head comes a byte at a time); each of a body
        # gives it more time, from the end of the head on.
        if self.conn.their_state is h11.SEND_BODY:
            self._arm(self.body_seconds)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm(self.head_seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)


def read_timeout_protocol(head_seconds: float, body_seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a `head_seconds` limit on reading a request's head and a
    `body_seconds` limit on each wait for its body's next bytes."""
    return type(
        "ReadTimeoutProtocol", (_ReadTimeouts,), {"head_seconds": head_seconds, "body_seconds": body_seconds}
    )


class Server(uvicorn.Server):
    """uvicorn's server, ending the engine's replies as soon as it starts to shut down (SIGTERM,
    Ctrl+C): without it the reply decoding goes on through uvicorn's grace period, and its stream
    is then cut with no end."""

    def __init__(self, config: uvicorn.Config, engine: Engine | None) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        await super().shutdown(sockets)


def server(
    app: Any,
    engine: Engine | None,
    header_seconds: float = HEADER_SECONDS,
    body_seconds: float = BODY_SECONDS,
) -> Server:
    """The uvicorn server of `fsd-chat serve` over `app` (None: no engine to end at shutdown)."""
    config = uvicorn.Config(
        app,
        http=read_timeout_protocol(header_seconds, body_seconds),
        log_level="warning",
        access_log=False,  # no request lines: nothing of the conversations is written
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
    )
    return Server(config, engine)


def warm_up(pair: ModelPair, engine: Engine, options: ServeOptions) -> None:
    """Decode two short replies (greedy and sampled, one with the server's defaults) before it listens: the first forward passes
    of a fresh pair are several times slower (allocations, kernels chosen, code compiled), and the
    first client would wait for them. A failure is logged, not raised: requests then say why."""
    try:
        # Rendered as requests are (under `RenderLimits`), so that the template is compiled now.
        hello = [Message("user", "Hello")]
        ids = prompt_ids(
            pair.tokenizer, hello, raw=options.raw, vocab_size=pair.vocab_size, limits=RenderLimits()
        )
        sampling = options.sampling.resolve(pair.generation_config, options.model_id).config
    except FsdChatError as exc:
        log.warning("not warmed up: %s", exc)
        return
    # The server's own sampling, and the other of greedy and sampled: requests may ask for either.
    other = replace(sampling, temperature=0.0) if sampling.temperature else replace(sampling, temperature=1.0)
    for law in (sampling, other):
        deliveries: queue.Queue[Delivery] = queue.Queue()
        engine.submit(Job(ids, options.settings, law, WARM_TOKENS, (), deliveries.put))
        while (item := deliveries.get()) is not None:
            if isinstance(item, BaseException):
                log.warning("not warmed up: %s", item)


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
    threads_batch: int | None = None,
    autoregressive: bool,
    compiled: bool | None,
    announce: Callable[[str], None],
    whole_step: bool | None = None,
) -> None:
    """Serve the pair until interrupted (Ctrl+C, SIGTERM).

    Args:
        target, draft, load: The models and how to load them.
        options: What requests default to and what they may name.
        host, port: Where to listen.
        queue_size: Most requests waiting while one decodes.
        threads: torch CPU threads (None: the thread policy's choice).
        threads_batch: llama.cpp's threads for forwards of several tokens (None: the policy's).
        autoregressive: Target-only decoding (`fsd` objects are then checked, and change nothing).
        compiled: Compile the models' decoding steps (None: on a CUDA device only).
        whole_step: Each step as one captured graph on CUDA, eager on the CPU (`--whole-step`;
            its capture is announced on standard error; None: `ModelPair.whole_step`'s default).
        announce: Gets one line once the server listens.

    Raises:
        ServeError: the address cannot be bound.
        FsdChatError: the models cannot be loaded.
    """
    sock = bind(host, port)  # before the load, which may take minutes: a busy port fails at once
    try:
        pair = load_pair(target, draft, load)
        pair.use_threads(threads, requested_batch=threads_batch)
        controls = Controls(options.settings)
        decoder = pair.decoder(
            controls,
            autoregressive=autoregressive,
            compiled=compiled,
            whole_step=whole_step,
            capture_progress=step_graph.capture_announcer(sys.stderr.write, compile=compiled),
        )
        engine = Engine(decoder, controls, queue_size)
        try:
            app = create_app(pair, engine, options)
            warm_up(pair, engine, options)
            # The pair, torch and transformers are millions of objects that live until the end:
            # out of the collector's sight, they cost neither pauses between replies nor the
            # seconds of collecting at exit (measured: Ctrl+C took 2.4 s to exit, SIGTERM 0.2 s).
            gc.freeze()
            announce(f"serving {options.model_id} ({pair.describe()}) at {url(sock)}")
            server(app, engine).run(sockets=[sock])
        finally:
            engine.close()
    finally:
        sock.close()
