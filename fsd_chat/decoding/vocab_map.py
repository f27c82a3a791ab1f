"""A draft's vocabulary mapped onto the target's: the token-level intersection of Timor et al.,
"Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies" (ICML 2025, §3.3, "TLI"), as transformers' `AssistantToTargetTranslator` builds it.

Two tokens correspond when they stand for the same bytes of text. llama.cpp's tokenizer says which
bytes each token stands for (`TokenPieces`). transformers' tokenizers spell bytes their own way,
read from their `tokenizers` decoder: SentencePiece writes a space as `▁` and a byte it has
no piece for as a byte-fallback token `<0xNN>`; byte-level BPE (GPT-2, Llama 3, Qwen) writes every
byte as one printable character (`Ġ` for a space). A SentencePiece vocabulary holds some bytes
twice (`A` and `<0x41>`): text tokens pair with text tokens and byte tokens with byte tokens, and
what is left of a byte string on each side pairs up (`Ċ` with `<0x0A>`). Special tokens pair by
their text, or else by role (BOS, EOS, UNK, PAD).

The draft's distribution restricted to the paired tokens, renormalised and moved to the target's
ids, is a proposal law over the target's vocabulary like any other (see `MappedDraft`): exact
speculative decoding stays lossless, and every rule's cost stays exact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol, runtime_checkable

import torch

from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.tokenizer import Tokenizer, encode_within

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ROLES = ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id")

CALIBRATION_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
    'One day, she saw a big red ball in the park and asked her mom, "Can I play with it?" '
    "Her mom smiled and said yes. Lily ran and jumped, and they laughed all day long."
)
"""Text on which `coverage` measures the share of the target's probability mass the intersection
holds: plain English prose in the style of the offline models' TinyStories."""


@dataclass(frozen=True, slots=True)
class Spelling:
    """How a tokenizer writes bytes of text into token strings (read from its decoder).

    Attributes:
        byte_level: Every byte is one character of GPT-2's byte-to-unicode alphabet.
        space: The character written for a space (SentencePiece's `▁`), or None.
        byte_fallback: `<0xNN>` tokens stand for single bytes.
    """

    byte_level: bool
    space: str | None
    byte_fallback: bool

    def to_bytes(self, token: str) -> tuple[bytes, bool]:
        """The bytes a token string stands for, and whether it is a byte-fallback token."""
        if self.byte_fallback and (found := _BYTE_TOKEN.fullmatch(token)):
            return bytes([int(found.group(1), 16)]), True
        if self.byte_level:
            decoder = _byte_decoder()
            if all(c in decoder for c in token):
                return bytes(decoder[c] for c in token), False
        if self.space is not None:
            token = token.replace(self.space, " ")
        return token.encode("utf-8"), False

    def to_token_text(self, text: bytes) -> str | None:
        """`text` spelled as this tokenizer's model reads it (None: not valid UTF-8 and not
        byte-level, so only byte tokens can spell it)."""
        if self.byte_level:
            encoder = _byte_encoder()
            return "".join(encoder[b] for b in text)
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return decoded.replace(" ", self.space) if self.space is not None else decoded


@cache
def _byte_encoder() -> dict[int, str]:
    # Only a transformers tokenizer is byte-level spelled (llama.cpp's says its bytes itself).
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


@cache
def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in _byte_encoder().items()}


@runtime_checkable
class TokenPieces(Protocol):
    """A tokenizer that says which bytes each of its tokens stands for (llama.cpp's:
    `fsd_chat.engines.llama_cpp_tokenizer.LlamaCppTokenizer.token_pieces`)."""

    def token_pieces(self) -> list[tuple[bytes, bool]]:
        """By id: the bytes the token stands for, and whether it is a byte token."""
        ...


