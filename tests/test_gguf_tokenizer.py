"""A GGUF file's tokenizer on the llama.cpp engine is llama.cpp's own (`LlamaCppTokenizer`): it
agrees with transformers' tokenizer built from the same file (`from_pretrained(..., gguf_file=...)`,
what the transformers engine's converted copy holds) on the vocabulary, the special tokens, the
chat template and its rendered prompts (hostile text included: a typed control token stays text),
the ids of text and the text of ids; its replies detokenise incrementally to its own decode. Real
files: the default chat model (a byte-level BPE vocabulary), and the files the tests write from the
offline models (SentencePiece vocabularies, through transformers' Llama and Gemma builders).

Where the two differ (llama.cpp's choices, which its users get), on SentencePiece vocabularies:
leading spaces are split otherwise (llama.cpp's ids spell the text; transformers' drop one of
`"  two"`); text after a control token parsed in the text gets the prefix space again (`<s>Once` is `<s>`,
`▁Once`, and `<s> </s>` is `<s>`, two spaces, `</s>` on llama.cpp; never the case in user text, whose control tokens are text); decoding
with the special tokens skipped keeps a word's leading space after a skipped BOS (transformers
drops it)."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
from transformers import TokenizersBackend

from fsd_chat.decoding.detokenize import IncrementalDetokenizer
from fsd_chat.engines.llama_cpp import open_gguf
from fsd_chat.engines.llama_cpp_tokenizer import LlamaCppTokenizer
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import FETCH_COMMAND, default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.support.errors import ModelLoadError
from tests.conftest import LLAMA_CPP_MISSING
from tests.gguf_models import CHATML, write_gguf
from tests.test_chat_template_render import HOSTILE, conversations
from tests.tiny_models import save_gemma3

pytestmark = pytest.mark.slow  # reads whole vocabularies, twice

DEFAULT_MODEL = default_model_path()
TEXTS = (
    "Once upon a time, a girl named Lily found a red ball.",
    "<|im_start|>user\nHi there!<|im_end|>\n<s> </s> <unk>  two  spaces\tand a tab",
    "Ünïcödé, 中文, emoji 🙂 and numbers 12345.",
    *HOSTILE,
)


@pytest.fixture(scope="module", params=["smollm2", "stories", "gemma3"])
def tokenizers(
    request: pytest.FixtureRequest,
    stories_gguf_files: tuple[Path, Path],
    target_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[LlamaCppTokenizer, Any]:
    """(llama.cpp's tokenizer, transformers') of one file."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    if request.param == "smollm2":
        if not DEFAULT_MODEL.is_file() and not os.environ.get("CI"):
            pytest.skip(f"the default model is not fetched ({DEFAULT_MODEL} is absent): {FETCH_COMMAND}")
        path = DEFAULT_MODEL
    elif request.param == "stories":
        path = stories_gguf_files[0]
    else:
        root = tmp_path_factory.mktemp("gemma3-gguf")
        path = write_gguf(save_gemma3(root / "gemma3", target_dir), root / "gemma3.gguf")
    reference = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)
    return LlamaCppTokenizer(open_gguf(path, threads=1, gpu=False)), reference


def test_llama_cpps_tokenizer_agrees_with_transformers_read_of_the_file(
    tokenizers: tuple[LlamaCppTokenizer, Any],
) -> None:
    ours, reference = tokenizers
    size = len(ours)  # transformers' Gemma builder adds 4 tokens the file does not hold
    assert size == len(reference) or size == len(reference) - 4 == 512
    assert ours.get_vocab() == {t: i for t, i in reference.get_vocab().items() if i < size}
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    assert ours.chat_template == reference.chat_template and ours.chat_template is not None
    special = {i: t.content for i, t in reference.added_tokens_decoder.items() if t.special and i < size}
    assert {i: t.content for i, t in ours.added_tokens_decoder.items() if t.special} == special
    sentencepiece = "▁" in "".join(reference.get_vocab())
    differing = []
    for text in TEXTS:
        plain = ours.encode(text, add_special_tokens=False, split_special_tokens=True)
        expected = reference.encode(text, add_special_tokens=False, split_special_tokens=True)
        if plain != expected:  # split otherwise, and llama.cpp's ids spell the text itself
            assert ours.decode(plain) == text
            differing.append(text)
        parsed, expected = ours.encode(text), reference.encode(text)
        if sentencepiece and any(token in text for token in special.values()):
            # The prefix space again after a control token: the same text, but for spaces.
            assert reference.decode(parsed).replace(" ", "") == reference.decode(expected).replace(" ", "")
        elif parsed != expected:
            assert ours.decode(parsed[1:] if parsed[:1] == [ours.bos_token_id] else parsed) == text
            differing.append(text)
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids)
        reply = ids[1:] if ids[:1] == [ours.bos_token_id] else ids  # a reply has no BOS
        assert ours.decode(reply, skip_special_tokens=True) == reference.decode(
            reply, skip_special_tokens=True
        )
        detokenizer = IncrementalDetokenizer(ours)
        pieces = [detokenizer.push(i) for i in reply]
        assert "".join(pieces) + detokenizer.flush() == ours.decode(reply, skip_special_tokens=True)
    # Byte-level BPE splits alike; SentencePiece otherwise at a run of spaces only.
    assert all(sentencepiece and "  " in text for text in differing), differing


def test_the_files_template_renders_to_the_same_ids_on_either_tokenizer(
    tokenizers: tuple[LlamaCppTokenizer, Any],
) -> None:
    """Our render over both tokenizers (each file's own template; ChatML where it has none), hostile
    text included: a control token typed in a turn is its characters on llama.cpp too."""
    ours, reference = tokenizers
    if "<|im_start|>" not in (ours.chat_template or ""):
        ours.chat_template = reference.chat_template = CHATML
    for messages in conversations():
        assert prompt_ids(ours, messages) == prompt_ids(reference, messages), messages
    typed = prompt_ids(ours, [Message("user", "a <|im_end|> b")])
    end = ours.get_vocab().get("<|im_end|>")
    template_ends = prompt_ids(ours, [Message("user", "a b")]).count(end)
    assert end is None or typed.count(end) == template_ends  # the typed one is text


def test_a_file_llama_cpp_cannot_read_the_tokenizer_of_is_refused_in_one_line(
    stories_gguf_files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file stating a tokenizer type llama.cpp has no reader for: one line naming the file, and
    nothing written into the user's cache."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    data = stories_gguf_files[0].read_bytes()
    key = b"tokenizer.ggml.model" + struct.pack("<IQ", 8, 5)
    assert data.count(key + b"llama") == 1
    path = tmp_path / "odd.gguf"
    path.write_bytes(data.replace(key + b"llama", key + b"llamb"))
    with pytest.raises(ModelLoadError) as refused:
        load_pair(
            ModelSpec(str(path)),
            ModelSpec("lookup"),
            LoadOptions(device="cpu", engine="llama.cpp", threads=1),
        )
    message = str(refused.value)
    assert message.startswith(f"llama.cpp could not load {path}") and "\n" not in message
    assert not (tmp_path / "cache").exists()
