"""Drafts with another tokenizer (token-level intersection): pairs built from the offline draft with
its token ids shuffled (same strings, other ids) and with part of its vocabulary removed.

The law tests are chi-square goodness-of-fit tests at α = 0.001 on the first token of SAMPLES
replies per rule (fixed seeds, so reproducible; four rules: false-alarm probability ≤ 0.004). Each
also rejects, at p < 1e-6, a law that differs from the one predicted, which shows the test's power:
the mixture's law for `exact`; for the relaxed rules the target's p, and the law the rule would
have with the draft's q before its vocabulary was cut (mass on tokens it can no longer propose).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import fsd_chat.models.vocabulary
from fsd_chat.bench.methods import PairRunner
from fsd_chat.bench.records import Configuration, Setup
from fsd_chat.conversation.transcript import render_markdown
from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.acceptance import mixture_weight
from fsd_chat.decoding.divergence import kl
from fsd_chat.decoding.mapped_draft import MappedProposer
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.decoding.settings import Rule
from fsd_chat.decoding.vocab_map import VocabularyMap
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import DeviceMemoryError, IncompatibleModelsError
from fsd_chat.tui.widgets.legend import Legend
from tests.decoding_helpers import collect
from tests.mapped_pairs import multi_character_tokens, pruned_draft
from tests.test_cli_generate import run_cli
from tests.test_mixture import bisection_weight
from tests.test_sampling_lossless import chi_square_p_value, rejected_by_the_statistic
from tests.test_transcript import session as transcript_session

CPU = LoadOptions(device="cpu", dtype="float32")
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park"]
LAW_PROMPT = "Once upon a time, there was a"
SAMPLES = 500
"""Replies per rule. Simulated (300 multinomial draws of SAMPLES first tokens from each rule's law,
through these very statistics): every power check below rejected at p < 1e-6 in all 300, the
weakest (`exact` against the mixture's law) at p ≤ 3e-13 in the worst draw; at most 1 false alarm
at α = 0.001 in each law's 300 draws (as the nominal rate predicts; 300 draws resolve no finer).
2,000 replies (p ≈ 1e-100 at the expected statistic) took four times as long for no bound the
tests state."""
ALPHA = 1e-3
LAW_SAMPLING = SamplingConfig(temperature=0.9)
MIXTURE_BUDGET = 0.2


@pytest.fixture(scope="module")
def removed(target_dir: Path, draft_dir: Path) -> set[int]:
    """Old ids the pruned draft lacks: a quarter of its multi-character tokens, and the three it
    finds likeliest after LAW_PROMPT (so its law there moves), none of the prompt's own."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = tokenizer(LAW_PROMPT).input_ids
    multi = [i for i in multi_character_tokens(draft_dir) if i not in ids]
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    with torch.inference_mode():
        likeliest = draft(torch.tensor([ids])).logits[0, -1].argsort(descending=True).tolist()
    order = torch.randperm(len(multi), generator=torch.Generator().manual_seed(0)).tolist()
    return {multi[i] for i in order[: len(multi) // 4]} | set([i for i in likeliest if i in multi][:3])


@pytest.fixture(scope="module")
def pruned(
    tmp_path_factory: pytest.TempPathFactory, target_dir: Path, draft_dir: Path, removed: set[int]
) -> ModelPair:
    """The target with its draft missing the tokens `removed` (loaded whatever its coverage: the
    laws hold at any coverage, and the refusal is tested on its own)."""
    directory, _ = pruned_draft(draft_dir, tmp_path_factory.mktemp("mapped") / "pruned", removed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fsd_chat.models.vocabulary, "MIN_COVERAGE", 0.0)
        return load_pair(ModelSpec(str(target_dir)), ModelSpec(str(directory)), CPU)


def test_the_pairs_are_mapped_and_named(shuffled: ModelPair, pruned: ModelPair, removed: set[int]) -> None:
    assert shuffled.draft_kind == pruned.draft_kind == "mapped"
    assert shuffled.vocab_map is not None and shuffled.vocab_map.size == 512
    assert pruned.vocab_map is not None and pruned.vocab_map.size == 512 - len(removed)
    assert shuffled.coverage == pytest.approx(1.0)
    assert pruned.coverage is not None and 0.5 < pruned.coverage < 0.99
    assert "mapped vocabulary, 100% coverage" in shuffled.describe()


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["exact", "fuzzy", "mixture"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, top_p=0.95)])
def test_shuffled_ids_decode_as_the_original_draft(
    pair: ModelPair, shuffled: ModelPair, rule: Rule, sampling: SamplingConfig
) -> None:
    settings = DecodingSettings(rule=rule, threshold=0.3 if rule == "fuzzy" else 0.05)
    for seed, prompt in enumerate(PROMPTS):
        ids = pair.tokenizer(prompt).input_ids
        seeded = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed)
        runs = [
            collect(p.speculative(Controls(settings)).generate(ids, max_new_tokens=60, sampling=seeded))
            for p in (pair, shuffled)
        ]
        assert runs[0].ids == runs[1].ids
        assert runs[0].origins == runs[1].origins  # the same acceptances, position by position


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["exact", "fuzzy", "pure", "mixture"])
def test_greedy_at_zero_threshold_is_the_target(
    pair: ModelPair, shuffled: ModelPair, pruned: ModelPair, rule: Rule
) -> None:
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt).input_ids
        target = collect(pair.autoregressive(Controls()).generate(ids, max_new_tokens=60))
        for mapped in (shuffled, pruned):
            decoder = mapped.speculative(Controls(DecodingSettings(rule=rule, threshold=0.0)))
            run = collect(decoder.generate(ids, max_new_tokens=60))
            assert run.ids == target.ids
            assert run.stats.drafted > 0


