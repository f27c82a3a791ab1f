"""Conversations -> prompt token ids.

Chat models get the conversation through the tokenizer's own chat template (transformers
`apply_chat_template`). Base models (no template, like stories260K) and raw mode get the turns as
plain text, one after another: a base model simply continues the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fsd_chat.errors import ContextLengthError
from fsd_chat.text import require_utf8

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

    The turns' text is data: a special token typed in it (`</s>`, `<|im_end|>`) is encoded as the
    characters it is made of, never as the control token itself.

    Args:
        tokenizer: The shared tokenizer.
        messages: The conversation so far (the last turn is usually the user's).
        raw: Ignore any chat template and join the turns as plain text.

    Raises:
        TextError: a turn holds text that is not valid UTF-8.
    """
    for m in messages:
        require_utf8(m.content, f"the {m.role} message")
    if has_chat_template(tokenizer) and not raw:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        ids = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
        )
        return list(ids)
    text = "\n".join(m.content for m in messages if m.content)
    return list(tokenizer(text, split_special_tokens=True).input_ids)


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
            raise ContextLengthError(_too_long(tokenizer, kept, ids, context, reserve, raw))
        first = droppable[0]
        pair = 2 if first + 1 < len(kept) - 1 and kept[first + 1].role == "assistant" else 1
        del kept[first : first + pair]


def _too_long(
    tokenizer: PreTrainedTokenizerBase,
    kept: list[Message],
    ids: list[int],
    context: int,
    reserve: int,
    raw: bool,
) -> str:
    """Blame the system prompt when it alone leaves no room, else the last message."""
    window = f"the context window is {context} tokens and {reserve} are kept for the reply"
    system = [m for m in kept if m.role == "system"]
    if system and system[0] is not kept[-1]:
        system_ids = prompt_ids(tokenizer, system, raw=raw)
        if len(system_ids) + reserve >= context:
            return f"the system prompt needs {len(system_ids)} tokens, but {window}: shorten it"
    with_system = " with the system prompt" if system else ""
    return f"the last message needs {len(ids)} tokens{with_system}, but {window}: shorten it"
