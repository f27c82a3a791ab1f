"""GGUF files of models whose rotary embedding is scaled: written as llama.cpp writes them
(`tests/gguf_models.py`: linear and YaRN as keys, Llama 3's as the tensor rope_freqs.weight), loaded
through fsd-chat's loader. transformers' GGUF reader drops the scaling; the loaded model must be the
folder's, scaling and all, and a scaling transformers cannot represent is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.gguf_rope import ROPE_FREQS, llama3_parameters
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.support.errors import ModelLoadError
from tests.gguf_models import llama3_rope_freqs, write_gguf
from tests.tiny_models import save_gemma3, save_tiny_model

CPU = LoadOptions(device="cpu", dtype="float32", engine="transformers")
LENGTH = 96
"""Tokens compared: positions far enough for the scaled frequencies to turn otherwise."""

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 100.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
"""Llama 3.1's scaling shrunk to the tiny model's 8 frequencies (head_dim 16): with base 100 their
wavelengths run from 6 to 353 positions, so that 3 lie between 128 / 4 and 128 and get a divisor
between 1 and 8, 3 below keep theirs and 2 above are divided by 8 (Llama 3.1's own base 500 000
and original length 8192 would leave all 8 at 1)."""


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))


def loaded_target(path: Path) -> PreTrainedModel:
    """The GGUF file's model, loaded as the command line loads a target (converted into the cache)."""
    return load_pair(ModelSpec(str(path)), ModelSpec(LOOKUP), CPU).target


def assert_same_model(folder: Path, path: Path) -> None:
    """The file loads as the folder: the same RoPE parameters and logits over LENGTH tokens; and the
    scaling matters to these logits (the folder's weights without it predict otherwise)."""
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    got = loaded_target(path)
    assert got.config.rope_parameters == want.config.rope_parameters
    ids = torch.arange(LENGTH)[None] * 7 % 500 + 3
    rope = want.config.rope_parameters
    unscaled_rope: dict[str, Any] = (
        {
            **rope,
            "full_attention": {"rope_type": "default", "rope_theta": rope["full_attention"]["rope_theta"]},
        }
        if "full_attention" in rope
        else {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    )
    unscaled = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, rope_parameters=unscaled_rope
    )
    with torch.inference_mode():
        logits = got(ids).logits
        torch.testing.assert_close(logits, want(ids).logits, rtol=1e-5, atol=1e-5)
        assert (unscaled(ids).logits - logits).abs().amax() > 1e-2


@pytest.mark.parametrize(
    "rope",
    [
        LLAMA3,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ],
    ids=["llama3-tensor", "yarn-keys", "linear-keys"],
)
def test_a_scaled_llama_file_is_its_folder(tmp_path: Path, target_dir: Path, rope: dict[str, Any]) -> None:
    folder = save_tiny_model(
        tmp_path / "llama", "llama", seed=0, tokenizer_dir=target_dir, rope_parameters=dict(rope)
    )
    path = write_gguf(folder, tmp_path / "llama.gguf")
    reader = gguf.GGUFReader(path)
    freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    if rope["rope_type"] == "llama3":  # the divisors as llama.cpp writes them, not all 1 nor all 8
        assert len(freqs) == 1 and reader.get_field("llama.rope.scaling.type") is None
        divisors = torch.from_numpy(freqs[0].data.copy())
        assert divisors.shape == (8,) and divisors.min() == 1.0 and divisors.max() == 8.0
        assert int(((divisors > 1.0) & (divisors < 8.0)).sum()) == 3
    else:
        assert not freqs and reader.get_field("llama.rope.scaling.type").contents() == rope["rope_type"]
    assert_same_model(folder, path)


