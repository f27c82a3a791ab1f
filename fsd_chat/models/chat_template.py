"""Conversations -> prompt token ids.

Chat models get the conversation through the tokenizer's own chat template (transformers
`apply_chat_template`). Base models (no template, like stories260K) and raw mode get the turns as
plain text, one after another: a base model simply continues the text.

A chat template is code from outside. In the chat it is first rendered under limits (`RenderLimits`:
time, size, a cancel flag) by a sandboxed Jinja environment that checks them at every call,
attribute access, `range` step, arithmetic operator and output chunk; only a template that
finishes within them is handed to transformers, which renders it again for real.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from fsd_chat.support.errors import ContextLengthError, FsdChatError
from fsd_chat.support.text import require_utf8

if TYPE_CHECKING:
    from jinja2 import Template
    from transformers import PreTrainedTokenizerBase

Role = Literal["system", "user", "assistant"]
TEMPLATE_SECONDS = 10.0
"""Longest a chat template may take to render in the chat."""
TEMPLATE_SIZE = 4_000_000
"""Most characters (or items) of the rendered prompt and of any value a template builds."""


class TemplateLimitError(FsdChatError):
    """The chat template ran past a `RenderLimits` limit (or its render was cancelled)."""


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """Bounds on one render of a chat template.

    Attributes:
        seconds: Wall-clock limit.
        size: Most characters (or items) of the output and of any value the template builds.
        cancelled: Polled during the render; True ends it (the user pressed Esc, or quit).
    """

    seconds: float = TEMPLATE_SECONDS
    size: int = TEMPLATE_SIZE
    cancelled: Callable[[], bool] = field(default=lambda: False)


class _Budget:
    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds

    def check(self) -> None:
        if self.limits.cancelled():
            raise TemplateLimitError("stopped while the chat template was rendering")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran past {self.limits.seconds:g} s")

    def size(self, items: int) -> None:
        if items > self.limits.size:
            raise TemplateLimitError(f"the chat template built a value of over {self.limits.size:,} items")


_BUDGET: ContextVar[_Budget | None] = ContextVar("template_budget", default=None)


def _check() -> _Budget | None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.check()
    return budget


class _CheckedRange:
    """The sandbox's `range` (at most 100,000 items), checking the budget at every step: an empty
    nested loop calls nothing else that could."""

    def __init__(self, *args: int) -> None:
        self._range = safe_range(*args)

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        return self._range[index]

    def __iter__(self) -> Iterator[int]:
        for i in self._range:
            _check()
            yield i


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, checking the budget of the render in progress (`_BUDGET`)."""

    # Intercepted operators are also never folded into constants when the template compiles.
    intercepted_binops = frozenset({"*", "**", "+"})

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _check()
        if budget is not None:
            limit = budget.limits.size
            if operator == "*":
                for items, times in ((left, right), (right, left)):
                    if isinstance(items, str | list | tuple) and isinstance(times, int):
                        budget.size(len(items) * times)  # checked before it is built
            if (
                operator == "**"
                and isinstance(left, int)
                and isinstance(right, int)
                and abs(left) > 1
                and right * math.log2(abs(left)) > 8 * limit
            ):
                raise TemplateLimitError(f"the chat template built a number of over {limit:,} bytes")
        result = super().call_binop(context, operator, left, right)
        if budget is not None and isinstance(result, str | list | tuple):
            budget.size(len(result))
        return result


@lru_cache(maxsize=4)
def _bounded_template(source: str) -> Template:
    # transformers' own environment (compiled from an empty template: compiling the real one would
    # fold its constant expressions, e.g. 'A' * 10**9, before any limit applies) gives the globals,
    # filters and extensions (raise_exception, tojson, {% generation %}, ...) a template may use.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[type(e) for e in base.extensions.values()]
    )
    env.filters.update(base.filters)
    env.globals.update(base.globals)
    env.globals["range"] = _CheckedRange
    return env.from_string(source)


