"""llama.cpp's own tokenizer as a `fsd_chat.decoding.tokenizer.Tokenizer`: the GGUF file's vocabulary
as llama.cpp reads it, and the file's chat template (rendered by `fsd_chat.models.chat_template`), so
that the llama.cpp engine needs no transformers at all (no tokenizer built from the file, no cache).

What it maps to (llama.h): `encode` is `llama_tokenize` (`add_special`: a BOS where the vocabulary
adds one; `parse_special`: control tokens typed in the text made into tokens, unless
`split_special_tokens`); `decode` is `llama_detokenize` (`remove_special`, `unparse_special`: a
SentencePiece vocabulary's leading space removed as llama.cpp removes it), its bytes decoded with
U+FFFD for an incomplete character; the ids, texts and attributes of tokens are
`llama_vocab_*`. It splits some texts differently from transformers' tokenizer built from the
same file (docs/engines.md says where): it is what llama.cpp's own users get.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fsd_chat.engines.llama_cpp import llama_cpp_module


@dataclass(frozen=True, slots=True)
class LlamaToken:
    """An added token of a llama.cpp vocabulary (`Tokenizer.added_tokens_decoder`)."""

    content: str
    special: bool


class LlamaCppTokenizer:
    """The tokenizer of a GGUF file loaded by llama.cpp (a `Tokenizer`).

    Args:
        llama: The `llama_cpp.Llama` of the file (`fsd_chat.engines.llama_cpp.open_gguf`).
    """

    def __init__(self, llama: Any) -> None:
        lib = self._lib = llama_cpp_module()
        self._llama = llama  # the model owns the vocabulary: kept alive while this points into it
        self._vocab = lib.llama_model_get_vocab(llama.model)
        self._size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.name_or_path = str(llama.model_path)
        self.chat_template: str | None = llama.metadata.get("tokenizer.chat_template") or None
        self.bos_token_id = self._token(lib.llama_vocab_bos(self._vocab))
        self.eos_token_id = self._token(lib.llama_vocab_eos(self._vocab))
        self.pad_token_id = self._token(lib.llama_vocab_pad(self._vocab))
        self._UNKNOWN = lib.LLAMA_TOKEN_ATTR_UNKNOWN
        self._CONTROL = lib.LLAMA_TOKEN_ATTR_CONTROL | self._UNKNOWN
        self._ADDED = self._CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED

    def _token(self, token_id: int) -> int | None:
        return None if token_id < 0 or token_id >= self._size else int(token_id)

    def __len__(self) -> int:
        return self._size

    def _text(self, token_id: int) -> str:
        return bytes(self._lib.llama_vocab_get_text(self._vocab, token_id)).decode("utf-8", errors="replace")

    @cached_property
    def special_tokens_map(self) -> dict[str, str]:
        """See `Tokenizer.special_tokens_map`: bos_token, eos_token, unk_token, pad_token, where the
        vocabulary has them (read once: every render of the chat template passes them)."""
        named = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": next((i for i, a in enumerate(self._attributes) if a & self._UNKNOWN), None),
            "pad_token": self.pad_token_id,
        }
        return {name: self._text(token_id) for name, token_id in named.items() if token_id is not None}

    @cached_property
    def _attributes(self) -> list[int]:
        # Asked once (49,152 calls for SmolLM2: milliseconds), when a template first renders.
        return [int(self._lib.llama_vocab_get_attr(self._vocab, i)) for i in range(self._size)]

    @cached_property
    def added_tokens_decoder(self) -> dict[int, LlamaToken]:
        """See `Tokenizer.added_tokens_decoder`: llama.cpp's control, unknown and user-defined tokens,
        the first two special."""
        return {
            i: LlamaToken(self._text(i), bool(attr & self._CONTROL))
            for i, attr in enumerate(self._attributes)
            if attr & self._ADDED
        }

    def encode(
        self, text: str, *, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """See `Tokenizer.encode` (`llama_tokenize`)."""
        data = text.encode("utf-8")
        room = len(data) + 8  # a token covers a byte or more; BOS, EOS and a prefix space besides
        for _ in range(2):
            tokens = (self._lib.llama_token * room)()
            count = self._lib.llama_tokenize(
                self._vocab, data, len(data), tokens, room, add_special_tokens, not split_special_tokens
            )
            if count >= 0:
                return list(tokens[:count])
            room = -count
        raise RuntimeError(f"llama_tokenize failed on {len(data)} bytes of text")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """See `Tokenizer.decode` (`llama_detokenize`)."""
        if not token_ids:
            return ""
        tokens = (self._lib.llama_token * len(token_ids))(*token_ids)
        room = 16 * len(token_ids) + 16
        for _ in range(2):
            buffer = ctypes.create_string_buffer(room)
            count = self._lib.llama_detokenize(
                self._vocab,
                tokens,
                len(token_ids),
                buffer,
                room,
                skip_special_tokens,
                not skip_special_tokens,
            )
            if count >= 0:
                return buffer.raw[:count].decode("utf-8", errors="replace")
            room = -count
        raise RuntimeError(f"llama_detokenize failed on {len(token_ids)} tokens")

    @cached_property
    def _vocabulary(self) -> dict[str, int]:
        return {self._text(i): i for i in range(self._size)}

    def get_vocab(self) -> dict[str, int]:
        """See `Tokenizer.get_vocab` (`llama_vocab_get_text`: the file's token strings)."""
        return dict(self._vocabulary)

    def token_pieces(self) -> list[tuple[bytes, bool]]:
        """The bytes each token stands for (a byte token: its byte; a control token: none) and
        whether it is a byte token (`llama_token_to_piece`), by id: what a draft of another
        vocabulary is mapped by (`fsd_chat.decoding.vocab_map`)."""
        byte = self._lib.LLAMA_TOKEN_ATTR_BYTE
        buffer = ctypes.create_string_buffer(256)
        pieces = []
        for i, attr in enumerate(self._attributes):
            count = self._lib.llama_token_to_piece(self._vocab, i, buffer, 256, 0, False)
            pieces.append((buffer.raw[: max(count, 0)], bool(attr & byte)))
        return pieces
