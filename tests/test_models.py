"""Loading the pair: compatibility checks, clear errors, and bitsandbytes 8-/4-bit on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsd_chat.decoding import AutoregressiveDecoder, Controls, Decoder, DecodingSettings, SpeculativeDecoder
from fsd_chat.engines.torch_engine.kv_cache import CompiledModel
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import ContextLengthError, IncompatibleModelsError, ModelLoadError
from tests.decoding_helpers import collect
from tests.tiny_models import save_tiny_model

CPU = LoadOptions(device="cpu", dtype="float32")


def test_missing_path_is_a_clear_error(target_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_pair(ModelSpec(str(tmp_path / "nope")), ModelSpec(str(target_dir)), CPU)
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_pair(ModelSpec(str(tmp_path)), ModelSpec(str(target_dir)), CPU)


def test_tokenizers_that_cannot_be_mapped_are_refused(target_dir: Path, mismatched_draft_dir: Path) -> None:
    with pytest.raises(IncompatibleModelsError, match="tokenizers differ: 1018 of the 1021 tokens"):
        load_pair(ModelSpec(str(target_dir)), ModelSpec(str(mismatched_draft_dir)), CPU)


def test_non_causal_model_is_refused(target_dir: Path, encoder_only_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_pair(ModelSpec(str(encoder_only_dir)), ModelSpec(str(target_dir)), CPU)


def test_prompt_longer_than_the_context_is_refused(pair) -> None:
    decoder = pair.speculative(Controls())
    with pytest.raises(ContextLengthError, match="context window is 512 tokens"):
        next(decoder.generate([1] * 600, max_new_tokens=10))


def test_decoder_is_the_one_asked_for_with_its_options(pair: ModelPair) -> None:
    prompt = pair.tokenizer("Once upon a time").input_ids
    controls = Controls(DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=3))
    target_only = pair.decoder(controls, autoregressive=True, time_phases=True, compiled=False)
    assert isinstance(target_only, AutoregressiveDecoder) and isinstance(target_only, Decoder)
    assert target_only.controls is controls and target_only.time_phases
    assert target_only.compile_error is None and not isinstance(target_only.target, CompiledModel)
    run = collect(target_only.generate(prompt, max_new_tokens=8))
    assert {s.stats.rule for s in run.steps} == {"autoregressive"} and run.stats.drafted == 0

    speculative = pair.decoder(controls, time_phases=True)
    assert isinstance(speculative, SpeculativeDecoder) and isinstance(speculative, Decoder)
    assert speculative.controls is controls and speculative.time_phases
    assert speculative.timings == pair.forward_timings  # the pair's, modelled once for all its decoders
    assert not isinstance(speculative.cached_models[-1], CompiledModel)
    run = collect(speculative.generate(prompt, max_new_tokens=8))
    assert {s.stats.rule for s in run.steps} == {"fuzzy"} and run.stats.drafted > 0

    compiled = pair.decoder(controls, compiled=True)
    assert isinstance(compiled, SpeculativeDecoder) and isinstance(compiled.cached_models[-1], CompiledModel)
    assert not compiled.time_phases


def test_cuda_without_a_gpu_is_a_clear_error(target_dir: Path, draft_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        load_pair(ModelSpec(str(target_dir)), ModelSpec(str(draft_dir)), LoadOptions(device="cuda"))


@pytest.mark.slow
def test_8bit_pair_on_the_cpu(pair, target_dir: Path, draft_dir: Path) -> None:
    quantized = load_pair(ModelSpec(str(target_dir), "8bit"), ModelSpec(str(draft_dir), "8bit"), CPU)
    assert type(quantized.target.model.layers[0].mlp.down_proj).__name__ == "Linear8bitLt"
    prompt = pair.tokenizer("Once upon a time").input_ids
    full = collect(pair.autoregressive(Controls()).generate(prompt, max_new_tokens=100)).ids
    eight = collect(quantized.autoregressive(Controls()).generate(prompt, max_new_tokens=100)).ids
    agreement = sum(a == b for a, b in zip(full, eight, strict=True)) / len(full)
    print(f"8-bit target greedy agreement with float32: {agreement:.2f}")
    # LLM.int8 perturbs the logits: the first tokens agree; later ones may diverge after a near-tie.
    assert eight[:5] == full[:5]
    run = collect(
        quantized.speculative(Controls(DecodingSettings(threshold=0.0))).generate(prompt, max_new_tokens=100)
    )
    assert len(run.ids) == 100 and run.stats.acceptance_rate > 0.3


def test_4bit_pair_on_the_cpu(tmp_path: Path, target_dir: Path) -> None:
    # A second architecture's shapes (a tiny random Llama) through the CPU 4-bit kernel.
    target = save_tiny_model(tmp_path / "t", "llama", seed=0, tokenizer_dir=target_dir)
    draft = save_tiny_model(tmp_path / "d", "llama", seed=0, tokenizer_dir=target_dir, layers=1)
    full = load_pair(ModelSpec(str(target)), ModelSpec(str(draft)), CPU)
    quantized = load_pair(ModelSpec(str(target), "4bit"), ModelSpec(str(draft), "4bit"), CPU)
    assert type(quantized.target.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    prompt = full.tokenizer("Once upon a time").input_ids
    a = collect(full.autoregressive(Controls()).generate(prompt, max_new_tokens=60)).ids
    b = collect(quantized.autoregressive(Controls()).generate(prompt, max_new_tokens=60)).ids
    agreement = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    print(f"4-bit (NF4) target greedy agreement with float32: {agreement:.2f}")
    assert len(b) == 60
    sd = collect(
        quantized.speculative(Controls(DecodingSettings(threshold=0.0))).generate(prompt, max_new_tokens=60)
    )
    assert len(sd.ids) == 60


def test_failed_quantization_is_a_clear_error(
    target_dir: Path, draft_dir: Path, failing_4bit_kernel: str
) -> None:
    with pytest.raises(
        ModelLoadError, match=rf"4bit quantization of .*stories260K failed: {failing_4bit_kernel}"
    ):
        load_pair(ModelSpec(str(target_dir), "4bit"), ModelSpec(str(draft_dir)), CPU)
