"""The chat's prompts: fitting long conversations in linear time (each turn tokenised once), and
chat templates bounded in time and size, with real tokenizers and real Jinja rendering."""

from __future__ import annotations

import copy
import time
from typing import Any

import jinja2
import pytest

from fsd_chat.models.chat_template import (
    Message,
    PromptBuilder,
    RenderLimits,
    TemplateLimitError,
    prompt_ids,
    render_ids,
)
from fsd_chat.models.pair import ModelPair

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HELLO = [{"role": "user", "content": "Hello"}]


class CountingTokenizer:
    """The real tokenizer, counting the texts it encodes (a conversation's render encodes two: a
    newline, then the rendered text)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def conversation(turns: int) -> list[Message]:
    messages = [Message("system", "Tell short stories.")]
    for i in range(turns // 2):
        messages.append(Message("user", f"Tell me about the cat number {i}."))
        messages.append(Message("assistant", f"The cat number {i} sat on a mat and slept all day long."))
    messages.append(Message("user", "And then?"))
    return messages


@pytest.mark.parametrize("templated", [False, True], ids=["plain", "template"])
def test_a_long_conversation_is_fitted_with_work_bounded_by_the_window(
    pair: ModelPair, templated: bool
) -> None:
    tokenizer = copy.deepcopy(pair.tokenizer)
    tokenizer.chat_template = TEMPLATE if templated else None
    counting = CountingTokenizer(tokenizer)
    for turns in (100, 600):
        builder = PromptBuilder(counting, raw=False)  # type: ignore[arg-type]
        messages = conversation(turns)
        counting.calls = 0
        dropped, ids = builder.build(messages, context=512, reserve=128)
        # The window holds about 20 turns: the work is that, whatever the conversation's length.
        assert counting.calls < 40
        kept = [messages[0], *messages[1 + dropped :]]
        assert kept[1].role == "user" and ids == prompt_ids(tokenizer, kept)
        # Trimmed to half the room at once: far from full, yet more than a few turns.
        assert 128 < len(ids) <= 512 - 128
    # The next send tokenises only what is new (three texts) and builds a window-sized prompt a few
    # times (a template's markup is not in the turns' own counts, so a few more exchanges go).
    messages = [
        *messages[:-1],
        Message("user", "And?"),
        Message("assistant", "A dog came."),
        Message("user", "Who?"),
    ]
    counting.calls = 0
    builder.build(messages, context=512, reserve=128)
    assert counting.calls <= 10


def test_the_prompt_keeps_its_start_until_the_window_is_full(pair: ModelPair) -> None:
    builder = PromptBuilder(pair.tokenizer, raw=False)
    messages = conversation(60)
    dropped, ids = builder.build(messages, context=512, reserve=128)
    starts = []
    for i in range(12):
        messages = [*messages, Message("assistant", f"The end of part {i}."), Message("user", "More?")]
        again, longer = builder.build(messages, context=512, reserve=128)
        starts.append(again)
        if again == dropped:  # the same first turn: the new prompt extends the old one
            assert longer[: len(ids) - 4] == ids[: len(ids) - 4]
        else:  # trimmed again, to about half the room
            assert again > dropped and len(longer) < len(ids)
        dropped, ids = again, longer
    assert len(set(starts)) < len(starts) // 2  # most prompts kept their start


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "ran past 0.5 s"),
        ("{{ 'A' * 1000000000 }}", "built a value of over 1,000,000 items"),
        ("{{ 10 ** (10 ** 10) }}", "built a number of over 1,000,000 bytes"),
        (
            "{% set ns = namespace(x='A') %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}",
            "built a value",
        ),
        ("{% for i in range(3000) %}{{ 'x' * 900 }}{% endfor %}", "wrote over 1,000,000 characters"),
    ],
    ids=["loop", "repeat", "power", "doubling", "output"],
)
def test_a_runaway_template_ends_at_a_limit(pair: ModelPair, template: str, error: str) -> None:
    tokenizer = copy.deepcopy(pair.tokenizer)
    tokenizer.chat_template = template
    started = time.monotonic()
    with pytest.raises(TemplateLimitError, match=error):
        prompt_ids(tokenizer, [Message("user", "Hello")], limits=RenderLimits(seconds=0.5, size=1_000_000))
    assert time.monotonic() - started < 3  # not a test of speed: of the limit (0.5 s) being applied


def test_a_render_is_cancelled_and_a_good_template_renders_as_transformers_does(pair: ModelPair) -> None:
    tokenizer = copy.deepcopy(pair.tokenizer)
    tokenizer.chat_template = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    polls = 0

    def cancelled() -> bool:
        nonlocal polls
        polls += 1
        return polls > 1000

    with pytest.raises(TemplateLimitError, match="stopped while the chat template was rendering"):
        render_ids(
            tokenizer, HELLO, generation_prompt=True, limits=RenderLimits(seconds=60, cancelled=cancelled)
        )
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        render_ids(tokenizer, HELLO, generation_prompt=True, limits=RenderLimits())
    tokenizer.chat_template = TEMPLATE + "{% generation %}{{ messages|tojson }}{% endgeneration %}"
    messages = [Message("user", "a </s> b")]
    assert prompt_ids(tokenizer, messages, limits=RenderLimits()) == prompt_ids(tokenizer, messages)
