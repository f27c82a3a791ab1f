"""`fsd-chat serve` through the official `openai` client against a real uvicorn server on a free
localhost port, over the offline story pair (a base model without a chat template: the chat
endpoint takes the plain-text prompt path, as the chat does for it).

Every sampled request sets its seed, so each figure compared here is deterministic on one machine.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import openai
import pytest
from fastapi import FastAPI
from openai import OpenAI

from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.settings import (
    DEFAULT_GREEDY_THRESHOLD,
    DEFAULT_THRESHOLD,
    DecodingSettings,
    SamplingRequest,
)
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.server import app as server_app
from fsd_chat.server import errors
from fsd_chat.server.app import ServeOptions, create_app
from fsd_chat.server.engine import Engine
from fsd_chat.server.run import BODY_SECONDS, HEADER_SECONDS, bind, url
from fsd_chat.server.run import server as serve_with

MODEL = "stories260K"
PROMPT = "Once upon a time"
ORIGINS = {"draft-exact", "draft-fuzzy", "target-resampled", "target-bonus", "target"}


@dataclass
class Served:
    """A running server: its base URL, engine and pair."""

    url: str
    engine: Engine
    pair: ModelPair

    def client(self, key: str = "none") -> OpenAI:
        return OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=60)


@contextmanager
def running(
    app: FastAPI,
    engine: Engine | None = None,
    header_seconds: float = HEADER_SECONDS,
    body_seconds: float = BODY_SECONDS,
) -> Iterator[str]:
    """`app` under `fsd-chat serve`'s uvicorn server (`run.server`) in a thread on a free localhost
    port; yields its /v1 URL. Stopping it shuts `engine` down, as SIGTERM does."""
    sock = bind("127.0.0.1", 0)
    server = serve_with(app, engine, header_seconds, body_seconds)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield url(sock)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def serving(
    pair: ModelPair,
    *,
    queue_size: int = 16,
    api_key: str | None = None,
    raw: bool = False,
    header_seconds: float = HEADER_SECONDS,
    body_seconds: float = BODY_SECONDS,
    threshold_given: bool = True,
) -> Iterator[Served]:
    """The server's app over its own decoder of `pair`, running (see `running`)."""
    controls = Controls(DecodingSettings())
    engine = Engine(pair.speculative(controls), controls, queue_size)
    options = ServeOptions(
        model_id=MODEL,
        aliases=frozenset(),
        settings=DecodingSettings(),
        sampling=SamplingRequest(),
        max_new_tokens=64,
        threshold_given=threshold_given,
        raw=raw,
        api_key=api_key,
    )
    try:
        with running(create_app(pair, engine, options), engine, header_seconds, body_seconds) as address:
            yield Served(address, engine, pair)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(pair: ModelPair) -> Iterator[Served]:
    with serving(pair) as s:
        yield s


def until_decoding(stream: Any) -> None:
    """Read a streamed reply until its first text: its first event (the role) is sent at once, while
    the job may still wait in the engine's queue."""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return
    raise AssertionError("the reply ended before any text")


def user(text: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def extra(obj: Any, name: str) -> Any:
    """A field outside OpenAI's schema (timings, fsd, fsd_tokens), kept by the client's models."""
    return (obj.model_extra or {})[name]


def test_smoke_models_and_one_reply(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=8)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    prompt = prompt_ids(served.pair.tokenizer, [Message("user", PROMPT)])
    assert reply.usage.prompt_tokens == len(prompt)
    timings = extra(reply, "timings")
    assert timings["predicted_n"] == 8 and timings["prompt_n"] + timings["cache_n"] == len(prompt)
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    fsd = extra(reply, "fsd")
    assert 0.0 <= fsd["acceptance_rate"] <= 1.0 and fsd["mean_accepted_length"] >= 1.0
    assert fsd["stop_reason"] == "max-new-tokens" and fsd["settings"] == asdict(DecodingSettings())


def test_timings_count_the_cached_prompt_tokens_apart(served: Served) -> None:
    # As llama-server's: prompt_n counts the prompt tokens read now, cache_n those the KV cache kept
    # from the reply before. A text completion, then the same text with its reply and more re-sent:
    # while the client was away the engine read the prompt and the reply ahead, as one text.
    client = served.client()
    tokenizer = served.pair.tokenizer
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    assert served.engine.wait_idle(30)  # a client's next request comes later than the engine reads
    read_ahead = tokenizer(PROMPT + first.choices[0].text).input_ids
    text = PROMPT + first.choices[0].text + " The end."
    second = client.completions.create(model=MODEL, prompt=text, max_tokens=4)
    prompt = tokenizer(text).input_ids
    shared = next(
        (i for i, (a, b) in enumerate(zip(read_ahead, prompt, strict=False)) if a != b), len(read_ahead)
    )
    # Every prompt token but the last is prefilled; the last is fed by the first step.
    expected_cache = min(shared, len(prompt) - 1)
    timings = extra(second, "timings")
    assert expected_cache >= len(read_ahead) - 1  # the reply's tokens were kept too
    assert timings["cache_n"] == expected_cache, timings
    assert timings["prompt_n"] == len(prompt) - expected_cache, timings
    # The same prompt again: everything but its last token is kept.
    assert served.engine.wait_idle(30)
    again = client.completions.create(model=MODEL, prompt=text, max_tokens=4)
    assert extra(again, "timings")["cache_n"] == len(prompt) - 1
    assert extra(again, "timings")["prompt_n"] == 1


@pytest.mark.slow
def test_streamed_reply_is_the_whole_reply_in_pieces(served: Served) -> None:
    client = served.client()
    whole = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=40)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user(),  # type: ignore[arg-type]
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finished] == ["length"]
    assert extra(finished[0], "timings")["predicted_n"] == 40
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40


