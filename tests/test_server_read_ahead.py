"""The server's engine reads a conversation ahead when a reply ends (`Engine._read_ahead`): only
when no request waits, never for a reply that was stopped, never at the cost of a request that
arrives meanwhile, and never at the cost of the engine itself when the history fails. Driven
through the engine itself, over the offline pair (tests/test_server.py checks the prefill a
re-sent conversation saves, through the HTTP API)."""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsd_chat.decoding import reply as reply_module
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.events import Step, StopReason
from fsd_chat.decoding.settings import DecodingSettings, SamplingConfig
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.server.engine import Delivery, Engine, Job
from tests.decoding_helpers import collect

PROMPT = "Once upon a time"


@pytest.fixture
def engine(pair: ModelPair) -> Iterator[Engine]:
    controls = Controls(DecodingSettings())
    running = Engine(pair.speculative(controls), controls, queue_size=4)
    yield running
    running.close()


def job(
    pair: ModelPair,
    history: Callable[[str], list[int]] | None,
    tokens: int = 16,
    prompt: str = PROMPT,
) -> tuple[Job, queue.Queue[Delivery]]:
    deliveries: queue.Queue[Delivery] = queue.Queue()
    made = Job(
        pair.tokenizer(prompt).input_ids,
        DecodingSettings(),
        SamplingConfig(),
        tokens,
        (),
        deliveries.put,
        history=history,
    )
    return made, deliveries


def steps(deliveries: queue.Queue[Delivery]) -> list[Step]:
    """The job's steps, once it ended (an error fails the test)."""
    got: list[Step] = []
    while (item := deliveries.get(timeout=60)) is not None:
        assert isinstance(item, Step), item
        got.append(item)
    return got


def test_nothing_is_read_ahead_while_a_request_waits(engine: Engine, pair: ModelPair) -> None:
    asked: list[str] = []

    def history(name: str) -> Callable[[str], list[int]]:
        def ids(text: str) -> list[int]:
            asked.append(name)
            return pair.tokenizer(PROMPT + text).input_ids

        return ids

    first, first_out = job(pair, history("first"), tokens=48)
    second, second_out = job(pair, history("second"), tokens=4)
    engine.submit(first)
    engine.submit(second)  # queued while the first decodes (48 tokens take far longer than this)
    steps(first_out), steps(second_out)
    assert engine.wait_idle(30)
    assert asked == ["second"]


def test_a_stopped_reply_is_not_read_ahead(engine: Engine, pair: ModelPair) -> None:
    asked: list[str] = []

    def history(text: str) -> list[int]:
        asked.append(text)
        return [1]

    stopped, out = job(pair, history, tokens=400)
    engine.submit(stopped)
    first = out.get(timeout=60)
    assert isinstance(first, Step)
    engine.cancel(stopped)
    assert steps(out)[-1].stop_reason == StopReason.STOPPED
    assert engine.wait_idle(30)
    assert asked == []


def test_a_request_arriving_stops_the_reading_and_replies_as_a_fresh_decoder(
    engine: Engine, pair: ModelPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reading stops between two chunks of its prefill when a request comes (chunks of 4 tokens
    here, so that a short conversation takes several), and that request's reply is the one a
    decoder that never read ahead gives."""
    monkeypatch.setattr(reply_module, "PREFILL_CHUNK", 4)
    target = engine.decoder.cached_models[0]  # type: ignore[attr-defined]
    seen_at_start: list[int] = []  # the target's cached tokens when each reply starts
    generate = engine.decoder.generate

    def recording(*args: Any, **kwargs: Any) -> Iterator[Step]:
        seen_at_start.append(target.seen)
        yield from generate(*args, **kwargs)

    monkeypatch.setattr(engine.decoder, "generate", recording)
    reading: list[int] = []
    follow, follow_out = job(pair, None, prompt="The little dog")

    def history(text: str) -> list[int]:
        ids = pair.tokenizer(PROMPT + text + " The end. Tom and Sue went home.").input_ids
        engine.submit(follow)  # arrives as the reading starts
        reading.append(len(ids))
        return ids

    first, first_out = job(pair, history)
    engine.submit(first)
    replied = steps(first_out)
    got = steps(follow_out)
    assert engine.wait_idle(30)
    assert reading and reading[0] > 12  # more than three chunks to read, had it not stopped
    # Nothing was read: the cache held the first reply as it ended (its last token drawn, not fed).
    assert seen_at_start[1] == len(pair.tokenizer(PROMPT).input_ids) + sum(len(s.tokens) for s in replied) - 1
    fresh = pair.speculative(Controls(DecodingSettings()))
    want = fresh.generate(
        pair.tokenizer("The little dog").input_ids, max_new_tokens=16, sampling=SamplingConfig()
    )
    assert collect(got).ids == collect(want).ids


REFUSES_REPLIES = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}"
    "{% endif %}{{ m['content'] }}{% endfor %}"
)


@pytest.mark.parametrize("failure", ["template", "bug"])
def test_a_failing_history_reads_nothing_and_the_engine_goes_on(
    engine: Engine, pair: ModelPair, failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template that cannot render the reply (bad input: nothing logged), or a bug in the history
    (logged with its traceback): the reading is given up and the next request is served."""
    monkeypatch.setenv("FSD_CHAT_DATA_DIR", str(tmp_path))
    tokenizer = copy.deepcopy(pair.tokenizer)
    tokenizer.chat_template = REFUSES_REPLIES
    prompt_ids(tokenizer, [Message("user", PROMPT)])  # the prompt itself renders
    target = engine.decoder.cached_models[0]  # type: ignore[attr-defined]

    def history(text: str) -> list[int]:
        if failure == "bug":
            raise RuntimeError("a bug in the history")
        return prompt_ids(tokenizer, [Message("user", PROMPT), Message("assistant", text)])

    first, out = job(pair, history)
    engine.submit(first)
    replied = steps(out)
    assert engine.wait_idle(30)
    # The cache holds the prompt and the reply but its last token (drawn, never fed): nothing more.
    assert target.seen == len(pair.tokenizer(PROMPT).input_ids) + sum(len(s.tokens) for s in replied) - 1
    after, after_out = job(pair, None, tokens=4)
    engine.submit(after)
    assert len(steps(after_out)) >= 1
    log = tmp_path / "fsd-chat.log"
    assert log.exists() == (failure == "bug")
    if log.exists():
        assert "reading a conversation ahead" in log.read_text() and "a bug in the history" in log.read_text()


def test_the_history_gets_the_reply_as_the_client_did(engine: Engine, pair: ModelPair) -> None:
    """Cut before a stop string, which the client never receives (`stop_index`)."""
    whole, out = job(pair, None, tokens=24)
    engine.submit(whole)
    text = "".join(s.text for s in steps(out))
    stop = text[12:16]
    asked: list[str] = []

    def history(reply: str) -> list[int]:
        asked.append(reply)
        return pair.tokenizer(PROMPT + reply).input_ids

    assert engine.wait_idle(30)
    cut, cut_out = job(pair, history, tokens=24)
    cut.stop_strings = (stop,)
    engine.submit(cut)
    assert steps(cut_out)[-1].stop_reason == StopReason.STOP_STRING
    assert engine.wait_idle(30)
    assert asked == [text[: text.find(stop)]]
