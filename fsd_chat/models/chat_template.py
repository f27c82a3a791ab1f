"""Conversations -> prompt token ids.

Chat models get the conversation through the tokenizer's own chat template, rendered here as
transformers' `apply_chat_template(..., sanitize_control_tokens=True)` renders it (`render_ids`), on
either engine: transformers is not needed for it. Base models (no template, like stories260K) and raw mode get the turns as
plain text, one after another: a base model simply continues the text.

A chat template is code from outside. In the chat it is first rendered under limits (`RenderLimits`:
time, size, a cancel flag) by a sandboxed Jinja environment that checks them at every call,
attribute access, `range` step, arithmetic operator and output chunk. That render is the only one.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace

from fsd_chat.decoding.tokenizer import encode_within
from fsd_chat.support.errors import ContextLengthError, FsdChatError
from fsd_chat.support.text import require_utf8

if TYPE_CHECKING:
    from jinja2 import Template
    from jinja2.parser import Parser

    from fsd_chat.decoding.tokenizer import Tokenizer

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


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's text with it, for
    training masks): renders what it holds."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(Namespace):
    """`namespace()` refusing underscore-prefixed attributes (transformers' `TemplateNamespace`: no
    way into CPython's internals through one)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set the underscore-prefixed attribute {name!r}")


class _Dict:
    """`dict()` in a template, without the type itself (no attribute access to it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; a prompt wants the JSON as it is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> _BoundedEnvironment:
    """What transformers 5.24 gives a chat template (`chat_template_utils._compile_jinja_template`):
    trim_blocks, lstrip_blocks, loop controls, `{% generation %}`, the `tojson` filter and
    `raise_exception`, `strftime_now`, `dict` and `namespace`; and our budget (`range` checked)."""
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
        range=_CheckedRange,
    )
    return env


@lru_cache(maxsize=4)
def _bounded_template(source: str) -> Template:
    # Compiled by the bounded environment itself, whose intercepted operators are not folded into
    # constants (a constant 'A' * 10**9 would be built before any limit applies).
    return _environment().from_string(source)


CONTROL_START = "\U000f0000"
CONTROL_END = "\U000f0001"
"""Private-use characters put around a control token typed in message text before the render
(transformers' markers), so that the encoder tells it from the template's own control tokens."""


@lru_cache(maxsize=4)
def _literal_text(source: str) -> str:
    """The template's literal strings (its text and string constants), joined by NULs: an added token
    found in them is a control token (transformers' `_get_template_literal_text`)."""
    ast = _environment().parse(source)
    literals = {node.data for node in ast.find_all(nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


def control_tokens(tokenizer: Tokenizer, source: str) -> tuple[str, ...]:
    """The tokens that typed in message text are encoded as text (transformers'
    `_get_control_tokens`): the special added tokens, the tokenizer's `chat_control_tokens` if it
    lists them, else the added tokens the template `source` writes (whitespace ones aside)."""
    added = tokenizer.added_tokens_decoder.values()
    listed = getattr(tokenizer, "chat_control_tokens", None)
    if listed is not None:
        return tuple(t.content for t in added if t.special or t.content in set(listed))
    literal = _literal_text(source)
    return tuple(t.content for t in added if t.special or (t.content in literal and not t.content.isspace()))


@lru_cache(maxsize=8)
def _control_patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """A pattern of any of `tokens` (the longest first), and one of a marked token or a lone marker."""
    longest_first = sorted(tokens, key=len, reverse=True)
    any_token = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
    marked = re.compile(f"{CONTROL_START}({any_token.pattern}){CONTROL_END}|[{CONTROL_START}{CONTROL_END}]")
    return any_token, marked


def _mark(text: str, any_token: re.Pattern[str]) -> str:
    # Markers already in the text go first: they cannot forge a marked token.
    text = text.replace(CONTROL_START, "").replace(CONTROL_END, "")
    return any_token.sub(f"{CONTROL_START}\\g<0>{CONTROL_END}", text)


def _encode_marked(tokenizer: Tokenizer, text: str, marked: re.Pattern[str]) -> list[int]:
    """The ids of a rendered prompt (transformers' `encode_marked_chat`): a marked control token as
    the characters it is made of, the rest (the template's own control tokens) as it is. A lone
    marker (a template's `split()` cut one off) is dropped but still breaks the text."""
    pieces: list[str | None] = marked.split(text)
    ids = tokenizer.encode(pieces[0] or "", add_special_tokens=False)
    # Read once, and only where a token was marked (a copy of the whole vocabulary).
    vocabulary = tokenizer.get_vocab() if len(pieces) > 1 else {}
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        as_text = i % 2 == 1  # the odd pieces are the marked tokens
        piece_ids = encode_within(tokenizer, piece, split_special_tokens=as_text)
        if as_text and vocabulary.get(piece) in piece_ids:
            raise ValueError(f"cannot keep {piece!r} as text: the tokenizer makes the token of it from text")
        ids += piece_ids
    return ids


def template_source(tokenizer: Tokenizer) -> str | None:
    """The tokenizer's chat template (a folder's several named ones: its "default"); None: none."""
    template: str | dict[str, str] | None = tokenizer.chat_template
    if isinstance(template, dict):
        return template.get("default")
    return template or None


def render_ids(
    tokenizer: Tokenizer,
    conversation: list[dict[str, str]],
    *,
    generation_prompt: bool,
    limits: RenderLimits | None,
) -> list[int]:
    """The tokenizer's chat template rendered over `conversation` by our sandboxed environment, then
    encoded: the one render of a template, on either engine, as transformers'
    `apply_chat_template(..., sanitize_control_tokens=True)` renders and encodes it (the same ids:
    `tests/test_chat_template_render.py`). A control token typed in a turn's text is encoded as its
    characters, never as the token.

    Args:
        tokenizer: The tokenizer whose template and vocabulary are used.
        conversation: {"role", "content"} turns.
        generation_prompt: End with the template's opening of an assistant turn.
        limits: Bounds of the render (None: none).

    Raises:
        TemplateLimitError: a limit was passed, or the render was cancelled.
        jinja2.TemplateError: the template itself failed (e.g. `raise_exception`, the sandbox).
        ValueError: a typed control token cannot be kept as text.
    """
    source = template_source(tokenizer)
    assert source is not None
    any_token, marked = _control_patterns(control_tokens(tokenizer, source))
    messages = [{key: _mark(value, any_token) for key, value in turn.items()} for turn in conversation]
    budget = _Budget(limits) if limits is not None else None
    token = _BUDGET.set(budget)
    try:
        chunks: list[str] = []
        rendered = 0
        for chunk in _bounded_template(source).generate(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=generation_prompt,
            **tokenizer.special_tokens_map,
        ):
            chunks.append(chunk)
            if budget is not None:
                rendered += len(chunk)
                budget.check()
                if rendered > budget.limits.size:
                    raise TemplateLimitError(
                        f"the chat template wrote over {budget.limits.size:,} characters"
                    )
    finally:
        _BUDGET.reset(token)
    return _encode_marked(tokenizer, "".join(chunks), marked)


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


def template_file(tokenizer: Tokenizer) -> str:
    """Where the tokenizer's chat template comes from, for messages: `chat_template.jinja` in the
    model folder when it has one (transformers prefers it), else its `tokenizer_config.json` (or
    the Hub id); a GGUF file's `tokenizer.chat_template` key."""
    folder = Path(tokenizer.name_or_path)
    if folder.is_file():  # a GGUF file: its metadata holds the template
        return f"{folder} (tokenizer.chat_template)"
    if not folder.is_dir():
        return f"{tokenizer.name_or_path} (tokenizer_config.json)"
    jinja = folder / "chat_template.jinja"
    return str(jinja if jinja.is_file() else folder / "tokenizer_config.json")


def has_chat_template(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer carries a chat template (an instruction-tuned model)."""
    return template_source(tokenizer) is not None


def prompt_ids(
    tokenizer: Tokenizer,
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
        limits: Render the chat template under these limits (see `RenderLimits`; None: none).
        generation_prompt: End with the template's opening of an assistant turn; False: the
            conversation alone (what the prompt after the next user turn starts with).

    Raises:
        TextError: a turn holds text that is not valid UTF-8.
        ChatTemplateError: the chat template failed (one line naming its file).
        UnknownTokenError: a token id of the prompt is not below `vocab_size`.
        TemplateLimitError: see `render_ids`.
    """
    for m in messages:
        require_utf8(m.content, f"the {m.role} message")
    if has_chat_template(tokenizer) and not raw:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            ids = render_ids(tokenizer, conversation, generation_prompt=generation_prompt, limits=limits)
        # A template is a program from the model folder: besides Jinja's own errors (its
        # raise_exception, syntax, the sandbox's SecurityError), its expressions raise what Python
        # raises (a recursive macro, range() over the sandbox's limit, 1 / 0, a missing key).
        except (TemplateError, RecursionError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ChatTemplateError(
                f"the chat template in {template_file(tokenizer)} failed: {type(exc).__name__}"
                f"{': ' + reason if reason else ''} (fix the template, or pass --raw to do without it)"
            ) from None
    else:
        text = "\n".join(m.content for m in messages if m.content)
        ids = tokenizer.encode(text, split_special_tokens=True)
    if vocab_size is not None:
        _check_vocabulary(tokenizer, ids, vocab_size)
    return ids


def _check_vocabulary(tokenizer: Tokenizer, ids: list[int], vocab_size: int) -> None:
    unknown = sorted({i for i in ids if i >= vocab_size})
    if unknown:
        names = ", ".join(f"{tokenizer.decode([i])!r} (id {i})" for i in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UnknownTokenError(
            f"the prompt holds the token {names}{more}, which the tokenizer has but the models do not "
            f"(their vocabulary is {vocab_size} tokens): reword the message, or fix the model's tokenizer"
        )


def fit_to_context(
    tokenizer: Tokenizer,
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
    tokenizer: Tokenizer,
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
        tokenizer: Tokenizer,
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
            ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
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
