"""`compile_draft` (`--compile`): the draft's one-token forward passes compiled with torch.compile
over a static KV cache. Compiling takes tens of seconds on a CPU, so one decoder is compiled for
the module. The losslessness check is a reduced chi-square test (3,000 replies, α = 0.001, fixed
seeds), with its power shown against the draft's distribution.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig, SpeculativeDecoder
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect
from tests.test_cli_generate import pair_args, run_cli
from tests.test_sampling_lossless import ALPHA, chi_square_p_value, exact_first_two

pytestmark = pytest.mark.slow  # torch.compile builds C++ kernels

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park"]


@pytest.fixture(scope="module")
def compiled(pair: ModelPair) -> SpeculativeDecoder:
    return pair.speculative(Controls(DecodingSettings(threshold=0.0, draft_tokens=4)), compile_draft=True)


def test_greedy_output_equals_target_only(compiled: SpeculativeDecoder, pair: ModelPair) -> None:
    target_only = pair.autoregressive(Controls())
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt).input_ids
        got = collect(compiled.generate(ids, max_new_tokens=150, sampling=SamplingConfig()))
        want = collect(target_only.generate(ids, max_new_tokens=150, sampling=SamplingConfig()))
        assert got.ids == want.ids
        assert got.stats.accepted_exact > 0
    assert compiled.compile_error is None


def test_sampling_stays_lossless(compiled: SpeculativeDecoder, pair: ModelPair) -> None:
    replies, sampling = 3_000, SamplingConfig(temperature=0.9, top_p=0.95)
    vocab, eos = pair.vocab_size, pair.tokenizer.eos_token_id
    # A prompt where the draft's first-token law is far from the target's (TV 0.54): both the
    # acceptance and the correction paths are exercised, and the test can tell the two laws apart.
    prompt_ids = pair.tokenizer("The sun was").input_ids
    firsts = torch.zeros(vocab + 1, dtype=torch.long)
    for seed in range(replies):
        seeded = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        ids = collect(compiled.generate(prompt_ids, max_new_tokens=2, sampling=seeded)).ids
        firsts[ids[0] if ids else vocab] += 1
    assert chi_square_p_value(firsts, exact_first_two(pair.target, prompt_ids, vocab, eos)[0]) > ALPHA
    assert chi_square_p_value(firsts, exact_first_two(pair.draft, prompt_ids, vocab, eos)[0]) < 1e-6


def test_falls_back_to_eager_when_compilation_fails(pair: ModelPair, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real failure: inductor is pointed at a C++ compiler that does not exist (and may not reuse
    # code it compiled before).
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("/nonexistent/c++",))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    torch._dynamo.reset()
    decoder = pair.speculative(Controls(DecodingSettings(threshold=0.0)), compile_draft=True)
    ids = pair.tokenizer(PROMPTS[0]).input_ids
    got = collect(decoder.generate(ids, max_new_tokens=60, sampling=SamplingConfig())).ids
    want = collect(
        pair.autoregressive(Controls()).generate(ids, max_new_tokens=60, sampling=SamplingConfig())
    ).ids
    assert got == want
    assert decoder.compile_error is not None and "C++ compiler" in decoder.compile_error
    torch._dynamo.reset()


def test_generate_says_when_compile_falls_back(
    target_dir, draft_dir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("/nonexistent/c++",))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    torch._dynamo.reset()
    args = ["generate", *pair_args(target_dir, draft_dir), "--compile", "-T", "0", "--max-new-tokens", "30"]
    code, out, err = run_cli([*args, PROMPTS[0]], capsys)
    torch._dynamo.reset()
    assert code == 0 and out.strip()
    assert err.count("\n") == 1 and "--compile fell back to eager draft forward passes" in err
