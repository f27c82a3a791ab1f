"""Streamed text equals `tokenizer.decode(all ids)`, byte-fallback and multi-byte characters too."""

from __future__ import annotations

import pytest

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.detokenize import IncrementalDetokenizer
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect

TEXTS = [
    "Once upon a time, there was a café named Zoë 😀.\n\nThe end.  Two  spaces",
    "日本語のテキスト and 한국어 — ok?",
    "  leading spaces and trailing ones  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_pieces_add_up_to_the_full_decode(pair: ModelPair, text: str) -> None:
    ids = pair.tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(pair.tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == pair.tokenizer.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)
    # Byte-fallback tokens of one character give "" until the character is complete.
    if "😀" in text:
        assert "" in pieces


@pytest.mark.parametrize("max_new_tokens", [37, 150])
@pytest.mark.slow
def test_decoder_text_equals_decode_of_ids(pair: ModelPair, max_new_tokens: int) -> None:
    controls = Controls(DecodingSettings(threshold=0.3, draft_tokens=4))
    for seed in range(5):
        sampling = SamplingConfig(temperature=1.5, seed=seed)  # hot: odd tokens, byte pieces
        run = collect(
            pair.speculative(controls).generate([1], max_new_tokens=max_new_tokens, sampling=sampling)
        )
        assert run.text == pair.tokenizer.decode(run.ids, skip_special_tokens=True)
