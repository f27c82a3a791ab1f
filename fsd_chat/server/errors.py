"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`: every refusal
the server makes, pydantic's validation errors (400, not FastAPI's default 422), unknown routes,
and a catch-all that logs an unexpected error's traceback to the error log and answers one line."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fsd_chat.support.log import log_exception
from fsd_chat.support.text import one_line


class APIError(Exception):
    """A refusal in OpenAI's error shape.

    Attributes:
        status: The HTTP status (400, 401, 403, 404, 413, 415, 429, 500, 503).
        message: One line for the client.
        type: OpenAI's error type, e.g. "invalid_request_error".
        param: The request field at fault, or None.
        code: A short machine-readable code, or None.
        headers: Response headers besides the JSON's (429's Retry-After).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = one_line(message)
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The HTTP response."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})


def _field(loc: tuple[Any, ...]) -> str:
    # ("body", "fsd", "threshold") -> "fsd.threshold"; list indices as [i].
    parts = [p for p in loc if p != "body"]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (application/json, or any application/...+json)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


NOT_JSON = APIError(
    415,
    "the request body is read as JSON only when it is sent with the header Content-Type: application/json "
    "(curl: -H 'Content-Type: application/json')",
    code="unsupported_media_type",
)
"""A body sent without a JSON Content-Type (`curl -d` sends a form's). It is not read as JSON even
so: a web page may post such a body across origins without asking first (CSRF)."""


FASTAPI_UNREADABLE = "There was an error parsing the body"
"""FastAPI's 400 for a body that its JSON parser gave up on with something other than a syntax error."""

UNREADABLE = (
    "the request body is not JSON that can be read: not UTF-8, nested too deeply, or holding a number too "
    "long to read"
)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first of pydantic's errors as a 400, naming its field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "the request body is not valid")
    first = errors[0]
    param = _field(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {message}")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'body'}: {message}{more}", param=param or None)


def install(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's shape."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        if not is_json(request.headers.get("content-type")):
            return NOT_JSON.response()
        return validation_error(exc).response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = UNREADABLE if exc.detail == FASTAPI_UNREADABLE else str(exc.detail)
        return APIError(exc.status_code, message, type=kind).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(CatchAll)


class CatchAll:
    """ASGI middleware: an unexpected error is logged with its traceback to the error log and
    answered with a one-line 500 (when the response has not started; a stream already under way is
    simply closed). Starlette's own last handler would re-raise it for uvicorn to print."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            log_exception(exc, f"serving {scope.get('method')} {scope.get('path')}")
            if not started:
                error = APIError(
                    500,
                    # Not the log's path: a client need not learn the server's folders.
                    f"internal error: {type(exc).__name__} (details in the server's error log)",
                    type="server_error",
                )
                await error.response()(scope, receive, send)
