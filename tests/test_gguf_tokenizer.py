"""A GGUF file's tokenizer on the llama.cpp engine (`gguf_sources.gguf_tokenizer`): built on the first
start by transformers' `from_pretrained(..., gguf_file=...)`, and loaded from the cache on later
starts (without transformers' Python re-parse of tokenizer.json), it is the same tokenizer. Real files: the
default chat model (a byte-level BPE vocabulary), and the files the tests write from the offline
models (SentencePiece vocabularies, through transformers' Llama and Gemma builders)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase, TokenizersBackend

from fsd_chat.models.default_model import FETCH_COMMAND, default_model_path
from fsd_chat.models.gguf_sources import gguf_tokenizer
from fsd_chat.models.gguf_table import read_table
from fsd_chat.support.config import ENV_CACHE_DIR
from fsd_chat.support.errors import ModelLoadError
from tests.gguf_models import write_gguf
from tests.tiny_models import save_gemma3

pytestmark = pytest.mark.slow  # reads and converts whole vocabularies

DEFAULT_MODEL = default_model_path()
TEXTS = (
    "Once upon a time, a girl named Lily found a red ball.",
    "<|im_start|>user\nHi there!<|im_end|>\n<s> </s> <unk>  two  spaces\tand a tab",
    "Ünïcödé, 中文, emoji 🙂 and numbers 12345.",
)
LOADING_KEYS = {"name_or_path", "is_local", "local_files_only", "added_tokens_decoder", "vocab_file"}
"""init_kwargs that say where and how a tokenizer was loaded, not what it is."""


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module", params=["smollm2", "stories", "gemma3"])
def gguf_path(
    request: pytest.FixtureRequest,
    stories_gguf_files: tuple[Path, Path],
    target_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    if request.param == "smollm2":
        if not DEFAULT_MODEL.is_file() and not os.environ.get("CI"):
            pytest.skip(f"the default model is not fetched ({DEFAULT_MODEL} is absent): {FETCH_COMMAND}")
        return DEFAULT_MODEL
    if request.param == "stories":
        return stories_gguf_files[0]
    root = tmp_path_factory.mktemp("gemma3-gguf")
    return write_gguf(save_gemma3(root / "gemma3", target_dir), root / "gemma3.gguf")


def settings(tokenizer: PreTrainedTokenizerBase, ignored: set[str]) -> dict[str, object]:
    """Its init_kwargs but `ignored`, each special token as its text (a tokenizer loaded from a
    folder holds the AddedToken, one built from a file its text; `added_tokens_decoder` compares the
    backend's own, flags and all)."""
    return {
        k: str(v) if isinstance(v, AddedToken) else v
        for k, v in tokenizer.init_kwargs.items()
        if k not in ignored
    }


def assert_same_tokenizer(
    ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase, *, saved: bool = False
) -> None:
    """The same vocabulary, merges, normalizer, pre-tokenizer, post-processor, decoder and added
    tokens (the whole backend, serialized), special tokens, chat template and bos/eos settings; the
    same ids (a BOS among them where the file asks for one) and text for the same input. `saved`:
    one of them was loaded from a saved folder, where transformers leaves add_bos/eos_token to the
    post-processor in tokenizer.json and keeps no attribute of them (compared through the ids)."""
    assert isinstance(ours, TokenizersBackend) and isinstance(reference, TokenizersBackend)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.added_tokens_decoder == reference.added_tokens_decoder
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.chat_template == reference.chat_template and ours.chat_template is not None
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
        reference.unk_token_id,
    )
    assert ours.model_max_length == reference.model_max_length  # saved as a key when it is the default
    ignored = LOADING_KEYS | ({"add_bos_token", "add_eos_token", "model_max_length"} if saved else set())
    if not saved:
        assert (ours.add_bos_token, ours.add_eos_token) == (reference.add_bos_token, reference.add_eos_token)
    assert settings(ours, ignored) == settings(reference, ignored)
    for text in TEXTS:
        ids = reference(text).input_ids
        assert ours(text).input_ids == ids
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_the_cached_tokenizer_is_the_one_the_first_start_read(gguf_path: Path, cache: Path) -> None:
    """The first start's tokenizer (read from the file), the second's (loaded from the cache
    without transformers' Python re-parse of tokenizer.json), and transformers' plain load of the
    cached folder are one tokenizer, with one generation config."""
    seen: list[str] = []
    table = read_table(gguf_path)
    first, first_generation = gguf_tokenizer(table, seen.append)
    assert seen == [f"reading the tokenizer of {gguf_path.name} (first start only)"]
    second, second_generation = gguf_tokenizer(table, seen.append)
    assert len(seen) == 1  # loaded from the cache
    (folder,) = (cache / "gguf-tokenizers").iterdir()
    assert second.name_or_path == str(folder)
    assert_same_tokenizer(second, first, saved=True)
    assert_same_tokenizer(second, TokenizersBackend.from_pretrained(str(folder)), saved=True)
    assert second_generation.to_dict() == first_generation.to_dict()


def test_a_tokenizer_transformers_cannot_build_is_refused_in_one_line(
    stories_gguf_files: tuple[Path, Path], tmp_path: Path, cache: Path
) -> None:
    """A file stating a tokenizer type transformers has no builder for: one line naming the file and
    transformers' reason, and nothing written into the cache."""
    data = stories_gguf_files[0].read_bytes()
    key = b"tokenizer.ggml.model" + struct.pack("<IQ", 8, 5)
    assert data.count(key + b"llama") == 1
    path = tmp_path / "odd.gguf"
    path.write_bytes(data.replace(key + b"llama", key + b"llamb"))
    with pytest.raises(ModelLoadError) as refused:
        gguf_tokenizer(read_table(path), lambda _: None)
    message = str(refused.value)
    assert message.startswith(f"could not read the tokenizer of {path}: ") and "'llamb'" in message
    assert "\n" not in message
    assert not (cache / "gguf-tokenizers").exists()
