"""`--compile` (`compiled`): the target's and the draft's decoding steps compiled with
torch.compile over static KV caches (`CompiledModel`), on the CPU without CUDA graphs, the path a
GPU runs with them. Compiling takes seconds per graph on one CPU core, so the graphs are shared:
`kv_cache.compiled_forward` keeps one compiled forward per model, and every test here reuses the
session's pair (target widths 1, 2, 4, 8; draft widths 1, 2). The losslessness check is a reduced
chi-square test (3,000 replies, α = 0.001, fixed seeds), with its power shown against the draft's
distribution.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.engines.torch_engine import regions
from fsd_chat.engines.torch_engine.kv_cache import CachedModel, CompiledModel, StaticModel, bind
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.conftest import COMPILED_FORWARDS
from tests.decoding_helpers import collect, count_fed
from tests.test_cli_generate import pair_args, run_cli
from tests.test_host_syncs import host_reads  # noqa: F401 (a fixture)
from tests.test_sampling_lossless import ALPHA, chi_square_p_value, exact_first_two
from tests.tiny_models import save_tiny_model

pytestmark = [pytest.mark.slow, COMPILED_FORWARDS]  # torch.compile builds C++ kernels

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park"]


def decoder(pair: ModelPair, kind: str, compiled: bool) -> Decoder:
    """A decoder of one kind: "target-only", "exact" (k 5: the story draft is rejected now and
    then, so caches roll back) or "fuzzy" (js, T 0.1)."""
    if kind == "target-only":
        return pair.autoregressive(Controls(), compiled=compiled)
    settings = DecodingSettings(
        rule=kind, threshold=0.0 if kind == "exact" else 0.1, draft_tokens=5, draft_policy="fixed"
    )
    return pair.speculative(Controls(settings), compiled=compiled)


@pytest.mark.parametrize("kind", ["target-only", "exact", "fuzzy"])
def test_greedy_output_equals_eager(pair: ModelPair, kind: str) -> None:
    compiled, eager = decoder(pair, kind, True), decoder(pair, kind, False)
    assert all(isinstance(m, CompiledModel) for m in compiled.owned_models)  # type: ignore[attr-defined]
    rejected = 0
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt).input_ids
        got = collect(compiled.generate(ids, max_new_tokens=100, sampling=SamplingConfig()))
        want = collect(eager.generate(ids, max_new_tokens=100, sampling=SamplingConfig()))
        assert got.ids == want.ids
        assert got.origins == want.origins  # the same acceptances, rejections and corrections
        rejected += sum(s.stats.accepted < s.stats.drafted for s in got.steps)
    assert compiled.compile_error is None
    if kind != "target-only":
        assert rejected > 0  # rollbacks happened


def test_prefix_is_reused_across_replies(pair: ModelPair) -> None:
    """A conversation's second prompt extends the first reply: the compiled target keeps what it
    shares (its write position moves back, nothing is re-encoded) and replies as a fresh eager one."""
    reusing = decoder(pair, "exact", True)
    target = reusing.owned_models[0]  # type: ignore[attr-defined]
    first_prompt = pair.tokenizer(PROMPTS[0]).input_ids
    first = collect(reusing.generate(first_prompt, max_new_tokens=40, sampling=SamplingConfig()))
    second_prompt = [*first_prompt, *first.ids, *pair.tokenizer(" The end.").input_ids[1:]]
    seen_before = target.seen
    fed = count_fed(target)
    got = collect(reusing.generate(second_prompt, max_new_tokens=40, sampling=SamplingConfig()))
    fresh = decoder(pair, "exact", False)
    want = collect(fresh.generate(second_prompt, max_new_tokens=40, sampling=SamplingConfig()))
    assert got.ids == want.ids
    # The prefill fed only what the first reply left out of the cache.
    assert seen_before > len(first_prompt) and fed[0] == len(second_prompt) - 1 - seen_before


def test_a_static_caches_prefill_runs_the_lm_head_on_the_rows_it_keeps(pair: ModelPair) -> None:
    """A prompt's prefill over the whole step's static cache asks for one row of logits: the LM head
    (a vocabulary-wide GEMM a row) runs on that row, not on every prompt position, and the row is
    the one a full head gives."""
    static = bind(pair.target, pair.vocab_size, compiled=False, capacity=64, static=True)
    assert isinstance(static, StaticModel)
    head_rows: list[int] = []
    hook = pair.target.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: head_rows.append(args[0].shape[-2])
    )
    seq = torch.tensor([pair.tokenizer(PROMPTS[0]).input_ids])
    try:
        kept = static.forward(seq, seq.shape[1], 1)
        static.reset()
        full = static.forward(seq, seq.shape[1], seq.shape[1])
    finally:
        hook.remove()
    assert head_rows == [1, seq.shape[1]] and seq.shape[1] > 1
    assert kept.shape == (1, pair.vocab_size)
    torch.testing.assert_close(kept[0], full[-1])


@pytest.mark.parametrize("kind", ["target-only", "exact"])
def test_no_prompt_length_compiles_a_graph(pair: ModelPair, kind: str) -> None:
    """Prompts of every length up to max(widths) prefill eagerly (`CompiledModel.prefill`): the
    compiled forwards see only decoding steps' widths (1 for a target-only step, the padded k + 1
    of a verify, the draft's 1 and 2), target-only decoding builds no graph past the first reply's,
    and the replies are the eager decoder's."""
    compiled, eager = decoder(pair, kind, True), decoder(pair, kind, False)
    models: list[CompiledModel] = compiled.owned_models  # type: ignore[attr-defined]
    widths: list[int] = []
    for model in models:
        inner = model._compiled

        def recording(*args: Any, inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            widths.append(kwargs["input_ids"].shape[1])
            return inner(*args, **kwargs)

        model._compiled = recording
    story = (
        "Once upon a time there was a little dog who liked to run in the park with his friend "
        "Tom. One day they found a big red ball under a tree and played with it until the sun went down"
    )
    words = story.split(" ")
    lengths: set[int] = set()
    stats = torch._dynamo.utils.counters["stats"]
    for n in range(1, len(words) + 1):
        ids = pair.tokenizer(" ".join(words[:n])).input_ids
        lengths.add(len(ids))
        got = collect(compiled.generate(ids, max_new_tokens=6, sampling=SamplingConfig()))
        assert got.ids == collect(eager.generate(ids, max_new_tokens=6, sampling=SamplingConfig())).ids
        if n == 1:
            graphs = stats["unique_graphs"]  # the first reply compiled whatever its steps needed
    assert compiled.compile_error is None
    assert max(lengths) > max(models[0].widths) and min(lengths) <= 2  # every padded width was a prompt's
    # k 5 verifies up to 6 tokens (fewer at the reply's end), padded to 8; prompts reached 16 and 33.
    assert set(widths) <= ({1} if kind == "target-only" else {1, 2, 4, 8})
    if kind == "target-only":
        assert len(widths) == 6 * len(words)  # one compiled pass a token, none for a prompt
        # (A speculative reply's last steps verify fewer tokens, a width the first one may not
        # have compiled: only the one-token step's graph is surely there after one reply.)
        assert stats["unique_graphs"] == graphs


def test_sampled_steps_read_the_device_once(pair: ModelPair, host_reads: collections.Counter[str]) -> None:  # noqa: F811
    """tests/test_host_syncs.py's count, compiled (the models and the acceptance rule): one read
    per step (the verdict, or a target step's token), whatever the widths; and a seed gives the
    eager decoder's reply (the rule's draws are made outside the compiled function, in the same
    order)."""
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=3)
    for kind in ("target-only", "exact"):
        compiled = decoder(pair, kind, True)
        # Compiling reads values (a width or a draft length met for the first time); a first
        # reply compiles what the counted one uses.
        collect(compiled.generate(pair.tokenizer(PROMPTS[1]).input_ids, max_new_tokens=48, sampling=sampling))
        steps = compiled.generate(pair.tokenizer(PROMPTS[1]).input_ids, max_new_tokens=48, sampling=sampling)
        first = next(steps)  # the prompt's prefill is outside the steady state
        host_reads.clear()
        rest = list(steps)
        assert len(rest) >= 5 and sum(host_reads.values()) == len(rest), dict(host_reads)
        eager = decoder(pair, kind, False).generate(
            pair.tokenizer(PROMPTS[1]).input_ids, max_new_tokens=48, sampling=sampling
        )
        assert collect([first, *rest]).ids == collect(eager).ids


