"""A GGUF file of a model with sliding-window layers: a tiny Gemma 3 (five sliding layers, then a full
one; window GEMMA3_WINDOW tokens) written as llama.cpp writes Gemma 3 (`tests/gguf_models.py`),
loaded through fsd-chat's loader. It must be the model of the folder it was written from, sliding
layers and all, and decode with a draft and a reused cache as the target alone and transformers'
generate do, in replies many windows long."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.models.chat_template import Message, PromptBuilder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect, count_fed
from tests.gguf_models import write_gguf
from tests.tiny_models import GEMMA3_WINDOW, save_gemma3

CPU = LoadOptions(device="cpu", dtype="float32", engine="transformers")
SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> tuple[Path, Path]:
    """A tiny Gemma 3 target and a perturbed copy as its draft, with RMSNorm weights away from 0 (as
    a trained model's: the file stores them +1)."""
    root = tmp_path_factory.mktemp("gemma3-folders")
    return (
        save_gemma3(root / "target", target_dir, norm_spread=0.5),
        save_gemma3(root / "draft", target_dir, noise=0.1, norm_spread=0.5),
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, folders: tuple[Path, Path]) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma3-gguf")
    return write_gguf(folders[0], root / "target.gguf"), write_gguf(folders[1], root / "draft.gguf")


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory: pytest.TempPathFactory, files: tuple[Path, Path]) -> ModelPair:
    """Both files loaded as the command line loads them (converted into a fresh cache)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return load_pair(ModelSpec(str(files[0])), ModelSpec(str(files[1])), CPU)


def test_the_file_is_written_as_llama_cpp_writes_gemma3(
    folders: tuple[Path, Path], files: tuple[Path, Path]
) -> None:
    reader = gguf.GGUFReader(files[0])
    assert reader.get_field("general.architecture").contents() == "gemma3"
    assert reader.get_field("gemma3.attention.sliding_window").contents() == GEMMA3_WINDOW
    assert reader.get_field("gemma3.attention.key_length").contents() == 16
    assert reader.get_field("tokenizer.ggml.model").contents() == "llama"
    assert reader.get_field("tokenizer.ggml.merges") is None  # rebuilt from the token order on reading
    assert reader.get_field("tokenizer.ggml.add_space_prefix").contents() is False
    # llama.cpp's RMSNorm scales by the weight, Gemma's by 1 + weight: the file holds 1 + weight.
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    norm = load_file(folders[0] / "model.safetensors")["model.layers.0.input_layernorm.weight"]
    assert norm.abs().min() > 0
    assert torch.equal(stored["blk.0.attn_norm.weight"], norm + 1)


def test_a_gemma3_file_is_its_folder_with_its_sliding_layers(
    folders: tuple[Path, Path], gguf_pair: ModelPair
) -> None:
    folder = AutoModelForCausalLM.from_pretrained(folders[0], dtype=torch.float32)
    config = gguf_pair.target.config
    # No key in the file names the layer types: transformers derives Gemma 3's pattern, the folder's.
    assert config.layer_types == folder.config.layer_types == [SLIDING] * 5 + [FULL]
    assert config.sliding_window == GEMMA3_WINDOW
    for name in ("head_dim", "query_pre_attn_scalar", "rope_parameters", "tie_word_embeddings"):
        assert getattr(config, name) == getattr(folder.config, name), name
    ids = torch.arange(5 * GEMMA3_WINDOW)[None] * 7 % 500 + 3  # five windows: most positions see past one
    with torch.inference_mode():
        logits = gguf_pair.target(ids).logits
        # Every weight is copied bit for bit but the RMSNorm weights, stored as fl(1 + w) and read back
        # as fl(fl(1 + w) - 1). The model scales by 1 + that, which is fl(1 + w) again (the folder's
        # own scale) wherever fl(1 + w) >= 0.5 (Sterbenz: the subtraction is exact), and one float32
        # ulp (6e-8 relative) off below 0.5. Through the 37 norms of six layers that is < 3e-6
        # relative in the logits: rtol 1e-5, the Llama file's tolerance, leaves three times that
        # (measured: equal, bit for bit).
        torch.testing.assert_close(logits, folder(ids).logits, rtol=1e-5, atol=1e-5)
        # The window shows in the logits: attending to everything, the same weights predict otherwise.
        unwindowed = AutoModelForCausalLM.from_pretrained(
            folders[0], dtype=torch.float32, sliding_window=ids.shape[1]
        )
        past_window = (unwindowed(ids).logits - logits)[:, GEMMA3_WINDOW + 1 :].abs().amax(-1)
    assert (past_window > 1e-2).all()


def test_a_folder_with_other_layer_types_is_refused(tmp_path: Path, target_dir: Path) -> None:
    # A GGUF file cannot say which layers slide: writing this one would load as another model.
    mixed = [SLIDING, FULL, SLIDING, SLIDING]
    folder = save_gemma3(tmp_path / "mixed", target_dir, layers=4, layer_types=mixed)
    with pytest.raises(ValueError, match="implies layer_types"):
        write_gguf(folder, tmp_path / "mixed.gguf")


QUESTIONS = ["Once upon a time, there was a little girl named Lily.", "What did Lily find in the park?"]


@pytest.mark.slow
def test_a_speculative_chat_over_the_file_equals_the_target_alone_and_generate(gguf_pair: ModelPair) -> None:
    """Two replies, each six windows long, from the chat's decoder (exact rule, the draft's proposals
    accepted and rolled back, the cache kept and read ahead between replies) against the target alone from an empty
    cache and against transformers' generate with its own sliding-window cache."""
    new = 6 * GEMMA3_WINDOW
    speculative = gguf_pair.speculative(
        Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4))
    )
    target_only = gguf_pair.autoregressive(Controls())
    target_only.reuse_prefix = False
    fed = count_fed(speculative.target)
    builder = PromptBuilder(gguf_pair.tokenizer, raw=False)
    messages: list[Message] = []
    lengths: list[int] = []
    accepted = drafted = 0
    for question in QUESTIONS:
        messages.append(Message("user", question))
        _, ids = builder.build(messages, context=speculative.context, reserve=new)
        fed.clear()
        got = collect(speculative.generate(ids, max_new_tokens=new))
        want = collect(target_only.generate(ids, max_new_tokens=new))
        with torch.inference_mode():
            reference = gguf_pair.target.generate(
                torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )[0, len(ids) :].tolist()
        assert got.ids == want.ids == reference[: len(want.ids)]
        assert len(got.ids) > 2 * GEMMA3_WINDOW
        accepted += got.stats.accepted_exact
        drafted += got.stats.drafted
        lengths.append(len(ids))
        messages.append(Message("assistant", got.text))
        speculative.read_ahead(builder.history(messages[-1]))  # as the chat does between replies
    # The second reply's prefill fed only what the first prompt did not hold: the cache was reused,
    # the sliding layers' entries included (kept whole, not trimmed to the window).
    assert lengths[1] > lengths[0] + 2 * GEMMA3_WINDOW
    assert fed[0] <= lengths[1] - lengths[0]
    assert 0 < accepted < drafted  # accepted drafts and rolled-back ones
