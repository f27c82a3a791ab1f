"""Conversations -> prompt token ids.

Chat models get the conversation through the tokenizer's own chat template (transformers
`apply_chat_template`). Base models (no template, like stories260K) and raw mode get the turns as
plain text, one after another: a base model simply continues the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fsd_chat.errors import ContextLengthError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation."""

    role: Role
    content: str


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer carries a chat template (an instruction-tuned model)."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], *, raw: bool = False
) -> list[int]:
    """Token ids of the prompt that asks for the next assistant turn.

    Args:
        tokenizer: The shared tokenizer.
        messages: The conversation so far (the last turn is usually the user's).
        raw: Ignore any chat template and join the turns as plain text.
    """
    if has_chat_template(tokenizer) and not raw:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    text = "\n".join(m.content for m in messages if m.content)
    return list(tokenizer(text).input_ids)


def fit_to_context(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    *,
    context: int | None,
    reserve: int,
    raw: bool = False,
) -> tuple[list[Message], list[int]]:
    """Drop the oldest exchanges (never the system prompt or the last turn) until the prompt leaves
    `reserve` tokens for the reply. A user turn goes together with the reply that follows it, so
    templates that insist on alternating roles still accept the rest.

    Returns:
        The turns kept and their prompt ids.

    Raises:
        ContextLengthError: even the system prompt and the last turn alone do not fit.
    """
    kept = list(messages)
    while True:
        ids = prompt_ids(tokenizer, kept, raw=raw)
        if context is None or len(ids) + reserve <= context:
            return kept, ids
        droppable = [i for i, m in enumerate(kept[:-1]) if m.role != "system"]
        if not droppable:
            raise ContextLengthError(
                f"the last message needs {len(ids)} tokens, but the context window is {context} tokens "
                f"and {reserve} are kept for the reply: shorten it"
            )
        first = droppable[0]
        pair = 2 if first + 1 < len(kept) - 1 and kept[first + 1].role == "assistant" else 1
        del kept[first : first + pair]
