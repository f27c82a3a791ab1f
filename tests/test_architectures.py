"""KV-cache handling across architectures: greedy SD (T = 0) equals target-only greedy decoding on
tiny random-weight Llama, Qwen2, GPT-2, Gemma 2 (sliding window shorter than the reply) and Gemma 4
(layers sharing the KV cache of others) models, and a target whose lm_head is padded beyond the
tokenizer; a hybrid model whose recurrent state cannot be rolled back (Falcon-H1) is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.support.errors import UnsupportedCacheError
from tests.decoding_helpers import collect
from tests.tiny_models import save_tiny_model


def _perturbed_copy(source: Path, destination: Path, scale: float) -> Path:
    """A draft that agrees with the target often but not always: the target plus weight noise."""
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn_like(param) * param.std())
    model.save_pretrained(destination)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (destination / name).write_bytes((source / name).read_bytes())
    return destination


@pytest.mark.parametrize(
    ("arch", "target_vocab"),
    [("llama", 512), ("llama", 576), ("qwen2", 512), ("gpt2", 512), ("gemma2", 512), ("gemma4", 512)],
)
@pytest.mark.slow
def test_greedy_speculative_equals_target_greedy(
    tmp_path: Path, target_dir: Path, arch: str, target_vocab: int
) -> None:
    target = save_tiny_model(
        tmp_path / "target", arch, seed=0, tokenizer_dir=target_dir, vocab_size=target_vocab
    )
    # Two drafts: a close one (mostly accepted) and an unrelated one (mostly rejected), so that
    # both the accept path and the cache rollback after a rejection run on every architecture.
    drafts = [
        _perturbed_copy(target, tmp_path / "close", scale=0.1),
        save_tiny_model(
            tmp_path / "unrelated", arch, seed=1, tokenizer_dir=target_dir, vocab_size=target_vocab
        ),
    ]
    accepted = rejected = 0
    for draft in drafts:
        pair = load_pair(
            ModelSpec(str(target)), ModelSpec(str(draft)), LoadOptions(device="cpu", dtype="float32")
        )
        assert pair.vocab_size == 512
        prompt = pair.tokenizer("Once upon a time there was").input_ids
        reference = collect(pair.autoregressive(Controls()).generate(prompt, max_new_tokens=80))
        assert len(reference.ids) == 80 or reference.steps[-1].stop_reason == "eos"
        controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=3))
        run = collect(pair.speculative(controls).generate(prompt, max_new_tokens=80))
        assert run.ids == reference.ids
        accepted += run.stats.accepted_exact
        rejected += run.stats.drafted - run.stats.accepted_exact
    assert accepted > 0 and rejected > 0


def test_hybrid_recurrent_model_is_refused(tmp_path: Path, target_dir: Path) -> None:
    # Falcon-H1's layers subclass transformers' DynamicLayer, but cropping them leaves the Mamba
    # state as it was after the rejected tokens: transformers' `Cache.is_croppable` says no.
    target = save_tiny_model(tmp_path / "target", "falcon-h1", seed=0, tokenizer_dir=target_dir)
    pair = load_pair(ModelSpec(str(target)), ModelSpec(str(target_dir)), LoadOptions(device="cpu"))
    with pytest.raises(UnsupportedCacheError, match="cannot be rolled back"):
        pair.speculative(Controls())