def test_a_gemma3_file_scales_its_full_layers_only(tmp_path: Path, target_dir: Path) -> None:
    """Gemma 3 4B to 27B scale their full-attention layers' RoPE linearly by 8 (their config.json's
    rope_scaling); the sliding layers keep their own base of 10 000, unscaled."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    folder = save_gemma3(tmp_path / "gemma3", target_dir, norm_spread=0.5, rope_parameters=rope)
    path = write_gguf(folder, tmp_path / "gemma3.gguf")
    assert gguf.GGUFReader(path).get_field("gemma3.rope.scaling.factor").contents() == 8.0
    assert_same_model(folder, path)


def llama(head_dim: int, rope: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope
    )


META = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    ("head_dim", "rope"),
    [
        (128, {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, **META}),  # Llama 3.1 8B
        (64, {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, **META}),  # Llama 3.2 1B
        (128, {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, **META}),  # Llama 3.2 3B
        (16, LLAMA3),
    ],
    ids=["llama-3.1-8b", "llama-3.2-1b", "llama-3.2-3b", "tiny"],
)
def test_the_llama3_parameters_of_a_file_are_its_folders(head_dim: int, rope: dict[str, Any]) -> None:
    """The divisors llama.cpp writes give back the parameters they came from, exactly."""
    divisors = llama3_rope_freqs(llama(head_dim, rope))[ROPE_FREQS]
    unscaled = llama(head_dim, {"rope_type": "default", "rope_theta": rope["rope_theta"]})
    assert llama3_parameters(divisors, unscaled) == {k: v for k, v in rope.items() if k != "rope_theta"}


@pytest.mark.parametrize(
    ("original", "high", "between"), [(512, 4.0, 1), (1500, 2.0, 0)], ids=["one-between", "none-between"]
)
def test_divisors_that_pin_fewer_parameters_give_parameters_that_reproduce_them(
    original: int, high: float, between: int
) -> None:
    """Base 10 000 over 8 frequencies: wavelengths 6 to 19 869, a factor of sqrt(10) apart, so that
    one lies between original / high and original, or none. Other Llama 3 parameters than these
    then give the same divisors: those fitted give the same frequencies."""
    rope = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, **META}
    rope |= {"original_max_position_embeddings": original, "high_freq_factor": high}
    divisors = llama3_rope_freqs(llama(16, rope))[ROPE_FREQS]
    assert int(((divisors > 1.0) & (divisors < 8.0)).sum()) == between
    assert float(divisors.min()) == 1.0 and float(divisors.max()) == 8.0
    unscaled = llama(16, {"rope_type": "default", "rope_theta": 10_000.0})
    fitted = llama3_parameters(divisors, unscaled)
    assert fitted is not None
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](llama(16, rope))
    got, _ = ROPE_INIT_FUNCTIONS["llama3"](llama(16, {"rope_theta": 10_000.0, **fitted}))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(
    ("keys", "tensors", "refusal"),
    [
        (
            {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0},
            {},
            "by RoPE type 'longrope'",
        ),
        ({}, {"rope_freqs.weight": torch.tensor([1.0, 3.0, 2.0, 8.0])}, "no Llama 3 parameters reproduce"),
        ({}, {"rope_freqs.weight": torch.tensor([1.0, 2.0, 8.0])}, "of 3 values for a rotary dimension of 8"),
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
            {"rope_freqs.weight": torch.tensor([1.0, 2.0, 4.0, 8.0])},
            "both rope_freqs.weight and a linear scaling factor",
        ),
    ],
    ids=["unknown-type", "no-llama3-fit", "wrong-length", "tensor-and-keys"],
)
def test_a_scaling_transformers_cannot_represent_is_refused(
    tmp_path: Path,
    target_dir: Path,
    keys: dict[str, str | float],
    tensors: dict[str, torch.Tensor],
    refusal: str,
) -> None:
    """stories260K (head_dim 8: 4 frequencies) with scaling keys or divisors of its own."""
    path = write_gguf(target_dir, tmp_path / "bad.gguf", keys=keys, tensors=tensors)
    with pytest.raises(ModelLoadError) as refused:
        loaded_target(path)
    message = str(refused.value)
    assert message.startswith(f"{path} ") and refusal in message and "\n" not in message
    assert "cannot carry into transformers" in message
