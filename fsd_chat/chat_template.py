"""Conversations -> prompt token ids.

Chat models get the conversation through the tokenizer's own chat template (transformers
`apply_chat_template`). Base models (no template, like stories260K) and raw mode get the turns as
plain text, one after another: a base model simply continues the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from fsd_chat.errors import ContextLengthError, FsdChatError
from fsd_chat.text import require_utf8

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation."""

    role: Role
    content: str


class ChatTemplateError(FsdChatError):
    """The tokenizer's chat template failed to render a conversation (its own error, a syntax error,
    unsafe access refused by Jinja's sandbox, runaway recursion)."""


class UnknownTokenError(FsdChatError):
    """The prompt holds a token of the tokenizer that the models have no embedding for (a tokenizer
    larger than the models' vocabulary)."""


def template_file(tokenizer: PreTrainedTokenizerBase) -> str:
    """Where the tokenizer's chat template comes from, for messages: `chat_template.jinja` in the
    model folder when it has one (transformers prefers it), else its `tokenizer_config.json` (or
    the Hub id)."""
    folder = Path(tokenizer.name_or_path)
    if not folder.is_dir():
        return f"{tokenizer.name_or_path} (tokenizer_config.json)"
    jinja = folder / "chat_template.jinja"
    return str(jinja if jinja.is_file() else folder / "tokenizer_config.json")


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer carries a chat template (an instruction-tuned model)."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    *,
    raw: bool = False,
    vocab_size: int | None = None,
) -> list[int]:
    """Token ids of the prompt that asks for the next assistant turn.

    The turns' text is data: a special token typed in it (`</s>`, `<|im_end|>`) is encoded as the
    characters it is made of, never as the control token itself.

    Args:
        tokenizer: The shared tokenizer.
        messages: The conversation so far (the last turn is usually the user's).
        raw: Ignore any chat template and join the turns as plain text.
        vocab_size: The models' shared vocabulary (`ModelPair.vocab_size`): a prompt holding a
            token id at or beyond it is refused (an embedding lookup would fail mid-reply).

    Raises:
        TextError: a turn holds text that is not valid UTF-8.
        ChatTemplateError: the chat template failed (one line naming its file).
        UnknownTokenError: a token id of the prompt is not below `vocab_size`.
    """
    for m in messages:
        require_utf8(m.content, f"the {m.role} message")
    if has_chat_template(tokenizer) and not raw:
        from jinja2 import TemplateError

        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            rendered = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=True,
            )
        # A template is a program from the model folder: besides Jinja's own errors (its
        # raise_exception, syntax, the sandbox's SecurityError), its expressions raise what Python
        # raises (a recursive macro, range() over the sandbox's limit, 1 / 0, a missing key).
        except (TemplateError, RecursionError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ChatTemplateError(
                f"the chat template in {template_file(tokenizer)} failed: {type(exc).__name__}"
                f"{': ' + reason if reason else ''} (fix the template, or pass --raw to do without it)"
            ) from None
        ids = cast("list[int]", list(rendered))  # tokenize=True, return_dict=False: the ids
    else:
        text = "\n".join(m.content for m in messages if m.content)
        ids = list(tokenizer(text, split_special_tokens=True).input_ids)
    if vocab_size is not None:
        _check_vocabulary(tokenizer, ids, vocab_size)
    return ids


def _check_vocabulary(tokenizer: PreTrainedTokenizerBase, ids: list[int], vocab_size: int) -> None:
    unknown = sorted({i for i in ids if i >= vocab_size})
    if unknown:
        names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} (id {i})" for i in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UnknownTokenError(
            f"the prompt holds the token {names}{more}, which the tokenizer has but the models do not "
            f"(their vocabulary is {vocab_size} tokens): reword the message, or fix the model's tokenizer"
        )


def fit_to_context(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    *,
    context: int | None,
    reserve: int,
    raw: bool = False,
    vocab_size: int | None = None,
) -> tuple[list[Message], list[int]]:
    """Drop the oldest exchanges (never the system prompt or the last turn) until the prompt leaves
    `reserve` tokens for the reply. A user turn goes together with the reply that follows it, so
    templates that insist on alternating roles still accept the rest.

    Returns:
        The turns kept and their prompt ids.

    Raises:
        ContextLengthError: even the system prompt and the last turn alone do not fit.
        UnknownTokenError, ChatTemplateError, TextError: see `prompt_ids`.
    """
    kept = list(messages)
    while True:
        ids = prompt_ids(tokenizer, kept, raw=raw, vocab_size=vocab_size)
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