def spelling(tokenizer: Tokenizer) -> Spelling | None:
    """The tokenizer's `Spelling`, from its `tokenizers` decoder (None: it has no `tokenizers`
    backend, so its token strings cannot be read as bytes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = backend.decoder
    steps = _decoder_steps(json.loads(decoder.__getstate__())) if decoder is not None else []
    space = None
    for step in steps:
        if step.get("type") == "Metaspace":
            space = step.get("replacement", "▁")
        elif step.get("type") == "Replace" and step.get("content") == " ":
            space = step.get("pattern", {}).get("String") or space
    return Spelling(
        byte_level=any(s.get("type") == "ByteLevel" for s in steps),
        space=space,
        byte_fallback=any(s.get("type") == "ByteFallback" for s in steps),
    )


def _decoder_steps(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _decoder_steps(d)]
    return [decoder]


class _Vocabulary:
    """One tokenizer's ids below `size`, keyed by the bytes they stand for (a text slot and a
    byte-token slot per byte string) and, for special tokens, by their text; and how it encodes the
    bytes of a text it has no token for (`spell`).

    Raises:
        ValueError: the tokenizer neither says its tokens' bytes nor has a `tokenizers` backend.
    """

    def __init__(self, tokenizer: Tokenizer, size: int) -> None:
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        if isinstance(tokenizer, TokenPieces):
            pieces = tokenizer.token_pieces()
            self._spelling = None
            self._tokenizer = tokenizer
        else:
            how = spelling(tokenizer)
            if how is None:
                raise ValueError("a tokenizer without a `tokenizers` backend cannot be mapped")
            self._spelling = how
            self._model = tokenizer.backend_tokenizer.model  # type: ignore[attr-defined]
        self.by_bytes: dict[bytes, list[int | None]] = {}
        self.specials: dict[str, int] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id >= size:
                continue
            if token_id in special:
                self.specials[token] = token_id
                continue
            text, is_byte = pieces[token_id] if self._spelling is None else self._spelling.to_bytes(token)
            self.by_bytes.setdefault(text, [None, None])[is_byte] = token_id
        self.roles = {role: getattr(tokenizer, role, None) for role in _ROLES}

    def spell(self, text: bytes) -> tuple[int, ...] | None:
        """This tokenizer's ids for `text` (None: not valid UTF-8, and not byte-level spelled, so only
        byte tokens can spell it)."""
        if self._spelling is not None:
            spelled = self._spelling.to_token_text(text)
            return None if spelled is None else tuple(token.id for token in self._model.tokenize(spelled))
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return tuple(encode_within(self._tokenizer, decoded, split_special_tokens=True))


def _pair(target: _Vocabulary, draft: _Vocabulary) -> dict[int, int]:
    """Target id -> draft id for every pair of corresponding tokens (one-to-one)."""
    pairs: dict[int, int] = {}
    for text in target.by_bytes.keys() & draft.by_bytes.keys():
        t_slots, d_slots = target.by_bytes[text], draft.by_bytes[text]
        t_left, d_left = [], []
        for t_id, d_id in zip(t_slots, d_slots, strict=True):
            if t_id is not None and d_id is not None:
                pairs[t_id] = d_id
            elif t_id is not None:
                t_left.append(t_id)
            elif d_id is not None:
                d_left.append(d_id)
        pairs.update(zip(t_left, d_left, strict=False))
    for name in target.specials.keys() & draft.specials.keys():
        pairs[target.specials[name]] = draft.specials[name]
    taken = set(pairs.values())
    for role, t_id in target.roles.items():
        d_id = draft.roles[role]
        if isinstance(t_id, int) and isinstance(d_id, int) and t_id not in pairs and d_id not in taken:
            pairs[t_id] = d_id
            taken.add(d_id)
    return pairs


class VocabularyMap:
    """The correspondence between a target's and a draft's vocabularies.

    Args:
        target_tokenizer: The target's tokenizer.
        draft_tokenizer: The draft's tokenizer.
        target_vocab: Target ids below this are mapped (the target's usable vocabulary size).
        draft_vocab: Draft ids below this are mapped.

    Attributes:
        target_ids: Target ids of the paired tokens, shape [m] int64 (CPU).
        draft_ids: The draft ids paired with them, shape [m] int64 (CPU).
        target_vocab: The target's vocabulary size.
        draft_vocab: The draft's vocabulary size.

    Raises:
        ValueError: a tokenizer neither says its tokens' bytes nor has a `tokenizers` backend, so
            its strings cannot be compared.
    """

    def __init__(
        self,
        target_tokenizer: Tokenizer,
        draft_tokenizer: Tokenizer,
        target_vocab: int,
        draft_vocab: int,
    ) -> None:
        self.target_vocab, self.draft_vocab = target_vocab, draft_vocab
        target = _Vocabulary(target_tokenizer, target_vocab)
        draft = _Vocabulary(draft_tokenizer, draft_vocab)
        self._pairs = _pair(target, draft)
        self.shared_text = sum(1 for t in self._pairs if t not in target.specials.values())
        """Paired tokens that stand for text (special tokens left out)."""
        ordered = sorted(self._pairs.items())
        self.target_ids = torch.tensor([t for t, _ in ordered], dtype=torch.long)
        self.draft_ids = torch.tensor([d for _, d in ordered], dtype=torch.long)
        self._target_bytes = {
            i: text for text, slots in target.by_bytes.items() for i in slots if i is not None
        }
        # A draft id per byte string (its text token first) and per single byte (its byte token).
        self._draft_by_bytes = {
            text: next(i for i in slots if i is not None) for text, slots in draft.by_bytes.items()
        }
        self._draft = draft
        self._translations: dict[int, tuple[int, ...]] = {}

    @property
    def size(self) -> int:
        """Number of paired tokens (m)."""
        return len(self._pairs)

    def translate(self, target_ids: list[int]) -> list[int]:
        """The draft's ids for a run of target tokens: each token's partner, else the draft's
        tokenisation of the bytes it stands for (nothing for an unpaired special token).
        Cached per target id, so a reply's tokens take a dictionary look-up each."""
        out: list[int] = []
        for token_id in target_ids:
            found = self._translations.get(token_id)
            if found is None:
                found = self._translations[token_id] = self._spell(token_id)
            out += found
        return out

    def _spell(self, token_id: int) -> tuple[int, ...]:
        if token_id in self._pairs:
            return (self._pairs[token_id],)
        text = self._target_bytes.get(token_id)
        if text is None:  # an unpaired special token: the draft does not see it
            return ()
        if text in self._draft_by_bytes:
            return (self._draft_by_bytes[text],)
        spelled = self._draft.spell(text)
        if spelled is None:  # part of a UTF-8 character: the draft's byte tokens, where it has them
            return tuple(self._draft_by_bytes[bytes([b])] for b in text if bytes([b]) in self._draft_by_bytes)
        return spelled


def map_vocabularies(
    target_tokenizer: Tokenizer,
    draft_tokenizer: Tokenizer,
    target_vocab: int,
    draft_vocab: int,
) -> VocabularyMap | None:
    """The `VocabularyMap` of a pair, or None when no token of text corresponds (or a tokenizer's
    strings cannot be read as bytes): such a pair cannot be mapped at all."""
    try:
        mapping = VocabularyMap(target_tokenizer, draft_tokenizer, target_vocab, draft_vocab)
    except ValueError:
        return None
    return mapping if mapping.shared_text else None


@torch.inference_mode()
def coverage(model: ModelRunner, tokenizer: Tokenizer, mapping: VocabularyMap) -> float:
    """The share of the target's probability mass on paired tokens, averaged over the positions
    of `CALIBRATION_TEXT` (temperature 1): an upper bound on the exact rule's acceptance rate,
    since Σ min(p, q) ≤ Σ_{paired} p when q lives on the paired tokens. One forward pass of the
    target's runner, over an emptied KV cache, emptied again after.

    Returns:
        The share in [0, 1].
    """
    ids = torch.tensor([tokenizer.encode(CALIBRATION_TEXT)], device=model.device)
    model.reset()
    logits = model.forward(ids, ids.shape[1], keep=ids.shape[1])[:, : mapping.target_vocab].clone()
    model.reset()
    probs = logits.softmax(-1)
    return float(probs[:, mapping.target_ids.to(probs.device)].sum(-1).mean())
