"""Conversations -> prompt ids: chat templates, plain-text turns for base models, and keeping the
conversation inside the context window."""

from __future__ import annotations

import copy

import pytest

from fsd_chat.models.chat_template import Message, fit_to_context, has_chat_template, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import ContextLengthError

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CONVERSATION = [
    Message("system", "Tell short stories."),
    Message("user", "Once upon a time"),
    Message("assistant", "there was a cat."),
    Message("user", "What did the cat do?"),
]


@pytest.fixture
def chat_tokenizer(pair: ModelPair):
    """The offline tokenizer with a chat template, as an instruction model's would have."""
    tokenizer = copy.deepcopy(pair.tokenizer)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_base_model_gets_plain_text_turns(pair: ModelPair) -> None:
    assert not has_chat_template(pair.tokenizer)
    ids = prompt_ids(pair.tokenizer, CONVERSATION)
    expected = "Tell short stories.\nOnce upon a time\nthere was a cat.\nWhat did the cat do?"
    assert ids == pair.tokenizer(expected).input_ids
    assert ids[0] == pair.tokenizer.bos_token_id


def test_chat_model_gets_its_template(chat_tokenizer) -> None:
    ids = prompt_ids(chat_tokenizer, CONVERSATION)
    text = chat_tokenizer.decode(ids)
    assert text.startswith("<|system|>Tell short stories.")
    assert text.endswith("<|user|>What did the cat do?\n<|assistant|>")
    raw = prompt_ids(chat_tokenizer, CONVERSATION, raw=True)
    assert "<|" not in chat_tokenizer.decode(raw)


def test_oldest_exchanges_are_dropped_to_fit(chat_tokenizer) -> None:
    full = len(prompt_ids(chat_tokenizer, CONVERSATION))
    kept, ids = fit_to_context(chat_tokenizer, CONVERSATION, context=full + 10, reserve=10)
    assert kept == CONVERSATION
    # A smaller window drops the first user turn together with its reply, keeping the system prompt.
    kept, ids = fit_to_context(chat_tokenizer, CONVERSATION, context=full + 5, reserve=10)
    assert [m.role for m in kept] == ["system", "user"]
    assert kept[-1] == CONVERSATION[-1]
    assert len(ids) + 10 <= full + 5


def test_a_last_message_too_long_for_the_window_is_refused(chat_tokenizer) -> None:
    with pytest.raises(ContextLengthError, match="shorten it"):
        fit_to_context(chat_tokenizer, [Message("user", "word " * 300)], context=64, reserve=16)
