"""Linear layers prepacked for oneDNN (`fsd_chat.engines.torch_engine.packed_linear`): the same products as
`nn.Linear`, only on the layers large enough to gain, undone exactly, and applied by the loader.

A Qwen2 model 384 wide (q/o projections 147,456 weights, MLP 393,216, the tied output head 196,608:
packed; k/v projections 49,152: kept), random weights and the stories260K tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config

from fsd_chat.engines.torch_engine.kv_cache import CompiledModel
from fsd_chat.engines.torch_engine.packed_linear import (
    PACK_MIN_WEIGHTS,
    PackedLinear,
    can_pack,
    pack_linear_layers,
    packed_bytes,
    unpack_linear_layers,
)
from fsd_chat.engines.torch_engine.timings import model_forward_seconds
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from tests.conftest import TARGET_DIR

pytestmark = pytest.mark.skipif(not can_pack(), reason="this torch build has no oneDNN")

WIDE = Qwen2Config(
    vocab_size=512,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
"""Per layer: q (with bias) and o 384 × 384, k and v 128 × 384 (below PACK_MIN_WEIGHTS), gate, up
and down 1024 × 384; a head tied to the input embeddings."""

PACKED_PER_LAYER = 5
"""q, o, gate, up, down."""

PACKED_PER_LOADED_LAYER = 4
"""Through the loader, which fuses first (`fused_linear`): q, k and v as one (640 × 384), o, gate
and up as one, down."""


def wide_model(seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(WIDE, dtype=torch.float32).eval()


def linear_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_large_float32_layers_are_packed_and_compute_the_same_logits() -> None:
    model, reference = wide_model(), wide_model()
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    assert pack_linear_layers(model) == PACKED_PER_LAYER * 2 + 1  # and the output head
    packed = {n for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert "model.layers.0.self_attn.k_proj" not in packed  # 49,152 weights < PACK_MIN_WEIGHTS
    assert {"model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= packed
    with torch.inference_mode():
        got, want = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The q projection's bias goes through the packed product too.
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_the_tied_head_packs_a_copy_and_the_embedding_keeps_its_table() -> None:
    model = wide_model()
    table = model.get_input_embeddings().weight
    pack_linear_layers(model)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.tied is table
    assert model.get_input_embeddings().weight is table
    # Untied layers keep no dense weight: the packed copy replaces it.
    assert model.model.layers[0].mlp.up_proj.tied is None
    assert packed_bytes(model) == 4 * (2 * (2 * 384 * 384 + 3 * 1024 * 384) + 512 * 384)


def test_unpacking_gives_back_the_same_weights_and_the_tie() -> None:
    model = wide_model()
    before = linear_weights(model)
    pack_linear_layers(model)
    assert unpack_linear_layers(model) == PACKED_PER_LAYER * 2 + 1
    after = linear_weights(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_small_layers_and_other_dtypes_are_left_alone() -> None:
    story = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32)
    assert max(m.weight.numel() for m in story.modules() if isinstance(m, nn.Linear)) < PACK_MIN_WEIGHTS
    assert pack_linear_layers(story) == 0
    assert pack_linear_layers(wide_model().to(torch.bfloat16)) == 0


def test_a_model_about_to_be_compiled_is_unpacked() -> None:
    """inductor cannot lower a packed weight: `CompiledModel` puts the linear layers back first."""
    model = wide_model()
    pack_linear_layers(model)
    CompiledModel(model, vocab_size=512, capacity=64)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_the_cost_model_prices_packed_weights_at_their_own_rates() -> None:
    """The weights read are the same bytes either way; the packed forward is modelled cheaper, and
    its width dearer by less (oneDNN's 2-row layout)."""
    model = wide_model()
    plain = [model_forward_seconds(model, w) for w in (1, 2, 6)]
    pack_linear_layers(model)
    packed = [model_forward_seconds(model, w) for w in (1, 2, 6)]
    assert packed[0] < plain[0]
    assert packed[1] / packed[0] < plain[1] / plain[0]
    assert packed[2] > packed[1] > packed[0]


def test_the_loader_packs_unless_told_not_to(tmp_path: Path) -> None:
    folder = tmp_path / "wide"
    wide_model().save_pretrained(folder)
    AutoTokenizer.from_pretrained(TARGET_DIR).save_pretrained(folder)
    for prepack, expected in ((True, PACKED_PER_LOADED_LAYER * 2 + 1), (False, 0)):
        pair = load_pair(
            ModelSpec(str(folder)), ModelSpec("lookup"), LoadOptions(device="cpu", prepack=prepack)
        )
        assert sum(isinstance(m, PackedLinear) for m in pair.target.modules()) == expected