@pytest.mark.slow
def test_text_completions_streamed_and_not(served: Served) -> None:
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30)
    assert whole.object == "text_completion" and whole.usage is not None
    assert whole.usage.prompt_tokens == len(served.pair.tokenizer(PROMPT).input_ids)
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_stop_string_ends_the_reply_and_is_not_sent(served: Served) -> None:
    client = served.client()
    free = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=40)  # type: ignore[arg-type]
    text = free.choices[0].message.content or ""
    assert "." in text  # the greedy story's first sentence ends within 40 tokens
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=user(),  # type: ignore[arg-type]
            max_tokens=40,
            stop=["."],
            stream=stream,
        )
        if stream:
            chunks = list(reply)  # type: ignore[arg-type]
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = reply.choices[0].message.content, reply.choices[0].finish_reason  # type: ignore[union-attr]
        assert got == text[: text.index(".")]
        assert finish == "stop"


@pytest.mark.slow
def test_the_dial_per_request_changes_the_fuzzy_share(served: Served) -> None:
    """Same prompt, same seed, sampled at temperature 1: threshold 0 accepts nothing fuzzily (D ≤ 0
    never holds for distinct laws); js threshold 0.6, near its bound ln 2, accepts many draft tokens
    that the exact test rejects."""
    client = served.client()

    def figures(threshold: float) -> dict[str, Any]:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=user(),  # type: ignore[arg-type]
            max_tokens=64,
            temperature=1.0,
            seed=7,
            extra_body={"fsd": {"threshold": threshold, "rule": "fuzzy", "origins": True}},
        )
        fsd = extra(reply, "fsd")
        tokens = extra(reply.choices[0], "fsd_tokens")["content"]
        assert reply.usage is not None and len(tokens) == reply.usage.completion_tokens
        assert {t["origin"] for t in tokens} <= ORIGINS
        assert fsd["accepted_fuzzy"] == sum(t["origin"] == "draft-fuzzy" for t in tokens)
        assert fsd["settings"]["threshold"] == threshold
        return fsd

    exact, fuzzy = figures(0.0), figures(0.6)
    assert exact["fuzzy_share"] == 0.0 and exact["cost"] == 0.0
    assert fuzzy["fuzzy_share"] > 0.1 and fuzzy["cost"] > 0.0
    # The server's own setting is back for a request without an fsd object.
    plain = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=4)  # type: ignore[arg-type]
    assert extra(plain, "fsd")["settings"]["threshold"] == DecodingSettings().threshold


def test_a_request_without_a_threshold_gets_the_setups_default(pair: ModelPair) -> None:
    """With no --threshold, as the chat: a greedy request starts at the regret scale's default, a
    sampled one at the divergences'; a request that names T keeps it."""
    with serving(pair, threshold_given=False) as s:
        client = s.client()

        def threshold(**fields: Any) -> float:
            reply = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=2, **fields)
            return float(extra(reply, "fsd")["settings"]["threshold"])

        assert threshold(temperature=0.0) == DEFAULT_GREEDY_THRESHOLD
        assert threshold(temperature=1.0, seed=1) == DEFAULT_THRESHOLD
        assert threshold(temperature=0.0, extra_body={"fsd": {"threshold": 0.1}}) == 0.1


@pytest.mark.slow
def test_closing_a_stream_stops_the_decoder(served: Served) -> None:
    client = served.client()
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": user(),
        "max_tokens": 400,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"fsd": {"draft_tokens": 1}},  # one token a step: many steps to cut short
    }
    full = extra(client.chat.completions.create(**request), "fsd")["steps"]
    assert full >= 40  # the uncut reply is long enough for a cut to show
    before = served.engine.steps
    stream = client.chat.completions.create(**request, stream=True)
    next(iter(stream))
    next(iter(stream))
    stream.close()
    # The next request is served after the cut reply's last step, and counts its own steps.
    after = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=1)  # type: ignore[arg-type]
    cut = served.engine.steps - before - extra(after, "fsd")["steps"]
    assert cut < full / 2