def test_sampling_stays_lossless(pair: ModelPair) -> None:
    compiled = pair.speculative(Controls(DecodingSettings(threshold=0.0, draft_tokens=4)), compiled=True)
    replies, sampling = 3_000, SamplingConfig(temperature=0.9, top_p=0.95)
    vocab, eos = pair.vocab_size, pair.tokenizer.eos_token_id
    # A prompt where the draft's first-token law is far from the target's (TV 0.54): both the
    # acceptance and the correction paths are exercised, and the test can tell the two laws apart.
    prompt_ids = pair.tokenizer("The sun was").input_ids
    firsts = torch.zeros(vocab + 1, dtype=torch.long)
    for seed in range(replies):
        seeded = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        # The first step holds the first token (none: the reply ended at EOS), the law tested: the
        # reply is stopped there (300 replies: 1.9 s -> 1.5 s, the same first tokens seed by seed).
        first = next(iter(compiled.generate(prompt_ids, max_new_tokens=2, sampling=seeded)))
        firsts[first.tokens[0].id if first.tokens else vocab] += 1
    assert chi_square_p_value(firsts, exact_first_two(pair.target, prompt_ids, vocab, eos)[0]) > ALPHA
    assert chi_square_p_value(firsts, exact_first_two(pair.draft, prompt_ids, vocab, eos)[0]) < 1e-6