def check_template(
    tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]], limits: RenderLimits
) -> None:
    """Render the tokenizer's chat template over `conversation` under `limits`, and drop the text.

    Raises:
        TemplateLimitError: a limit was passed, or the render was cancelled.
        jinja2.TemplateError: the template itself failed (e.g. `raise_exception`).
    """
    budget = _Budget(limits)
    token = _BUDGET.set(budget)
    try:
        template = _bounded_template(tokenizer.get_chat_template())
        rendered = 0
        for chunk in template.generate(
            messages=conversation,
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **tokenizer.special_tokens_map,
        ):
            rendered += len(chunk)
            budget.check()
            if rendered > limits.size:
                raise TemplateLimitError(f"the chat template wrote over {limits.size:,} characters")
    finally:
        _BUDGET.reset(token)


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
    limits: RenderLimits | None = None,
    generation_prompt: bool = True,
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
        limits: Render the chat template under these limits first (see `check_template`).
        generation_prompt: End with the template's opening of an assistant turn; False: the
            conversation alone (what the prompt after the next user turn starts with).

    Raises:
        TextError: a turn holds text that is not valid UTF-8.
        ChatTemplateError: the chat template failed (one line naming its file).
        UnknownTokenError: a token id of the prompt is not below `vocab_size`.
        TemplateLimitError: see `check_template`.
    """
    for m in messages:
        require_utf8(m.content, f"the {m.role} message")
    if has_chat_template(tokenizer) and not raw:
        from jinja2 import TemplateError

        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            if limits is not None:
                check_template(tokenizer, conversation, limits)
            rendered = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=generation_prompt,
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
    limits: RenderLimits | None = None,
) -> tuple[list[Message], list[int]]:
    """Drop the oldest exchanges (never the system prompt or the last turn) until the prompt leaves
    `reserve` tokens for the reply. A user turn goes together with the reply that follows it, so
    templates that insist on alternating roles still accept the rest. Each drop builds the prompt
    again: give it a conversation about the window's size (`PromptBuilder` does).

    Returns:
        The turns kept and their prompt ids.

    Raises:
        ContextLengthError: even the system prompt and the last turn alone do not fit.
        UnknownTokenError, ChatTemplateError, TextError, TemplateLimitError: see `prompt_ids`.
    """
    kept = list(messages)
    while True:
        ids = prompt_ids(tokenizer, kept, raw=raw, vocab_size=vocab_size, limits=limits)
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


TRIM_TO = 0.5
"""When the conversation outgrows the window, the oldest exchanges go until the kept turns use at
most this share of the room: the prompts after it start alike, and reuse the KV caches, until the
window fills again (llama.cpp's context shift drops half the same way)."""


class PromptBuilder:
    """The chat's prompts: the conversation fitted into the context window, in time linear in the
    conversation, keeping the prompt's start while it fits.

    Each turn's text is tokenised once (cached by its text). Walking back from the last turn, the
    turns are kept while their own tokens fit; only that suffix, about the window's size, is then
    built into a prompt (template included) by `fit_to_context`, which drops what still does not fit.
    A turn's own tokens can undercount what it adds to the prompt (template markup), never by much
    overcount it: one token per turn is allowed for a merge across a boundary.

    The first kept turn is remembered: the next prompt starts from it again while that fits, so
    consecutive prompts share their start (and the decoder's prefix reuse applies); when it no
    longer fits, the conversation is trimmed to `TRIM_TO` of the room at once.

    Args:
        tokenizer: The shared tokenizer.
        raw: Plain-text turns even when the tokenizer has a chat template.
        vocab_size: The models' vocabulary (see `prompt_ids`); None: not checked.
        seconds: Time limit of one template render (see `RenderLimits`).
        size: Size limit of one template render.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        raw: bool,
        vocab_size: int | None = None,
        seconds: float = TEMPLATE_SECONDS,
        size: int = TEMPLATE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.raw = raw
        self.vocab_size = vocab_size
        self.seconds = seconds
        self.size = size
        self._counts: dict[str, int] = {}
        self._first: tuple[int, Message] | None = None
        """Index (among the turns) and message of the last prompt's first kept turn."""
        self._kept: list[Message] = []
        """The messages the last prompt was built from (the system prompt and the kept turns)."""

    def _count(self, text: str) -> int:
        count = self._counts.get(text)
        if count is None:
            ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
            count = self._counts[text] = max(len(ids) - 1, 0)
        return count

    def _start(self, head: list[Message], turns: list[Message], room: int) -> int:
        """The first turn to keep: the remembered one if the turns from it fit `room` by their own
        tokens, else the earliest user turn from which they fit (all of them), else the earliest
        from which they fit `TRIM_TO` of it."""
        room -= sum(self._count(m.content) for m in [*head, turns[-1]])
        fits = trimmed = len(turns) - 1
        used = 0
        for i in range(len(turns) - 2, -1, -1):
            used += self._count(turns[i].content)
            if used > room:
                break
            if turns[i].role == "user":
                fits = i
                if used <= TRIM_TO * room:
                    trimmed = i
        if fits == 0:
            return 0
        if self._first is not None:
            index, message = self._first
            if fits <= index < len(turns) - 1 and turns[index] == message:
                return index
        return trimmed

    def build(
        self,
        messages: list[Message],
        *,
        context: int | None,
        reserve: int,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[int, list[int]]:
        """The prompt for the conversation `messages` (an optional system prompt, then turns
        alternating from the oldest, ending with the user's).

        Returns:
            How many of the oldest messages were left out, and the prompt's token ids.

        Raises:
            ContextLengthError, TemplateLimitError, ChatTemplateError, UnknownTokenError: see
                `fit_to_context`.
            TextError: a turn is not valid UTF-8.
        """
        head = messages[:1] if messages and messages[0].role == "system" else []
        turns = messages[len(head) :]
        start = 0 if context is None else self._start(head, turns, context - reserve)
        limits = RenderLimits(self.seconds, self.size, cancelled)
        kept, ids = fit_to_context(
            self.tokenizer,
            head + turns[start:],
            context=context,
            reserve=reserve,
            raw=self.raw,
            vocab_size=self.vocab_size,
            limits=limits,
        )
        first = len(messages) - len(kept) + len(head)
        self._first = (first - len(head), messages[first]) if first < len(messages) - 1 else None
        self._kept = kept
        return len(messages) - len(kept), ids

    def history(self, reply: Message, cancelled: Callable[[], bool] = lambda: False) -> list[int]:
        """The token ids the next prompt will start with while the conversation fits: the last
        prompt's messages and its `reply`, without the template's opening of an assistant turn
        (see `Decoder.read_ahead`). The reply is tokenised as the next prompt will tokenise it,
        which need not be how the model emitted it.

        Raises:
            ChatTemplateError, TemplateLimitError, UnknownTokenError, TextError: see `prompt_ids`.
        """
        return prompt_ids(
            self.tokenizer,
            [*self._kept, reply],
            raw=self.raw,
            vocab_size=self.vocab_size,
            limits=RenderLimits(self.seconds, self.size, cancelled),
            generation_prompt=False,
        )
