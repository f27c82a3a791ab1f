"""A GGUF file of a model with sliding-window layers (Gemma 3: five sliding layers to one full, as
gemma-3-270m's file holds them), written by the tests as llama.cpp writes one: it loads with its
layers and window, computes its folder's logits, and decodes greedily as transformers' generate
does, across and past the window, through a conversation that reuses its KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.models.chat_template import Message, PromptBuilder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect
from tests.gguf_models import write_gguf
from tests.test_prefix_reuse import QUESTIONS, SLIDING_WINDOW, save_gemma3

CPU = LoadOptions(device="cpu", dtype="float32")
LAYERS = ("sliding_attention",) * 5 + ("full_attention",)
"""Gemma 3's pattern: the file does not hold it, and transformers (as llama.cpp) takes one full
layer in six."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> tuple[Path, Path, Path]:
    """(the target's folder, the target's GGUF file, a perturbed copy's GGUF file as its draft),
    converted into a cache of the module's own."""
    root = tmp_path_factory.mktemp("gemma3-gguf")
    folder = save_gemma3(root / "target", target_dir, layer_types=LAYERS)
    draft = save_gemma3(root / "draft", target_dir, layer_types=LAYERS, noise=0.3)
    return folder, write_gguf(folder, root / "target.gguf"), write_gguf(draft, root / "draft.gguf")


@pytest.fixture(scope="module")
def loaded(files: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return load_pair(ModelSpec(str(files[1])), ModelSpec(str(files[2])), CPU)


def test_a_gemma3_file_keeps_its_sliding_layers_and_its_folders_logits(
    files: tuple[Path, Path, Path], loaded: ModelPair
) -> None:
    config = loaded.target.config
    assert config.model_type == "gemma3_text"
    assert list(config.layer_types) == list(LAYERS) and config.sliding_window == SLIDING_WINDOW
    folder = AutoModelForCausalLM.from_pretrained(files[0], dtype=torch.float32)
    ids = torch.tensor([[1, *range(20, 60)]])  # 41 tokens: five windows
    with torch.inference_mode():
        # float32 written and read back as float32 (the norms' +1 and −1 exact at these magnitudes):
        # only the order of float operations may differ.
        torch.testing.assert_close(loaded.target(ids).logits, folder(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_gemma3_file_decodes_as_generate_past_the_window_through_a_conversation(
    loaded: ModelPair,
) -> None:
    """Greedy replies of 3 windows, exact speculative decoding with the GGUF draft, prefix reuse
    and reading ahead between replies: each equals transformers' generate from the whole prompt."""
    decoder = loaded.speculative(Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4)))
    builder = PromptBuilder(loaded.tokenizer, raw=False)
    messages: list[Message] = []
    new = 3 * SLIDING_WINDOW
    drafted = 0
    for question in QUESTIONS[:3]:
        messages.append(Message("user", question))
        _, ids = builder.build(messages, context=decoder.context, reserve=new)
        got = collect(decoder.generate(ids, max_new_tokens=new))
        with torch.inference_mode():
            reference = loaded.target.generate(
                torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )[0, len(ids) :].tolist()
        assert got.ids == reference
        drafted += got.stats.drafted
        messages.append(Message("assistant", got.text))
        decoder.read_ahead(builder.history(messages[-1]))
    assert len(ids) > 4 * SLIDING_WINDOW and drafted > 0
