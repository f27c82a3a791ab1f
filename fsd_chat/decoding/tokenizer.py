"""`Tokenizer`: what fsd-chat uses of a tokenizer, whatever engine runs the models.

The decoding loop, the chat template's render (`fsd_chat.models.chat_template`), the vocabulary
checks and the commands take this protocol, never a class of an engine. Two implementations meet it:

- transformers' tokenizers (`PreTrainedTokenizerBase`), structurally: the members below are named
  and called as transformers names them, so the transformers engine hands its tokenizer on as it
  is (no wrapper on the per-token decode) and code written against transformers' tokenizers keeps
  working. Its annotations are wider (a batch decodes to `list[str]`), so the engine casts it once
  where it loads it (`fsd_chat.models.transformers_loading`).
- `fsd_chat.engines.llama_cpp_tokenizer.LlamaCppTokenizer`: llama.cpp's own tokenizer and the GGUF
  file's chat template, for the llama.cpp engine, which imports no transformers.

It sits with the decoding loop (like `fsd_chat.decoding.protocol.Decoder` and
`fsd_chat.decoding.runner.ModelRunner`): an engine-neutral contract every layer above may rely on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class TokenRecord(Protocol):
    """An added token (`Tokenizer.added_tokens_decoder`): transformers' `AddedToken`, or llama.cpp's
    control and user-defined tokens."""

    @property
    def content(self) -> str:
        """The token's text."""
        ...

    @property
    def special(self) -> bool:
        """A control token (BOS, EOS, a chat template's turn markers): skipped when a reply is
        decoded, and never made from text a user typed (`fsd_chat.models.chat_template`)."""
        ...


class Tokenizer(Protocol):
    """Text <-> token ids, the vocabulary, and the chat template a model's tokenizer carries."""

    @property
    def name_or_path(self) -> str:
        """Where the tokenizer was read from (a model folder, a Hub id, a GGUF file): for messages."""
        ...

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token's id (None: none)."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token's id (None: none); a model may end a reply at others too."""
        ...

    @property
    def pad_token_id(self) -> int | None:
        """The padding token's id (None: none)."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template (None: a base model, whose prompts are plain text)."""
        ...

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens' texts ("bos_token": "<s>", ...): variables of the chat template."""
        ...

    @property
    def added_tokens_decoder(self) -> Mapping[int, TokenRecord]:
        """The added tokens by id (control tokens among them): what a chat template's render keeps
        user text from forging (`fsd_chat.models.chat_template`)."""
        ...

    def __len__(self) -> int:
        """The vocabulary's size in tokens, added tokens included."""
        ...

    def encode(
        self, text: str, *, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """The token ids of `text`.

        Args:
            text: Any text.
            add_special_tokens: Add what the tokenizer adds around a text (a BOS token, for most).
            split_special_tokens: Encode a special token's text found in `text` as the characters
                it is made of (False: as the special token itself).
        """
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`: an incomplete UTF-8 character at the end comes out as U+FFFD
        (`fsd_chat.decoding.detokenize` holds it back). `skip_special_tokens`: leave control tokens
        out."""
        ...

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id for the whole vocabulary (the tokenizer's own spelling of each token:
        SentencePiece's `▁` for a space, byte-level BPE's `Ġ`)."""
        ...


def encode_within(tokenizer: Tokenizer, text: str, *, split_special_tokens: bool = False) -> list[int]:
    """The ids of `text` as a longer text holds it, not at its start: encoded after a newline whose
    ids are then cut off, since a SentencePiece tokenizer (llama.cpp's and transformers' alike) adds
    a prefix space at a text's start but not after a newline. Where the newline merges with what
    follows it, `text` encoded on its own. No special tokens are added around it."""
    newline = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode("\n" + text, add_special_tokens=False, split_special_tokens=split_special_tokens)
    if ids[: len(newline)] == newline:
        return ids[len(newline) :]
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens)