@pytest.mark.slow
def test_a_client_giving_up_on_a_whole_reply_stops_the_decoder(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-streamed request whose client times out and closes its connection is cancelled: the
    server sees the disconnection while it waits for the reply (every `DISCONNECT_POLL` seconds).
    The client hangs up a fifth of the way through the reply, and the server polls often: on a
    quiet machine the whole reply takes about 0.4 s, under the default poll plus a fixed wait."""
    monkeypatch.setattr(server_app, "DISCONNECT_POLL", 0.02)
    client = served.client()
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": user(),
        "max_tokens": 400,
        "temperature": 1.0,
        "seed": 3,
        "fsd": {"draft_tokens": 1},
    }
    body_without_fsd = {k: v for k, v in body.items() if k != "fsd"}
    began = time.perf_counter()
    full = extra(client.chat.completions.create(**body_without_fsd, extra_body={"fsd": body["fsd"]}), "fsd")[
        "steps"
    ]
    full_seconds = time.perf_counter() - began
    assert full >= 40
    before = served.engine.steps
    payload = json.dumps(body).encode()
    address = urlparse(served.url)
    with socket.create_connection((address.hostname, address.port)) as conn:
        head = f"POST {address.path}/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        conn.sendall(head.encode() + payload)
        time.sleep(full_seconds / 5)  # decoding: then the client hangs up
    after = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=1)  # type: ignore[arg-type]
    assert served.engine.steps - before - extra(after, "fsd")["steps"] < full / 2


@pytest.mark.slow
def test_a_resent_history_prefills_only_what_is_new(served: Served) -> None:
    """A multi-turn client re-sends the conversation: when a reply ends the engine feeds the KV
    caches the conversation as the next request will start (the reply as an assistant turn, as the
    chat does), so that request's prefill feeds only its new message (counted by a forward hook)."""
    client = served.client()
    fed: list[int] = []

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        fed.append(kwargs["input_ids"].shape[1])

    def prefilled(messages: list[dict[str, str]]) -> tuple[int, str]:
        assert served.engine.wait_idle(30)  # the user types for longer than the engine reads ahead
        fed.clear()
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)  # type: ignore[arg-type]
        return fed[0], reply.choices[0].message.content or ""

    def ids(messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        turns = [Message(m["role"], m["content"]) for m in messages]  # type: ignore[arg-type]
        return prompt_ids(served.pair.tokenizer, turns, generation_prompt=generation_prompt)

    hook = served.pair.target.register_forward_pre_hook(count, with_kwargs=True)
    try:
        first = [{"role": "user", "content": "Tom had a red ball"}]
        fresh, answer = prefilled(first)
        # Nothing but the start-of-text token is shared with the previous request's sequence.
        assert fresh >= len(ids(first)) - 2
        history = [*first, {"role": "assistant", "content": answer}]
        second = [*history, {"role": "user", "content": "He was happy"}]
        again, _ = prefilled(second)
        read, new = ids(history, generation_prompt=False), ids(second)
        shared = next((i for i, (a, b) in enumerate(zip(read, new, strict=False)) if a != b), len(read))
        assert shared >= len(read) - 1  # the history's tokens start the new prompt (one may merge)
        # Every token after what was read ahead, but the last (fed by the first step).
        assert again == len(new) - 1 - shared
    finally:
        hook.remove()


def plain_http(address: str, data: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """A request no client library shaped: its status and JSON body."""
    request = urllib.request.Request(address, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def error_of(call: Callable[[], object]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    body = caught.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"] and "\n" not in body["error"]["message"]
    return caught.value.status_code, body["error"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"extra_body": {"fsd": {"threshold": -0.1}}}, "fsd"),
        ({"extra_body": {"fsd": {"rule": "lossy"}}}, "fsd"),
        ({"extra_body": {"fsd": {"divergence": "l2"}}}, "fsd"),
        ({"extra_body": {"fsd": {"draft_tokens": 0}}}, "fsd"),
        ({"extra_body": {"fsd": {"draft_policy": "adaptive"}}}, "fsd"),
        ({"extra_body": {"fsd": {"thresold": 1}}}, "fsd.thresold"),
        ({"extra_body": {"fsd": {"threshold": "high"}}}, "fsd.threshold"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(served: Served, fields: dict[str, Any], param: str) -> None:
    client = served.client()
    request = {"model": MODEL, "messages": user(), "max_tokens": 4, **fields}
    status, error = error_of(lambda: client.chat.completions.create(**request))
    assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param)


@pytest.mark.slow
def test_any_model_name_too_long_prompt_and_bad_json(served: Served) -> None:
    client = served.client()
    # One model is served: a client with a fixed model name gets it (as from llama-server).
    reply = client.chat.completions.create(model="gpt-4o", messages=user(), max_tokens=2)  # type: ignore[arg-type]
    assert reply.model == MODEL and reply.usage is not None and reply.usage.completion_tokens == 2
    status, error = error_of(lambda: client.models.retrieve("gpt-4o"))
    assert (status, error["code"]) == (404, "model_not_found")
    long = " ".join(["once upon a time"] * 200)
    # OpenAI's answer to a prompt too long: 400, which its client raises as BadRequestError.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=user(long))  # type: ignore[arg-type]
    error = caught.value.response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "512 tokens" in error["message"]
    status, error = error_of(lambda: client.completions.create(model=MODEL, prompt=long))
    assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", "prompt")
    status, body = plain_http(f"{served.url}/chat/completions", b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = plain_http(f"{served.url}/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"


@pytest.mark.slow
def test_api_key(pair: ModelPair) -> None:
    with serving(pair, api_key="s3cret") as s:
        for key in ("wrong", "s3cret-but-longer", "s3cre"):
            status, error = error_of(lambda k=key: s.client(k).models.list())  # type: ignore[misc]
            assert (status, error["code"]) == (401, "invalid_api_key")
        status, body = plain_http(f"{s.url}/models")  # no Authorization header at all
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
        assert [m.id for m in s.client("s3cret").models.list().data] == [MODEL]


LONG: dict[str, Any] = {
    "model": MODEL,
    "messages": user(),
    "max_tokens": 400,
    "temperature": 1.0,
    "seed": 3,
    "stream": True,
    "extra_body": {"fsd": {"draft_tokens": 1}},  # one token a step: a reply that lasts
}
"""A streamed chat completion that stays busy for a while (400 sampled tokens, one a step)."""


@pytest.mark.slow
def test_a_full_queue_answers_429(pair: ModelPair) -> None:
    """One reply decodes and one waits (queue size 1): a third request is refused at once. The
    first two are long replies (400 tokens, one a step) so that both are still there."""
    with serving(pair, queue_size=1) as s:
        client = s.client()
        running = client.chat.completions.create(**LONG)
        until_decoding(running)
        waiting = client.chat.completions.create(**LONG)  # queued: its headers are sent at once
        status, error = error_of(
            lambda: client.chat.completions.create(model=MODEL, messages=user(), max_tokens=2)
        )  # type: ignore[arg-type]
        assert (status, error["type"], error["code"]) == (429, "rate_limit_error", "queue_full")
        running.close()
        # The waiting reply is served whole once the first is cancelled.
        chunks = list(waiting)
        assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
        assert json.loads(chunks[-1].model_dump_json())["fsd"]["stop_reason"] in {
            "eos",
            "max-new-tokens",
            "context",
        }


def test_an_unexpected_error_is_one_line_and_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The catch-all: a route that fails unexpectedly answers a one-line 500 in OpenAI's shape, and
    its traceback goes to the error log (a real app and server; the route is the test's own)."""
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path))
    app = FastAPI()
    errors.install(app)

    @app.get("/v1/boom")
    def boom() -> None:
        raise RuntimeError("secret internal detail")

    with running(app) as address:
        status, body = plain_http(f"{address}/boom")
    assert status == 500 and body["error"]["type"] == "server_error"
    assert body["error"]["message"] == "internal error: RuntimeError (details in the server's error log)"
    log = (tmp_path / "fsd-chat.log").read_text()
    assert "Traceback" in log and "secret internal detail" in log


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.slow
def test_a_chat_template_builds_the_chat_prompt_unless_raw(pair: ModelPair) -> None:
    """The pair with a chat template on its tokenizer, as an instruction model has: the chat
    endpoint renders it (a developer message is a system prompt), --raw and the text endpoint do not."""
    tokenizer = copy.deepcopy(pair.tokenizer)
    tokenizer.chat_template = TEMPLATE
    templated = replace(pair, tokenizer=tokenizer)
    messages = [{"role": "developer", "content": "Tell short stories."}, {"role": "user", "content": PROMPT}]
    turns = [Message("system", "Tell short stories."), Message("user", PROMPT)]
    with_template = prompt_ids(tokenizer, turns)
    plain = prompt_ids(tokenizer, turns, raw=True)
    assert len(with_template) != len(plain)
    for raw, expected in ((False, with_template), (True, plain)):
        with serving(templated, raw=raw) as s:
            reply = s.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
            assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
            text = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert text.usage is not None and text.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