APART = pytest.mark.xdist_group("compile-apart")
"""Out of `COMPILED_FORWARDS`: tests after which the group's later tests would compile the forwards
again: those that reset torch._dynamo (a layer made untraceable), and a Gemma 2 model bound (the
compiled forwards' guards fail after it: test_prefix_reuse's compiled conversation 3.4 s before it,
11.3 s after)."""


@APART
def test_a_sliding_window_model_runs_eagerly_with_a_reason(tmp_path: Path, target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "gemma2", "gemma2", seed=0, tokenizer_dir=target_dir)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    bound = bind(model, 512, compiled=True, capacity=64)
    assert type(bound) is CachedModel
    assert bound.compile_error == (
        "Gemma2ForCausalLM has StaticSlidingWindowLayer layers; --compile needs full-attention layers only"
    )
    whole = bind(model, 512, compiled=None, capacity=64, static=True)
    assert whole.compile_error == (
        "Gemma2ForCausalLM has StaticSlidingWindowLayer layers; --whole-step needs full-attention layers only"
    )
    # Asked for on the CPU by default: not compiled, and nothing to say.
    assert bind(model, 512, compiled=None, capacity=64).compile_error is None


@APART  # binds a Gemma 2 model
def test_whole_steps_are_the_default_where_they_run(
    pair: ModelPair, llama_pair: ModelPair, tmp_path: Path, target_dir: Path
) -> None:
    """`ModelPair.whole_step`: as asked where asked; by default (None) for transformers models of
    full-attention layers on the CPU and on CUDA alike (the pair's device is only a label to this
    decision: a pair labelled CUDA stands in for one here, where no GPU is), not on llama.cpp (its
    runner has its own steps), and not for a sliding-window model, which then decodes per-forward
    with nothing to say."""
    assert pair.whole_step(None) is True and pair.whole_step(False) is False
    assert dataclasses.replace(pair, device=torch.device("cuda")).whole_step(None) is True
    assert type(pair.speculative(Controls(), whole_step=None).cached_models[0]) is StaticModel
    assert llama_pair.whole_step(None) is False
    path = save_tiny_model(tmp_path / "gemma2", "gemma2", seed=0, tokenizer_dir=target_dir)
    sliding = load_pair(ModelSpec(str(path)), ModelSpec(LOOKUP), LoadOptions(device="cpu"))
    assert sliding.whole_step(None) is False and sliding.whole_step(True) is True
    decoder = sliding.speculative(Controls(), whole_step=None)
    assert type(decoder.cached_models[0]) is CachedModel and decoder.compile_error is None


def untraceable(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` behind a graph break (`torch._dynamo.graph_break`, a no-op when run eagerly): a
    layer torch.compile cannot trace into one whole graph."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        torch._dynamo.graph_break()
        return forward(*args, **kwargs)

    return broken


@APART
def test_falls_back_to_eager_when_a_layer_cannot_be_traced(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole-graph compilation fails at once, and the decoder goes on eagerly with the same
    output. (A failure later, in inductor's C++ compiler, is tests/tui/test_decoder_choice.py's.)"""
    layer = pair.target.model.layers[0]
    monkeypatch.setattr(layer, "forward", untraceable(layer.forward))
    torch._dynamo.reset()
    try:
        got = decoder(pair, "exact", True)
        ids = pair.tokenizer(PROMPTS[0]).input_ids
        run = collect(got.generate(ids, max_new_tokens=40, sampling=SamplingConfig()))
        eager = decoder(pair, "exact", False)
        assert run.ids == collect(eager.generate(ids, max_new_tokens=40, sampling=SamplingConfig())).ids
        assert got.compile_error is not None and got.compile_error.startswith("Unsupported: ")
        assert "\n" not in got.compile_error
    finally:
        monkeypatch.undo()
        torch._dynamo.reset()


@APART
@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ([], "UncapturedHigherOrderOpError"),  # the CPU's default: the whole step's functions compiled
        (["--no-whole-step"], "Unsupported"),  # per-forward steps compiled (CUDA's default)
    ],
)
def test_generate_says_when_compile_falls_back(
    target_dir: Path,
    draft_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    error: str,
) -> None:
    monkeypatch.setattr(LlamaDecoderLayer, "forward", untraceable(LlamaDecoderLayer.forward))
    # The layer regions made of the broken forward stay in a dict of their own (`regions._REGIONS`
    # keeps one a class for the process).
    monkeypatch.setattr(regions, "_REGIONS", {})
    torch._dynamo.reset()
    try:
        args = [
            "generate",
            *pair_args(target_dir, draft_dir),
            "--compile",
            *flags,
            "-T",
            "0",
            "--max-new-tokens",
            "30",
        ]
        code, out, err = run_cli([*args, PROMPTS[0]], capsys)
    finally:
        monkeypatch.undo()
        torch._dynamo.reset()
    assert code == 0 and out.strip()
    assert err.count("\n") == 1 and err.startswith(
        f"fsd-chat: --compile fell back to eager forward passes: {error}"
    )