@pytest.mark.parametrize("temperature", [0.0, 1.5])
@pytest.mark.slow
def test_the_draft_reads_the_targets_text_after_every_step(pruned: ModelPair, temperature: float) -> None:
    # Hot sampling reaches rare tokens (bytes of multi-byte characters among them).
    tokenizer, draft_tokenizer = pruned.tokenizer, AutoTokenizer.from_pretrained(pruned.draft_spec.source)
    ids = tokenizer("Tom and Sue went to the park. They saw a big dog.").input_ids
    decoder = pruned.speculative(Controls(DecodingSettings(rule="exact")))
    assert isinstance(decoder.proposer, MappedProposer)
    emitted = list(ids)
    for step in decoder.generate(ids, max_new_tokens=150, sampling=SamplingConfig(temperature, seed=0)):
        emitted += [t.id for t in step.tokens]
        if step.stop_reason is None:
            spelled = decoder.proposer.mapped.spelled()
            assert draft_tokenizer.decode(spelled) == tokenizer.decode(emitted)


def _mapped_q(draft_dir: Path, removed: set[int], prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pruned draft's proposal law after the prompt, over the target's ids, computed from the
    original draft (the prompt has no removed token, so both read the same tokens), and the
    original draft's own law: [vocab] each."""
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    with torch.inference_mode():
        logits = draft(torch.tensor([prompt_ids])).logits[0, -1]
    cut = logits.clone()
    cut[sorted(removed)] = float("-inf")
    return probabilities(cut, LAW_SAMPLING), probabilities(logits, LAW_SAMPLING)


def _law(rule: Rule, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The first token's law with one draft token from q, target p, for each rule's threshold in
    `test_first_token_law_under_each_rule` (relaxed rules always relax there)."""
    residual = (p - q).clamp_min(0.0)
    residual /= residual.sum()
    on_support = torch.where(p > 0, q, 0.0)
    outside = 1 - on_support.sum()
    if rule == "exact":
        return p
    if rule == "fuzzy":
        return on_support + outside * residual
    if rule == "pure":
        return on_support + outside * p
    # mixture: r = (1 − λ)p + λq with the largest λ whose KL(r ‖ p) ≤ budget (bisection, float64),
    # sampled exactly from q (the residual after a rejection is the exact rule's).
    p64, q64 = p.double(), q.double()
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kl((1 - mid) * p64 + mid * q64, p64) <= MIXTURE_BUDGET else (lo, mid)
    return ((1 - lo) * p64 + lo * q64).float()


@pytest.mark.slow  # statistical: SAMPLES replies per rule
@pytest.mark.parametrize(
    ("rule", "threshold", "first_seed"),
    [
        ("exact", 0.0, 0),
        ("fuzzy", math.log(2.0), SAMPLES),
        ("pure", math.log(2.0), 2 * SAMPLES),
        ("mixture", MIXTURE_BUDGET, 3 * SAMPLES),
    ],
)
def test_first_token_law_under_each_rule(
    pair: ModelPair,
    pruned: ModelPair,
    draft_dir: Path,
    removed: set[int],
    rule: Rule,
    threshold: float,
    first_seed: int,
) -> None:
    prompt_ids = pair.tokenizer(LAW_PROMPT).input_ids
    decoder = pruned.speculative(Controls(DecodingSettings(rule=rule, threshold=threshold, draft_tokens=1)))
    vocab = pair.vocab_size
    counts = torch.zeros(vocab, dtype=torch.long)
    for seed in range(first_seed, first_seed + SAMPLES):
        sampling = SamplingConfig(LAW_SAMPLING.temperature, LAW_SAMPLING.top_k, LAW_SAMPLING.top_p, seed=seed)
        steps = decoder.generate(prompt_ids, max_new_tokens=2, sampling=sampling)
        counts[next(steps).tokens[0].id] += 1  # this prompt's first token is never EOS

    with torch.inference_mode():
        p = probabilities(pair.target(torch.tensor([prompt_ids])).logits[0, -1, :vocab], LAW_SAMPLING)
    q, original = _mapped_q(draft_dir, removed, prompt_ids)
    assert chi_square_p_value(counts, _law(rule, p, q)) > ALPHA
    # Laws of full support: q is 0 where p holds 84%, so few samples would be left to compare.
    wrong = [_law("mixture", p, q)] if rule == "exact" else [p, _law(rule, p, original)]
    for law in wrong:
        assert rejected_by_the_statistic(counts, law)


def test_running_out_of_memory_frees_the_mapped_drafts_cache(
    shuffled: ModelPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No GPU runs here: torch's out-of-memory error is raised by the draft model's forward,
    # patched on the instance (a mock standing in for CUDA, as in test_device_errors).
    decoder = shuffled.speculative(Controls(DecodingSettings(threshold=0.0)))
    assert isinstance(decoder.proposer, MappedProposer)
    draft = decoder.proposer.mapped.model
    ids = shuffled.tokenizer("Once upon a time").input_ids
    expected = collect(decoder.generate(ids, max_new_tokens=40)).ids
    assert draft.seen > 0  # kept between replies
    forward = draft.model.forward
    calls = 0

    def failing(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*args, **kwargs)

    monkeypatch.setattr(draft.model, "forward", failing)
    with pytest.raises(DeviceMemoryError):
        collect(decoder.generate(ids, max_new_tokens=40))
    assert calls == 3
    assert draft.seen == 0 and draft.cache.get_seq_length() == 0
    assert decoder.target.seen == 0
    monkeypatch.undo()
    assert collect(decoder.generate(ids, max_new_tokens=40)).ids == expected


def test_a_draft_covering_too_little_is_refused_with_its_share(
    tmp_path: Path, target_dir: Path, draft_dir: Path
) -> None:
    directory, _ = pruned_draft(draft_dir, tmp_path / "gutted", set(multi_character_tokens(draft_dir)))
    with pytest.raises(IncompatibleModelsError, match=r"hold only \d+% of the target's probability mass"):
        load_pair(ModelSpec(str(target_dir)), ModelSpec(str(directory)), CPU)


def test_mixture_weight_where_the_draft_has_no_mass(
    pair: ModelPair, draft_dir: Path, removed: set[int]
) -> None:
    # The pruned draft's q is 0 on the removed tokens, which hold 84% of p after LAW_PROMPT:
    # KL(r_λ ‖ p)'s slope is infinite at λ = 1, which once sent Newton's first step to λ = 0 (no
    # relaxation at all; the bisection's λ is 0.31 at this budget).
    prompt_ids = pair.tokenizer(LAW_PROMPT).input_ids
    with torch.inference_mode():
        p = probabilities(
            pair.target(torch.tensor([prompt_ids])).logits[0, -1, : pair.vocab_size], LAW_SAMPLING
        )
    q, _ = _mapped_q(draft_dir, removed, prompt_ids)
    assert float(p[q == 0].sum()) > 0.5
    for budget in (0.01, MIXTURE_BUDGET, 1.0):
        lam, _ = mixture_weight(p[None], q[None], budget)
        assert torch.allclose(lam.double(), bisection_weight(p[None], q[None], budget), atol=1e-4)


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE vocabulary: `Ġ` for a space, one character per byte."""
    vocab = {"<|endoftext|>": 0, "Ġthe": 1, "Ċ": 2, "A": 3, "Ġ": 4, "Ã©": 5, "t": 6, "c": 7, "a": 8}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def test_byte_level_and_sentencepiece_tokens_pair_by_their_bytes(target_dir: Path) -> None:
    sentencepiece = AutoTokenizer.from_pretrained(target_dir)
    mapping = VocabularyMap(sentencepiece, _byte_level_tokenizer(), 512, 9)
    pairs = dict(zip(mapping.target_ids.tolist(), mapping.draft_ids.tolist(), strict=True))
    vocab = sentencepiece.get_vocab()
    assert pairs[vocab["▁the"]] == 1
    assert pairs[vocab["<0x0A>"]] == 2  # SentencePiece spells a newline as a byte token
    assert pairs[vocab["A"]] == 3 and vocab["<0x41>"] not in pairs  # "A" pairs with "A", not <0x41>
    assert pairs[vocab["é"]] == 5  # two bytes in byte-level BPE
    assert pairs[vocab["</s>"]] == 0  # EOS pairs with EOS by role
    # Target tokens the draft lacks are spelled in its tokens.
    assert mapping.translate([vocab["▁c"], vocab["at"]]) == [4, 7, 8, 6]
    assert mapping.translate([vocab["<s>"]]) == []  # no BOS in the draft: it does not see one


def test_generate_json_and_the_transcript_name_the_mapped_draft(
    target_dir: Path, shuffled: ModelPair, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--target", str(target_dir), "--draft", shuffled.draft_spec.source, "--device", "cpu"]
    code, out, _ = run_cli([*args, "--json", "--max-new-tokens", "8", "Once upon a time"], capsys)
    assert code == 0
    assert json.loads(out.splitlines()[-1])["draft"] == {"kind": "mapped", "coverage": pytest.approx(1.0)}
    mapped = replace(transcript_session(), models={**transcript_session().models, "draft_kind": "mapped"})
    assert "| Draft | `/m/draft` · vocabulary mapped onto the target's |" in render_markdown(mapped)
    assert "| Draft | `/m/draft` |" in render_markdown(transcript_session())


def test_the_legend_names_the_mapped_draft() -> None:
    assert "mapped" in str(Legend(False, draft_label="draft vocabulary mapped (97% coverage)").content)
    assert "mapped" not in str(Legend(False).content)


def test_bench_refuses_transformers_sampling_with_a_draft_inside_the_targets_vocabulary(
    pruned: ModelPair,
) -> None:
    """The pruned draft's every token is the target's: transformers 5.24's universal assisted
    generation fails when it samples with such a draft (an AttributeError deep in its vocabulary
    translator), so bench says so in one line instead; greedy, it runs."""
    runner = PairRunner(pruned)
    ids = pruned.tokenizer("Once upon a time").input_ids
    try:
        greedy = runner.run(
            Configuration(Setup("float32"), 0.0, "hf-assisted", 3),
            ids,
            max_new_tokens=8,
            seed=0,
            stop_strings=(),
        )
        assert greedy.token_ids
        with pytest.raises(IncompatibleModelsError, match="--temperature 0"):
            runner.run(
                Configuration(Setup("float32"), 1.0, "hf-assisted", 3),
                ids,
                max_new_tokens=8,
                seed=0,
                stop_strings=(),
            )
    finally:
        runner.close()
