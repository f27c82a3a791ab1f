"""The request bodies the server takes: the fields of OpenAI's chat and text completions that matter
for a local model, and fsd-chat's own `fsd` object (the dial per request). Fields other clients send
and a local model has no use for (user, metadata, ...) are ignored; those whose request a plain-text
reply would silently fail (`n` other than 1, tools, structured output, `echo`) are refused, naming
the field.

Types are strict (pydantic's strict mode): `max_tokens: true`, `stream: "yes"` or `threshold: "0.3"`
are refused, not coerced into something the client did not mean (an integer is still a number).

Values are checked where the command line checks them (`DecodingSettings`, `SamplingRequest`,
`check_max_new_tokens`), when the request is turned into a job (`fsd_chat.server.app`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fsd_chat.decoding.settings import check_max_new_tokens

MAX_STOP_STRINGS = 4
"""Most stop strings a request may give (OpenAI's limit)."""


class FsdOptions(BaseModel):
    """The dial per request (`extra_body={"fsd": {...}}` in OpenAI's Python client): what is not
    given is the server's command-line setting.

    Attributes:
        rule: exact, fuzzy, pure or mixture (see `DecodingSettings`).
        threshold: T ≥ 0 (divergence units; nats per token for mixture).
        divergence: kl, reverse-kl, js or tv.
        draft_tokens: Draft length k.
        draft_policy: fixed, heuristic or latency.
        origins: Add each token's origin, divergence and cost to the reply (`fsd_tokens`).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    rule: str | None = None
    threshold: float | None = None
    divergence: str | None = None
    draft_tokens: int | None = None
    draft_policy: str | None = None
    origins: bool = False


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk carrying `usage`."""

    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class CompletionFields(BaseModel):
    """The fields both endpoints take. `model` may name anything (or be left out): one model is
    served, and clients with a fixed model name work as they do with llama-server."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    fsd: FsdOptions | None = None
    # Refused rather than ignored: a reply without them is not what the client asked for.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    # Refused unless neutral: the rules accept draft tokens against the target's own law, and a
    # penalised or biased law would need its own (clients that send 0 and {} by default still work).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError(
                "penalties are not supported: replies follow the target's own law (leave it out, or send 0)"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and any(value.values()):
            raise ValueError(
                "logit_bias is not supported: replies follow the target's own law (leave it out)"
            )
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tool calls are not supported: fsd-chat replies in plain text (leave it out)")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise ValueError("tool calls are not supported: fsd-chat replies in plain text (leave it out)")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(
                f"structured output ({value.get('type')!r}) is not supported: fsd-chat replies in "
                'plain text (leave it out, or send {"type": "text"})'
            )
        return value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        # The command line's rule for --max-new-tokens; its SettingsError is a ValueError.
        return None if value is None else check_max_new_tokens(value)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n = 1 is supported: one reply decodes at a time")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop string is empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (empty when none)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def token_cap(self) -> int | None:
        """The cap on the reply's tokens asked for (None: the server's)."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a streamed reply ends with a chunk carrying `usage`."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def origins(self) -> bool:
        """Whether each token's origin and cost are asked for."""
        return self.fsd is not None and self.fsd.origins


class TextPart(BaseModel):
    """One part of a message's content given as a list (only text parts are taken)."""

    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn. A `developer` message is a system prompt (OpenAI's newer name for it)."""

    model_config = ConfigDict(strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The content as one text (list parts joined, None as "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(CompletionFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, value: int | None) -> int | None:
        return None if value is None else check_max_new_tokens(value)

    def token_cap(self) -> int | None:
        """`max_completion_tokens` (OpenAI's newer name), else `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def origins(self) -> bool:
        """Whether each token's origin and cost are asked for (`fsd.origins`, or `logprobs`, which
        fsd-chat answers with origins and costs instead of log-probabilities)."""
        return self.logprobs or super().origins


class CompletionRequest(CompletionFields):
    """`POST /v1/completions`: the prompt continued as plain text (no chat template)."""

    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported: the reply holds the continuation alone")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of = 1 is supported: one reply decodes at a time")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill in the middle) is not supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"give one prompt (a batch of {len(value)} is not supported)")
        return value

    def text(self) -> str:
        """The prompt."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def origins(self) -> bool:
        """Whether each token's origin and cost are asked for (`fsd.origins` or `logprobs`)."""
        return self.logprobs is not None or super().origins
