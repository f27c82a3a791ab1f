"""The checks every request passes before the app reads it (`Guard`, ASGI middleware), in order:

1. the key (`--api-key`): without it, 401, before anything else a request could learn (an unknown
   path, a wrong method, bad JSON); `GET /health` is answered without it, as llama-server does;
2. without a key, the Host header: a name that is not this machine's is refused (403), since a web
   page whose name an attacker re-points at 127.0.0.1 (DNS rebinding) would otherwise reach the
   server from the user's browser; IP addresses, `localhost` and the `--host` name are taken;
3. the body's size against what a prompt that fits the context window could take (`body_limit`):
   413 from the Content-Length header before any of it is read (and, for a chunked body, once it
   passes the limit), so that a 10 MB body costs nothing but its transfer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fsd_chat.server.errors import APIError

BODY_BASE = 1 << 20
"""Bytes a request body may take besides its prompt's share (other fields, the messages' JSON)."""

BODY_BYTES_PER_TOKEN = 32
"""Bytes of JSON a prompt token may take: text runs 3-5 characters a token, and a client's JSON
escapes a non-ASCII character as 6 bytes (`\\u4e2d`), 12 for an emoji; 32 leaves room for tokens of
long runs of spaces or symbols."""

UNKNOWN_CONTEXT = 131_072
"""The context window assumed for the body limit of a model that does not say its own (tokens)."""

DRAIN_BYTES = 64 << 20
"""Most bytes of a refused body read (and dropped) before the 413 is sent: a client that sends its
whole body before it reads the answer (most do) gets the 413, not a reset connection."""

DRAIN_SECONDS = 5.0
"""Most seconds spent reading a refused body."""


def body_limit(context: int | None) -> int:
    """The largest request body taken (bytes), for a model whose context window is `context` tokens
    (None: not known): what a prompt filling the window could take, with room to spare."""
    return BODY_BASE + (context or UNKNOWN_CONTEXT) * BODY_BYTES_PER_TOKEN


def is_local_name(host: str, served: str) -> bool:
    """Whether the Host header `host` names this machine as a browser could not be tricked into:
    an IP address (DNS rebinding needs a name), `localhost` or a name under it (browsers resolve
    those to the loopback themselves), or `served`, the name the server was told to listen on."""
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:8000
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:  # 127.0.0.1:8000, localhost:8000
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if not name or name == "localhost" or name.endswith(".localhost") or name == served.lower():
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """ASGI middleware: the key, the Host header and the body's size (see the module's docstring).

    Args:
        app: The app behind it.
        api_key: The key requests must send as `Authorization: Bearer KEY` (None: none; then the
            Host header is checked instead).
        host: The address the server listens on as given (`--host`).
        max_body: The largest body taken, in bytes (`body_limit`).
        public: Paths answered without the key (`/health`).
    """

    def __init__(
        self, app: ASGIApp, *, api_key: str | None, host: str, max_body: int, public: frozenset[str]
    ) -> None:
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.host = host
        self.max_body = max_body
        self.public = public

    def refusal(self, scope: Scope, headers: Headers) -> APIError | None:
        """Why the request is refused before it is read (None: it is not)."""
        if self.expected is not None:
            if scope["path"] not in self.public:
                scheme, _, given = headers.get("authorization", "").partition(" ")
                # compare_digest: the time taken does not tell how much of a wrong key is right.
                if scheme.lower() != "bearer" or not secrets.compare_digest(
                    given.strip().encode(), self.expected
                ):
                    return APIError(
                        401, "invalid API key: send Authorization: Bearer KEY", code="invalid_api_key"
                    )
        elif not is_local_name(headers.get("host", ""), self.host):
            return APIError(
                403,
                f"the Host header names {headers.get('host', '')!r}, not this machine: a web page may be "
                "trying to reach the server (DNS rebinding). Address it as localhost or by IP "
                "address, or start the server with --api-key",
                type="permission_error",
                code="host_not_allowed",
            )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return self.too_large(f"is {int(length):,} bytes")
        return None

    def too_large(self, size: str) -> APIError:
        return APIError(
            413,
            f"the request body {size}, over this server's limit of {self.max_body:,} bytes "
            "(far more than a prompt that fits the model's context window takes)",
            code="request_too_large",
            headers={"Connection": "close"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if (refused := self.refusal(scope, headers)) is not None:
            # A client that waits for "100 Continue" before it sends its body is answered at once.
            if refused.status == 413 and headers.get("expect", "").lower() != "100-continue":
                await _drain(receive)
            await refused.response()(scope, receive, send)
            return
        received = 0

        async def counting() -> Message:
            # A body sent in chunks has no Content-Length to check beforehand.
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:
                if message.get("more_body", False):
                    await _drain(receive)
                raise HTTPException(413, self.too_large(f"passed {self.max_body:,} bytes").message)
            return message

        await self.app(scope, counting, send)


async def _drain(receive: Receive) -> None:
    """Read and drop a request's body, up to DRAIN_BYTES or DRAIN_SECONDS."""
    deadline = time.monotonic() + DRAIN_SECONDS
    read = 0
    while read <= DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
