"""The OpenAI-compatible HTTP API over one loaded pair: `GET /v1/models`, `POST /v1/chat/completions`
and `POST /v1/completions`, streamed as server-sent events or not, and `GET /health`.

Each request is checked (the key and the Host header, the body's size, fields, the dial, the
sampling, the prompt against the context window) and answered in OpenAI's error shape when it is
refused, before it joins the `Engine`'s queue. The checks cost in proportion to what could fit the
context window, never to what a client sends: `guard` refuses a body too large for it before it is
read, and a prompt's text is counted in pieces, stopping once it is past the window. Replies
carry `usage`, llama-server's `timings`, and fsd-chat's own figures (`fsd`); with `fsd.origins` (or
`logprobs`), each token's origin, divergence and cost (`fsd_tokens`). Nothing of a conversation is
written anywhere: the server keeps no sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from fsd_chat.decoding.events import GenerationStats, Step, StopReason
from fsd_chat.decoding.settings import DecodingSettings, SamplingConfig, SamplingRequest, default_threshold
from fsd_chat.models.chat_template import Message, RenderLimits, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.server import errors
from fsd_chat.server.engine import Delivery, Engine, Job, QueueFullError, ShuttingDownError, stop_index
from fsd_chat.server.errors import APIError
from fsd_chat.server.guard import Guard, body_limit
from fsd_chat.server.schema import ChatCompletionRequest, CompletionFields, CompletionRequest
from fsd_chat.support.errors import ContextLengthError, FsdChatError, SettingsError
from fsd_chat.support.log import log_exception
from fsd_chat.support.text import require_utf8, to_json

Kind = Literal["chat", "text"]

FINISH_REASONS: dict[StopReason, str] = {
    StopReason.EOS: "stop",
    StopReason.STOP_STRING: "stop",
    StopReason.STOPPED: "stop",
    StopReason.MAX_NEW_TOKENS: "length",
    StopReason.CONTEXT: "length",
}
"""OpenAI's finish_reason of each way a reply ends."""

_WAITING = object()
"""No delivery yet: time to check that the client is still there."""

DISCONNECT_POLL = 0.25
"""Seconds between two checks, while a non-streamed reply decodes, that its client is still there."""

PIECE_CHARS = 16_384
"""Characters of a long prompt tokenised at a time to count its tokens (`create_app`'s `count_past`):
one piece holds the tokenizer for milliseconds, so a huge prompt never holds up another request."""

