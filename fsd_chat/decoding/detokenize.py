"""Incremental detokenisation: text for each new token such that the pieces concatenate to
`tokenizer.decode(all ids)`.

Decoding one token at a time is wrong for byte-fallback tokens (a multi-byte character spans
several tokens) and for tokenizers whose decoders depend on neighbours (SentencePiece's leading
space). The method of Hugging Face text-generation-inference and vLLM: decode a short window that
ends at the new token and a window that ends before it, emit the difference, and hold it back while
it ends in U+FFFD (an incomplete UTF-8 sequence).
"""

from __future__ import annotations

from fsd_chat.decoding.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    `push(id)` returns the text the token completes ("" while a character is incomplete); after the
    last token, `flush()` returns whatever is still held back so that the pieces add up to
    `tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it adds."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            delta = after[len(before) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self._emitted.append(delta)
            return delta
        return ""

    def flush(self) -> str:
        """Text still owed so that everything emitted equals the full decode."""
        full = self._decode(self.ids)
        emitted = "".join(self._emitted)
        rest = full[len(emitted) :] if full.startswith(emitted) else ""
        if rest:
            self._emitted.append(rest)
        return rest
