"""q, k, v as one GEMM and gate, up as another (`fused_linear`), through the real loader: the fused
model's logits agree with the unfused model's to rounding, and it decodes the same greedy tokens,
on the real story model (Llama), tiny Qwen2 (biased projections) and Gemma 3 models, and the
default chat model (SmolLM2, whose fused weights are then prepacked for oneDNN)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.engines.torch_engine.fused_linear import FusedLinear, FusedSlice, fusable, fuse_projections
from fsd_chat.engines.torch_engine.packed_linear import PackedLinear
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.gguf_files import local_model
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from tests.tiny_models import save_gemma3, save_tiny_model

# Fusing is the transformers engine's (a GGUF file would run on llama.cpp by default).
CPU = LoadOptions(device="cpu", dtype="float32", engine="transformers")
LOGIT_TOLERANCE = 1e-4
"""Largest difference of a logit, relative to the logits' spread: a fused GEMM may accumulate in
another order than three small ones (float32 rounding is about 1e-7 of a value)."""


def _compare(source: Path, *, groups: int, layers: int) -> None:
    """Load `source` fused (the real loader) and unfused; compare logits and greedy decoding."""
    fused = load_pair(ModelSpec(str(source)), ModelSpec(LOOKUP), CPU).target
    plain = AutoModelForCausalLM.from_pretrained(local_model(str(source), None) or source).eval()
    slices = [m for m in fused.modules() if isinstance(m, FusedSlice)]
    assert len([m for m in fused.modules() if isinstance(m, FusedLinear)]) == groups
    assert len(slices) == layers * 5 if groups else not slices
    torch.manual_seed(0)
    ids = torch.randint(3, 512, (1, 40))
    with torch.inference_mode():
        want, got = plain(ids).logits, fused(ids).logits
        assert (want - got).abs().max() <= LOGIT_TOLERANCE * want.std()
        prompt = ids[:, :8]
        greedy = {"max_new_tokens": 48, "do_sample": False, "min_new_tokens": 48}
        assert torch.equal(plain.generate(prompt, **greedy), fused.generate(prompt, **greedy))


def test_story_model_fuses_and_decodes_as_before(target_dir: Path) -> None:
    _compare(target_dir, groups=2 * 5, layers=5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_models_fuse_and_decode_as_before(tmp_path: Path, target_dir: Path, arch: str) -> None:
    _compare(save_tiny_model(tmp_path / arch, arch, seed=0, tokenizer_dir=target_dir), groups=4, layers=2)


def test_gemma3_fuses_and_decodes_as_before(tmp_path: Path, target_dir: Path) -> None:
    _compare(save_gemma3(tmp_path / "gemma3", target_dir, norm_spread=0.5), groups=12, layers=6)


def test_gpt2_is_already_fused(tmp_path: Path, target_dir: Path) -> None:
    # GPT-2's c_attn is q, k and v in one Conv1D: nothing is left to fuse.
    _compare(save_tiny_model(tmp_path / "gpt2", "gpt2", seed=0, tokenizer_dir=target_dir), groups=0, layers=2)


@pytest.mark.slow
@pytest.mark.skipif(not default_model_path().is_file(), reason="the default model is not fetched")
def test_default_model_fuses_packs_and_decodes_as_before() -> None:
    _compare(default_model_path(), groups=2 * 30, layers=30)
    fused = load_pair(ModelSpec(str(default_model_path())), ModelSpec(LOOKUP), CPU).target
    # The fused weights (576 → 960 for q, k, v; 576 → 3072 for gate, up) are what oneDNN packs.
    packed = [m for m in fused.modules() if isinstance(m, FusedLinear) and isinstance(m.linear, PackedLinear)]
    assert len(packed) == 60


def test_a_sibling_called_on_another_input_gets_its_own_product() -> None:
    # The fallback that keeps any architecture exact: a slice of the product of its own input.
    torch.manual_seed(0)
    layers = [nn.Linear(16, n) for n in (8, 4, 4)]
    fused = FusedLinear(layers)
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        assert torch.allclose(fused.slice_of(x, 0), layers[0](x), atol=1e-6)
        assert torch.allclose(fused.slice_of(y, 1), layers[1](y), atol=1e-6)  # not x's product
        assert torch.allclose(fused.slice_of(y, 2), layers[2](y), atol=1e-6)
        assert fused._held.input is y
        assert torch.allclose(fused.slice_of(y, 0), layers[0](y), atol=1e-6)
        assert fused._held.input is None  # every sibling served y: nothing held


@pytest.mark.slow  # importing bitsandbytes takes seconds
def test_quantized_and_mismatched_layers_are_not_fused() -> None:
    from bitsandbytes.nn import Linear8bitLt

    assert fusable([nn.Linear(16, 8), nn.Linear(16, 4)])
    assert not fusable([Linear8bitLt(16, 8), Linear8bitLt(16, 4)])  # an 8-bit target's layers
    assert not fusable([nn.Linear(16, 8), nn.Linear(8, 4)])
    assert not fusable([nn.Linear(16, 8), nn.Linear(16, 4, bias=False)])
    model: PreTrainedModel | nn.Module = nn.Module()
    model.q_proj, model.k_proj, model.v_proj = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4).double()
    assert fuse_projections(model) == 0