PIECE_SLACK = 2
"""Tokens by which cutting a text in two may exceed tokenising it whole (a word cut in two), per cut."""


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What `fsd-chat serve` was asked for, besides the pair and its engine.

    Attributes:
        model_id: The served model's name (`GET /v1/models`, and the `model` of every reply; a
            request may name any model, as one is served).
        aliases: Other names `GET /v1/models/{id}` knows it by (the target's source as given).
        settings: The decoding settings of a request that sends no `fsd` object.
        threshold_given: T was given (`--threshold`, config.toml); else a request that names no
            T gets the setup's default, by whether it samples (`default_threshold`), as the chat.
        sampling: The sampling flags; a request's fields override them, the target's
            generation_config fills in the rest.
        max_new_tokens: Cap on a reply's tokens when a request gives none.
        raw: Plain-text prompts even for a model with a chat template (`--raw`).
        api_key: The key a request must send as `Authorization: Bearer KEY` (None: none).
        host: The address the server listens on as given (`--host`): a Host header naming it is
            this machine's (`guard.Guard`).
    """

    model_id: str
    aliases: frozenset[str]
    settings: DecodingSettings
    sampling: SamplingRequest
    max_new_tokens: int
    threshold_given: bool = True
    raw: bool = False
    api_key: str | None = None
    host: str = "127.0.0.1"


class _Reply:
    """One reply's text and figures as its steps arrive. Text that could be the start of a stop
    string is held back until it is known not to be one, so that a stop string is never sent
    (OpenAI's behaviour; the decoder emits the token that completes it)."""

    def __init__(self, stop_strings: tuple[str, ...], origins: bool) -> None:
        self.stop_strings = stop_strings
        self.origins = origins
        self.totals = GenerationStats()
        self.stop_reason: StopReason | None = None
        self.text = ""
        self._pending = ""
        self._hold = max((len(s) for s in stop_strings), default=1) - 1
        self._stopped = False

    def add(self, step: Step) -> tuple[str, list[dict[str, Any]]]:
        """Fold `step` in; returns the text now sure to be sent and its tokens' records (when
        origins are asked for)."""
        self.totals.add(step)
        self.stop_reason = step.stop_reason
        tokens = (
            [
                {
                    "id": t.id,
                    "token": t.text,
                    "origin": str(t.origin),
                    "divergence": t.divergence,
                    "cost": t.cost,
                }
                for t in step.tokens
            ]
            if self.origins
            else []
        )
        if self._stopped:
            return "", tokens
        self._pending += step.text
        cut = stop_index(self._pending, self.stop_strings)
        if cut >= 0:
            ready, self._pending, self._stopped = self._pending[:cut], "", True
        elif step.stop_reason is not None:
            ready, self._pending = self._pending, ""
        else:
            keep = len(self._pending) - self._hold
            ready, self._pending = self._pending[:keep], self._pending[keep:]
        self.text += ready
        return ready, tokens

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason."""
        return FINISH_REASONS.get(self.stop_reason or StopReason.STOPPED, "stop")

    def usage(self, prompt_tokens: int) -> dict[str, int]:
        """OpenAI's `usage`."""
        completion = self.totals.tokens
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def timings(self, prompt_tokens: int, cached_tokens: int) -> dict[str, float | int]:
        """llama-server's `timings` (milliseconds; draft_n counts drafted tokens): as there, prompt_n
        counts the prompt tokens read now and cache_n those kept in the KV cache from the reply
        before (`cached_tokens`), prompt_n + cache_n being the prompt's."""
        t = self.totals
        prompt_ms = t.prefill_seconds * 1000
        prefilled = prompt_tokens - cached_tokens
        return {
            "cache_n": cached_tokens,
            "prompt_n": prefilled,
            "prompt_ms": prompt_ms,
            "prompt_per_second": prefilled / t.prefill_seconds if t.prefill_seconds > 0 else 0.0,
            "predicted_n": t.tokens,
            "predicted_ms": t.decode_seconds * 1000,
            "predicted_per_second": t.tokens_per_second,
            "draft_n": t.drafted,
            "draft_n_accepted": t.accepted_exact + t.accepted_fuzzy,
        }

    def figures(self, settings: DecodingSettings, sampling: SamplingConfig) -> dict[str, Any]:
        """fsd-chat's own figures: the totals of `GenerationStats.to_dict` (acceptance rate, mean
        accepted length τ, cost per token in nats, ...), how the reply ended, and its settings."""
        return {
            **self.totals.to_dict(),
            "stop_reason": None if self.stop_reason is None else str(self.stop_reason),
            "settings": asdict(settings),
            "sampling": asdict(sampling),
        }


@dataclass(slots=True)
class _Prepared:
    """A checked request, ready to queue."""

    prompt_ids: list[int]
    settings: DecodingSettings
    sampling: SamplingConfig
    max_new_tokens: int
    history: Callable[[str], list[int]]
    """What a follow-up request re-sends, given the reply (`Job.history`)."""


def create_app(pair: ModelPair, engine: Engine, options: ServeOptions) -> FastAPI:
    """The FastAPI app serving `pair` through `engine`."""
    app = FastAPI(title="fsd-chat", docs_url=None, redoc_url=None, openapi_url=None)
    context = engine.decoder.context
    # Added before `errors.install`'s catch-all, so that it runs inside it: a bug in it is a 500.
    app.add_middleware(
        Guard,
        api_key=options.api_key,
        host=options.host,
        max_body=body_limit(context),
        public=frozenset({"/health"}),
    )
    errors.install(app)
    created = int(time.time())
    # Prompts are built one at a time: a Rust tokenizer may refuse use from two threads at once.
    tokenizer_lock = threading.Lock()

    def model_card() -> dict[str, Any]:
        return {"id": options.model_id, "object": "model", "created": created, "owned_by": "fsd-chat"}

    def check_model(name: str) -> None:
        """`GET /v1/models/{id}`: the one model served, by its name or an alias."""
        if name != options.model_id and name not in options.aliases:
            raise APIError(
                404,
                f"the model {name!r} is not served here; this server serves {options.model_id!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def conversation(body: CompletionFields) -> tuple[list[Message], bool]:
        """The request's turns, and whether they are joined as plain text (no chat template)."""
        if isinstance(body, ChatCompletionRequest):
            messages = [
                Message("system" if m.role == "developer" else m.role, m.text()) for m in body.messages
            ]
            return messages, options.raw
        assert isinstance(body, CompletionRequest)
        return [Message("user", body.text())], True

    def count_past(texts: list[str], limit: int) -> bool:
        """Whether `texts` hold more than `limit` tokens, tokenised PIECE_CHARS characters at a
        time (cut at a space where one is near) and stopping once past: a 10 MB prompt costs what
        one that fills the context window costs. Each cut may add PIECE_SLACK tokens, so they are
        taken off: a True is sure."""
        counted = cuts = 0
        for text in texts:
            start = 0
            while start < len(text):
                end = min(start + PIECE_CHARS, len(text))
                if end < len(text) and (space := text.rfind(" ", start + PIECE_CHARS // 2, end)) > 0:
                    end = space
                with tokenizer_lock:
                    counted += len(pair.tokenizer.encode(text[start:end], add_special_tokens=False))
                start, cuts = end, cuts + 1
                if counted - PIECE_SLACK * cuts > limit:
                    return True
        return False

    def render(messages: list[Message], raw: bool, generation_prompt: bool = True) -> list[int]:
        with tokenizer_lock:
            return prompt_ids(
                pair.tokenizer,
                messages,
                raw=raw,
                vocab_size=pair.vocab_size,
                limits=RenderLimits(),
                generation_prompt=generation_prompt,
            )

    def history(body: CompletionFields, messages: list[Message], raw: bool) -> Callable[[str], list[int]]:
        """What a follow-up request re-sends, given the reply (`Job.history`): the request's
        `messages` and the reply as an assistant turn, or, for a text completion, the prompt and the
        reply as one text."""
        if isinstance(body, CompletionRequest):
            return lambda reply: render([Message("user", messages[0].content + reply)], raw)
        return lambda reply: render([*messages, Message("assistant", reply)], raw, generation_prompt=False)

    async def prepare(body: CompletionFields, kind: Kind) -> _Prepared:
        given = {} if body.fsd is None else body.fsd.model_dump(exclude_none=True, exclude={"origins"})
        try:
            settings = DecodingSettings(**{**asdict(options.settings), **given})
        except SettingsError as exc:
            raise APIError(400, str(exc), param="fsd") from None
        except TypeError as exc:  # a field of the wrong type reaches the dataclass
            raise APIError(400, f"fsd: {exc}", param="fsd") from None
        asked = {
            "temperature": body.temperature,
            "top_k": body.top_k,
            "top_p": body.top_p,
            "min_p": body.min_p,
            "seed": body.seed,
        }
        given_sampling = {name: value for name, value in asked.items() if value is not None}
        for name, value in given_sampling.items():  # one at a time, to name the field at fault
            try:
                SamplingConfig(**{name: value})  # type: ignore[arg-type]
            except SettingsError as exc:
                raise APIError(400, str(exc), param=name) from None
        request = SamplingRequest(**{**asdict(options.sampling), **given_sampling})
        sampling = request.resolve(pair.generation_config, options.model_id).config
        settings = default_threshold(
            settings, options.threshold_given or "threshold" in given, sampling.greedy
        )
        messages, raw = conversation(body)
        param = "messages" if kind == "chat" else "prompt"
        texts = [m.content for m in messages]
        try:
            if context is not None and sum(map(len, texts)) > PIECE_CHARS:
                for m in messages:  # the tokenizer would raise TypeError on undecodable bytes
                    require_utf8(m.content, f"the {m.role} message")
                # Counted before the whole prompt is built: that holds the tokenizer for all of it.
                if await run_in_threadpool(count_past, texts, context - 1):
                    raise _context_error(f"over {context - 1}", context, param)
            ids = await run_in_threadpool(render, messages, raw)
        except FsdChatError as exc:
            raise APIError(400, str(exc), param=param) from None
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if context is not None and len(ids) + 1 > context:
            raise _context_error(str(len(ids)), context, param)
        cap = body.token_cap() or options.max_new_tokens
        return _Prepared(ids, settings, sampling, cap, history(body, messages, raw))

    def submit(prepared: _Prepared, body: CompletionFields) -> tuple[Job, asyncio.Queue[Delivery]]:
        loop = asyncio.get_running_loop()
        deliveries: asyncio.Queue[Delivery] = asyncio.Queue()

        def deliver(item: Delivery) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
                loop.call_soon_threadsafe(deliveries.put_nowait, item)

        job = Job(
            prepared.prompt_ids,
            prepared.settings,
            prepared.sampling,
            prepared.max_new_tokens,
            body.stop_strings(),
            deliver,
            history=prepared.history,
        )
        try:
            engine.submit(job)
        except QueueFullError as exc:
            raise APIError(
                429,
                f"the server is busy: every place in its queue is taken; retry in {exc.retry_after} s",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(exc.retry_after)},
            ) from None
        except ShuttingDownError as exc:
            raise _decoding_error(exc) from None
        return job, deliveries

    async def complete(request: Request, body: CompletionFields, kind: Kind) -> Response:
        prepared = await prepare(body, kind)
        job, deliveries = submit(prepared, body)
        reply = _Reply(job.stop_strings, body.origins)
        answer = _Answer(kind, options.model_id, reply, prepared, job)
        if body.stream:
            return _EventStream(
                _stream(answer, deliveries, body.include_usage), on_close=lambda: engine.cancel(job)
            )
        tokens: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_POLL
        try:
            while True:
                item: Delivery | object
                try:
                    item = await asyncio.wait_for(deliveries.get(), max(check_at - loop.time(), 0.0))
                except TimeoutError:
                    item = _WAITING
                # Checked on a clock, not only when nothing arrives: steps may come every millisecond.
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # no one reads it: the job is cancelled below
                    check_at = loop.time() + DISCONNECT_POLL
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise _decoding_error(item)
                if isinstance(item, Step):
                    tokens += reply.add(item)[1]
        finally:
            engine.cancel(job)
        return JSONResponse(answer.whole(tokens))

    @app.get("/health")
    def health() -> dict[str, str]:
        """llama-server's and vLLM's probe: 200 while the pair is loaded and requests are taken
        (the server listens only once the pair is loaded and warmed), 503 once it shuts down."""
        if engine.closing:
            raise _decoding_error(ShuttingDownError())
        return {"status": "ok"}

    app.get("/v1/models")(lambda: {"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    def one_model(model: str) -> dict[str, Any]:
        check_model(model)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await complete(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await complete(request, body, "text")

    return app


def _context_error(size: str, context: int, param: str) -> APIError:
    """A prompt of `size` tokens that does not fit a `context`-token window: OpenAI's 400 (its client
    raises BadRequestError)."""
    return APIError(
        400,
        f"the prompt is {size} tokens but the model's context window is {context} tokens: "
        "shorten it to leave room for the reply",
        param=param,
        code="context_length_exceeded",
    )


def _decoding_error(error: BaseException) -> APIError:
    """An error that ended a reply, in OpenAI's shape (an unexpected one is logged first)."""
    if isinstance(error, ShuttingDownError):
        return APIError(503, str(error), type="server_error", code="server_shutting_down")
    if isinstance(error, ContextLengthError):
        return APIError(400, str(error), code="context_length_exceeded")
    if isinstance(error, FsdChatError):
        return APIError(500, str(error), type="server_error")
    log_exception(error, "decoding a reply")
    return APIError(
        500,
        f"internal error: {type(error).__name__} (details in the server's error log)",
        type="server_error",
    )


class _Answer:
    """The response objects of one reply, chat or text completion, whole or in chunks."""

    def __init__(self, kind: Kind, model: str, reply: _Reply, prepared: _Prepared, job: Job) -> None:
        self.kind = kind
        self.model = model
        self.reply = reply
        self.prepared = prepared
        self.job = job
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, chunk: bool) -> str:
        if self.kind == "text":
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"

    def _head(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self._object(chunk), "created": self.created, "model": self.model}

    def _extras(self) -> dict[str, Any]:
        n = len(self.prepared.prompt_ids)
        return {
            "usage": self.reply.usage(n),
            "timings": self.reply.timings(n, self.job.cached_tokens),
            "fsd": self.reply.figures(self.prepared.settings, self.prepared.sampling),
        }

    def _choice(
        self, text: str | None, finish: str | None, tokens: list[dict[str, Any]], chunk: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.kind == "text":
            choice["text"] = text or ""
        elif chunk:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        if self.reply.origins:
            choice["fsd_tokens"] = {"content": tokens}
        return choice

    def whole(self, tokens: list[dict[str, Any]]) -> dict[str, Any]:
        """The non-streamed response."""
        return {
            **self._head(False),
            "choices": [self._choice(self.reply.text, self.reply.finish_reason, tokens, chunk=False)],
            **self._extras(),
        }

    def first(self) -> dict[str, Any] | None:
        """The chunk that opens a streamed chat reply (the assistant's role); None for text."""
        if self.kind != "chat":
            return None
        chunk = {**self._head(True), "choices": [self._choice("", None, [], chunk=True)]}
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return chunk

    def delta(self, text: str, tokens: list[dict[str, Any]]) -> dict[str, Any]:
        """A chunk of new text."""
        return {**self._head(True), "choices": [self._choice(text, None, tokens, chunk=True)]}

    def last(self) -> dict[str, Any]:
        """The chunk that ends a streamed reply: its finish_reason, `timings` and `fsd` (as
        llama-server puts its timings on the last chunk)."""
        extras = self._extras()
        del extras["usage"]
        return {
            **self._head(True),
            "choices": [self._choice(None, self.reply.finish_reason, [], chunk=True)],
            **extras,
        }

    def usage(self) -> dict[str, Any]:
        """The chunk of `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": self.reply.usage(len(self.prepared.prompt_ids))}


def _event(data: object) -> str:
    return f"data: {to_json(data)}\n\n"


async def _stream(
    answer: _Answer, deliveries: asyncio.Queue[Delivery], include_usage: bool
) -> AsyncIterator[str]:
    """The server-sent events of a streamed reply, ending in `data: [DONE]`; an error that ends the
    reply midway is sent as an event in OpenAI's error shape, and the stream ends after it (no
    finish_reason, which would tell the client that the reply is whole)."""
    if (first := answer.first()) is not None:
        yield _event(first)
    while (item := await deliveries.get()) is not None:
        if isinstance(item, BaseException):
            yield _event(_decoding_error(item).body())
            yield "data: [DONE]\n\n"
            return
        text, tokens = answer.reply.add(item)
        if text or tokens:
            yield _event(answer.delta(text, tokens))
    yield _event(answer.last())
    if include_usage:
        yield _event(answer.usage())
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that call `on_close` however the response ends: all sent, or the client
    gone (Starlette then cancels the sending, possibly while the events' generator waits at a
    `yield`, where no `finally` of its own would run until it is collected)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
