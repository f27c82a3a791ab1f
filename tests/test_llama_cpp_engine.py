"""The llama.cpp engine (`fsd_chat.engines.llama_cpp`) behind the decoding loop's seam, on a real
llama.cpp (llama-cpp-python): the offline pair written as float32 GGUF files, and the real default
chat model (SmolLM2-135M-Instruct Q4_1).

- the runner: its logits are the transformers model's on the same weights, at the positions asked
  for, through any chunking of a long feed; they are a view of llama.cpp's buffer (no copy);
  rollback and prefix reuse give the logits of a fresh feed;
- greedy identity: fsd-chat's target-only and speculative decoding (prompt lookup, exact rule) on
  the llama.cpp engine emit llama.cpp's own greedy decoding (`Llama.generate` at temperature 0) on
  the default model, token for token, and so does the bench's llama.cpp baseline on summaries; a
  GGUF draft's exact greedy decoding is target-only decoding;
- the engine choice (`--engine`) and its one-line errors;
- prefix reuse across turns, `--threads`.

The sampling-law tests and the live dial run on both engines in `test_sampling_lossless` and
`test_live_controls` (`engine_pair`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fsd_chat.bench.llama_baselines import baseline_llama, llama_generate
from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.records import ForwardTally
from fsd_chat.decoding import AutoregressiveDecoder, Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.settings import SamplingRequest
from fsd_chat.engines import llama_cpp as engine
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import resolve_target
from fsd_chat.models.engine_choice import choose_engine
from fsd_chat.models.generation import FileGeneration, file_generation
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import ModelLoadError
from tests.conftest import LLAMA_CPP_MISSING, TARGET_DIR
from tests.test_bench import DATA_DIR

llama_cpp = pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)

PROMPT = "Once upon a time, there was a little"
NO_PROGRESS = print


def ids_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long)


def test_the_runner_is_the_seam(llama_pair: ModelPair) -> None:
    assert isinstance(llama_pair.target, engine.LlamaCppModel)
    assert isinstance(llama_pair.target, ModelRunner)
    assert llama_pair.engine == "llama.cpp"
    assert llama_pair.vocab_size == 512


def test_logits_are_the_transformers_models_at_the_positions_asked_for(
    llama_pair: ModelPair, pair: ModelPair
) -> None:
    """The same float32 weights: llama.cpp's logits match transformers' within its float16 KV cache's rounding, for
    the last `keep` positions of a feed, and the next feed continues the sequence."""
    runner = llama_pair.target
    assert isinstance(runner, engine.LlamaCppModel)
    ids = pair.tokenizer.encode(PROMPT + " girl who liked to play")
    with torch.inference_mode():
        reference = pair.target(ids_tensor(ids)).logits[0, :, :512]
    runner.reset()
    first = runner.forward(ids_tensor(ids), 6, keep=3).clone()
    rest = runner.forward(ids_tensor(ids), len(ids), keep=len(ids) - 6).clone()
    assert runner.seen == len(ids)
    torch.testing.assert_close(first, reference[3:6], atol=2e-2, rtol=0.0)
    torch.testing.assert_close(rest, reference[6:], atol=2e-2, rtol=0.0)


def test_a_feed_longer_than_a_batch_is_read_in_chunks(
    monkeypatch: pytest.MonkeyPatch, llama_pair: ModelPair, pair: ModelPair
) -> None:
    """With a batch of 4 tokens, an 11-token feed is three decodes (3 + 4 + 4, the short one first,
    so that the 5 positions asked for... at most a batch: here 4 lie in the last chunk)."""
    monkeypatch.setattr(engine, "BATCH", 4)
    runner = engine.LlamaCppModel(llama_pair.target.llama, 512)  # type: ignore[union-attr]
    ids = pair.tokenizer.encode(PROMPT + " girl")[:11]
    assert len(ids) == 11
    with torch.inference_mode():
        reference = pair.target(ids_tensor(ids)).logits[0, :, :512]
    runner.reset()
    logits = runner.forward(ids_tensor(ids), 11, keep=4)
    torch.testing.assert_close(logits, reference[7:], atol=2e-2, rtol=0.0)
    with pytest.raises(ValueError, match="at most 4"):
        runner.forward(ids_tensor([*ids, 5, 6, 7, 8, 9]), 16, keep=5)
    llama_pair.target.reset()  # type: ignore[union-attr]  # the pair's runner shares the context


def test_logits_are_a_view_of_llama_cpps_buffer(llama_pair: ModelPair) -> None:
    runner = llama_pair.target
    assert isinstance(runner, engine.LlamaCppModel)
    runner.reset()
    logits = runner.forward(ids_tensor([1, 400, 300]), 3, keep=2)
    buffer = llama_cpp.llama_get_logits(runner.llama.ctx)
    address = np.ctypeslib.as_array(buffer, shape=(1,)).__array_interface__["data"][0]
    assert logits.data_ptr() == address
    assert logits.shape == (2, 512)


def test_rollback_and_prefix_reuse_give_a_fresh_feeds_logits(llama_pair: ModelPair) -> None:
    runner = llama_pair.target
    assert isinstance(runner, engine.LlamaCppModel)
    ids = llama_pair.tokenizer.encode(PROMPT)
    other = [*ids[:5], 77, 78, 79]
    runner.reset()
    fresh = runner.forward(ids_tensor(other), len(other), keep=3).clone()
    runner.reset()
    runner.forward(ids_tensor(ids), len(ids), keep=1)
    runner.rollback(5)
    assert runner.seen == 5
    torch.testing.assert_close(runner.forward(ids_tensor(other), len(other), keep=3), fresh)
    # A new sequence sharing 5 tokens with the cached one keeps them, and reads only the rest.
    runner.reset()
    runner.forward(ids_tensor(ids), len(ids), keep=1)
    assert runner.keep_prefix(ids_tensor(other), len(other)) == 5
    torch.testing.assert_close(runner.forward(ids_tensor(other), len(other), keep=3), fresh)
    assert runner.keep_prefix(ids_tensor([9, 9]), 2) == 0


def test_an_empty_cache_is_not_cleared_again(llama_pair: ModelPair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply starting on an empty cache (the bench empties it before every reply) writes nothing:
    clearing llama.cpp's memory writes its whole KV buffer. A cache holding tokens is cleared."""
    runner = llama_pair.target
    assert isinstance(runner, engine.LlamaCppModel)
    runner.reset()
    cleared: list[object] = []
    clear = runner._llama_cpp.llama_memory_clear
    monkeypatch.setattr(
        runner._llama_cpp, "llama_memory_clear", lambda *args: cleared.append(args) or clear(*args)
    )
    assert runner.keep_prefix(ids_tensor([5, 6, 7]), 3) == 0
    assert cleared == []
    runner.forward(ids_tensor([5, 6, 7]), 3, keep=1)
    assert runner.keep_prefix(ids_tensor([9, 9]), 2) == 0
    assert len(cleared) == 1 and runner.seen == 0


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """The default chat model on llama.cpp, one thread, prompt lookup."""
    return load_pair(
        ModelSpec(resolve_target("default")), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1)
    )


def chat_prompt(pair: ModelPair, text: str) -> list[int]:
    return prompt_ids(pair.tokenizer, [Message("user", text)])


def llama_greedy(pair: ModelPair, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy decoding of `prompt` on a `Llama` of its own (up to EOS, n tokens)."""
    assert isinstance(pair.target, engine.LlamaCppModel)
    llama = engine.open_gguf(pair.target.path, threads=1, gpu=False)
    ids: list[int] = []
    for token in llama.generate(prompt, temp=0.0, repeat_penalty=1.0):
        if token in pair.target.eos_token_ids or len(ids) == n:
            break
        ids.append(token)
    llama.close()
    return ids


def decoded(decoder: object, prompt: list[int], n: int) -> list[int]:
    return [
        t.id
        for step in decoder.generate(prompt, max_new_tokens=n, sampling=SamplingConfig())  # type: ignore[attr-defined]
        for t in step.tokens
    ]


@pytest.mark.slow
def test_a_verify_batch_gives_the_logits_of_its_tokens_fed_one_by_one(default_pair: ModelPair) -> None:
    """The default model's logits for a few tokens fed as one batch after a cached prompt (as a
    verify feeds them) are those of the same tokens fed one at a time, to the bit: what greedy
    speculative decoding needs to emit the target alone's greedy text. (Without flash attention
    they were up to 1.0 apart on an AVX-512 CPU, which changed a greedy token at a near tie.)"""
    prompt = chat_prompt(default_pair, "What is the capital of France?")
    seq = ids_tensor(prompt + llama_greedy(default_pair, prompt, 8))
    runner = default_pair.target
    assert isinstance(runner, engine.LlamaCppModel)
    one_by_one = []
    runner.reset()
    runner.prefill(seq, len(prompt))
    for upto in range(len(prompt) + 1, seq.shape[1] + 1):
        one_by_one.append(runner.forward(seq, upto, 1)[0].clone())
    runner.reset()
    runner.prefill(seq, len(prompt))
    batch = runner.forward(seq, seq.shape[1], seq.shape[1] - len(prompt)).clone()
    assert torch.equal(batch, torch.stack(one_by_one))


@pytest.mark.slow
def test_greedy_decoding_is_llama_cpps_own_on_the_default_model(default_pair: ModelPair) -> None:
    """Target-only and speculative decoding with prompt lookup (exact rule) on the llama.cpp engine
    emit exactly llama.cpp's greedy tokens, on a prompt that copies (lookup hits) and one that does not."""
    texts = [
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
        "What is the capital of France?",
    ]
    for text in texts:
        prompt = chat_prompt(default_pair, text)
        expected = llama_greedy(default_pair, prompt, 64)
        assert len(expected) > 5
        target_only = default_pair.autoregressive(Controls())
        assert decoded(target_only, prompt, 64) == expected
        lookup = default_pair.speculative(Controls(DecodingSettings(rule="exact", draft_tokens=5)))
        assert decoded(lookup, prompt, 64) == expected


@pytest.mark.slow
def test_the_bench_llama_cpp_baseline_emits_the_target_alones_greedy_summaries(
    default_pair: ModelPair,
) -> None:
    """The bench's llama.cpp baseline (`llama_generate`) reads a prompt as fsd-chat's decoders do,
    all but its last token and then the last, so its greedy replies are the target alone's token
    for token and its decode clock times the same text. Read whole (`Llama.generate` alone), these
    two summaries parted from the target alone's after 7 and 21 tokens (2026-11-29, this CPU)."""
    items = load_prompt_set("tinystories-summarise-chat", data_dir=DATA_DIR, limit=5).items[3:5]
    target = default_pair.target
    assert isinstance(target, engine.LlamaCppModel)
    llama = baseline_llama(target, lookup_tokens=None)
    try:
        for item in items:
            prompt = chat_prompt(default_pair, item.text)
            # Both read the prompt from an empty cache, as the bench has them: a cached prefix moves
            # the batches' bounds, and with them the logits' last bits.
            target.reset()
            llama.reset()
            expected = decoded(default_pair.autoregressive(Controls()), prompt, 40)
            assert len(expected) == 40
            baseline = llama_generate(
                llama,
                prompt,
                SamplingConfig(),
                max_new_tokens=40,
                eos=target.eos_token_ids,
                stop_strings=(),
                tally=ForwardTally(),
                stop=lambda: False,
            )
            assert list(baseline) == expected
    finally:
        llama.close()


QUIET_FORWARDS = {
    1: {1: 18.2, 2: 31.8, 4: 54.1, 8: 97.4, 16: 177, 32: 352},
    2: {1: 11.3, 2: 19.0, 4: 27.5, 8: 45.3, 16: 91.5, 32: 183},
}
"""`LlamaCppModel.forward` over w tokens of the default model, ms by threads and w: 100 tokens of
context, medians of 10 on a quiet 2-core CPU (load 0.4; `engine.LAYER_SECONDS` tells the fit)."""


def test_the_file_type_is_the_gguf_files_quantization(default_pair: ModelPair, llama_pair: ModelPair) -> None:
    """The bench names a llama.cpp row by it: the default model is Q4_1, the offline pair float32."""
    assert isinstance(default_pair.target, engine.LlamaCppModel)
    assert isinstance(llama_pair.target, engine.LlamaCppModel)
    assert (default_pair.target.file_type, llama_pair.target.file_type) == ("Q4_1", "F32")


def modelled(pair: ModelPair) -> ForwardTimings:
    """The pair's forward times as the model prices them at its threads, none measured."""
    assert isinstance(pair.target, engine.LlamaCppModel)
    return engine.priced_timings(pair.target, None, {})


def test_modelled_forwards_follow_the_threads_and_the_measured_times(default_pair: ModelPair) -> None:
    """The modelled times (what wider verifies than the calibrated ones are priced from) are the
    measured ones at the thread count in use, within 10%: on two threads a verify is cheaper
    against V(1)."""
    ratios = {}
    try:
        for threads, measured in QUIET_FORWARDS.items():
            default_pair.use_threads(threads)
            timings = modelled(default_pair)
            table = timings.verify_table(context=100)
            for width, ms in measured.items():
                priced = (table[width] if width < len(table) else timings.verify_seconds(width)) * 1000
                assert priced == pytest.approx(ms, rel=0.1), (threads, width)
            ratios[threads] = table[6] / table[1]
    finally:
        default_pair.use_threads(1)
    assert ratios[2] < 0.9 * ratios[1]


def test_a_verify_is_priced_at_the_batch_threads(default_pair: ModelPair) -> None:
    """One thread for one token and two for a batch (the chat's split on an idle 2-core CPU): the
    model prices V(1) as the one-thread forward, a verify as the two-thread one, within 10% of the
    measured times, over a longer context too; a verify is then cheaper against V(1) than on one
    thread or two alone."""

    def tables(threads: int, batch: int | None = None) -> tuple[list[float], list[float]]:
        default_pair.use_threads(threads, requested_batch=batch)
        timings = modelled(default_pair)
        return timings.verify_table(context=100), timings.verify_table(context=1100)

    try:
        (split, split_long), one, two = tables(1, 2), tables(1), tables(2)
        assert split[1] * 1000 == pytest.approx(QUIET_FORWARDS[1][1], rel=0.1)
        for width in (2, 4):
            assert split[width] * 1000 == pytest.approx(QUIET_FORWARDS[2][width], rel=0.1)
        for width, alone in ((1, one), (2, two), (6, two)):  # the context's attention alike
            assert split_long[width] - split[width] == pytest.approx(alone[1][width] - alone[0][width])
        for alone, _ in (one, two):
            assert split[6] / split[1] < 0.9 * alone[6] / alone[1]
    finally:
        default_pair.use_threads(1)


def test_a_gguf_drafts_exact_greedy_decoding_is_target_only_decoding(llama_pair: ModelPair) -> None:
    prompt = llama_pair.tokenizer.encode(PROMPT)
    target_only = decoded(llama_pair.autoregressive(Controls()), prompt, 40)
    decoder = llama_pair.speculative(Controls(DecodingSettings(rule="exact", draft_tokens=4)))
    steps = list(decoder.generate(prompt, max_new_tokens=40, sampling=SamplingConfig()))
    assert [t.id for s in steps for t in s.tokens] == target_only
    assert sum(s.stats.draft_forwards for s in steps) > 0  # the GGUF draft did draft
    assert sum(s.stats.accepted_exact for s in steps) > 0


def test_prefix_reuse_across_turns_reads_only_the_new_tokens(llama_pair: ModelPair) -> None:
    controls = Controls()
    decoder = llama_pair.speculative(controls)
    first = llama_pair.tokenizer.encode(PROMPT)
    reply = decoded(decoder, first, 10)
    second = [*first, *reply, *llama_pair.tokenizer.encode(" The end.")[1:]]
    decoded(decoder, second, 5)
    # Everything the first turn fed is kept: its prompt and its reply but the last token.
    assert controls.cached_prompt_tokens >= len(first) + len(reply) - 1


def test_threads_set_llama_cpps_threads_and_leave_torch_one(llama_pair: ModelPair) -> None:
    """`--threads` (`ModelPair.use_threads`, which every command calls after loading) sets both
    models' llama.cpp threads; torch keeps one."""
    target, draft = llama_pair.target, llama_pair.draft
    assert isinstance(target, engine.LlamaCppModel) and isinstance(draft, engine.LlamaCppModel)
    assert target.threads == 1 and llama_cpp.llama_n_threads(target.llama.ctx) == 1
    assert llama_pair.describe().endswith("llama.cpp cpu, 1 thread")
    try:
        llama_pair.use_threads(2)
        for model in (target, draft):
            assert llama_cpp.llama_n_threads(model.llama.ctx) == 2
            assert llama_cpp.llama_n_threads_batch(model.llama.ctx) == 2
        assert torch.get_num_threads() == 1
        assert llama_pair.describe().endswith("llama.cpp cpu, 2 threads")
        llama_pair.use_threads(1, requested_batch=2)  # `--threads 1 --threads-batch 2`
        for model in (target, draft):
            assert llama_cpp.llama_n_threads(model.llama.ctx) == 1
            assert llama_cpp.llama_n_threads_batch(model.llama.ctx) == 2
        assert llama_pair.describe().endswith("llama.cpp cpu, 1 thread, 2 a batch")
        baseline = baseline_llama(target, lookup_tokens=None)  # the bench's llama.cpp rows
        assert (baseline.n_threads, baseline.n_threads_batch) == (1, 2)
    finally:
        llama_pair.use_threads(1)


def test_auto_takes_llama_cpp_for_a_gguf_file_and_transformers_for_a_folder(
    stories_gguf_files: tuple[Path, Path],
) -> None:
    target, draft = stories_gguf_files
    auto = LoadOptions()
    gguf = choose_engine(ModelSpec(str(target)), ModelSpec(str(draft)), auto, NO_PROGRESS)
    assert (gguf.engine, gguf.reason) == ("llama.cpp", "a GGUF file, llama-cpp-python installed")
    folder = choose_engine(ModelSpec(str(TARGET_DIR)), ModelSpec("lookup"), auto, NO_PROGRESS)
    assert (folder.engine, folder.reason) == ("transformers", "stories260K is not a GGUF file")
    mixed = choose_engine(ModelSpec(str(target)), ModelSpec(str(TARGET_DIR)), auto, NO_PROGRESS)
    assert mixed.engine == "transformers"
    asked = choose_engine(
        ModelSpec(str(target)), ModelSpec("lookup"), LoadOptions(engine="transformers"), NO_PROGRESS
    )
    assert (asked.engine, asked.reason) == ("transformers", "--engine transformers")


def test_llama_cpp_refuses_a_model_that_is_not_a_gguf_file_in_one_line() -> None:
    with pytest.raises(ModelLoadError) as error:
        choose_engine(
            ModelSpec(str(TARGET_DIR)), ModelSpec("lookup"), LoadOptions(engine="llama.cpp"), NO_PROGRESS
        )
    assert str(error.value) == (
        "--engine llama.cpp runs GGUF files, and stories260K is not one: name a .gguf file, or use --engine "
        "transformers"
    )


def test_without_llama_cpp_python_auto_falls_back_and_llama_cpp_is_refused(
    monkeypatch: pytest.MonkeyPatch, stories_gguf_files: tuple[Path, Path]
) -> None:
    """llama-cpp-python absent (its import blocked, as Python does for a None in sys.modules)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    engine.llama_cpp_module.cache_clear()
    try:
        target = ModelSpec(str(stories_gguf_files[0]))
        auto = choose_engine(target, ModelSpec("lookup"), LoadOptions(), NO_PROGRESS)
        assert auto.engine == "transformers"
        assert auto.reason.startswith("a GGUF file, but llama-cpp-python is not available")
        with pytest.raises(
            ModelLoadError, match=r"^the llama\.cpp engine needs llama-cpp-python, which is not installed"
        ):
            choose_engine(target, ModelSpec("lookup"), LoadOptions(engine="llama.cpp"), NO_PROGRESS)
    finally:
        engine.llama_cpp_module.cache_clear()


def test_the_autoregressive_decoder_takes_a_runner_as_it_is(llama_pair: ModelPair) -> None:
    decoder = AutoregressiveDecoder(llama_pair.target, llama_pair.tokenizer)
    assert decoder.target is llama_pair.target
    assert decoder.context == 512  # the file's context, which caps the engine's n_ctx


def test_llama_cpps_tokenizer_is_the_models_own(llama_pair: ModelPair, pair: ModelPair) -> None:
    """llama.cpp's own tokenizer of the file (`LlamaCppTokenizer`) encodes and decodes text as the
    folder's tokenizer.json does (a special token typed in the text spaces differently once
    transformers converts a GGUF vocabulary, as for the transformers engine: not a case here)."""
    text = "Once upon a time, Lily said: hi. Ünïcödé 東京 42!"
    assert llama_pair.tokenizer.get_vocab() == pair.tokenizer.get_vocab()
    assert llama_pair.tokenizer.encode(text) == pair.tokenizer.encode(text)
    ids = pair.tokenizer.encode(text)
    assert llama_pair.tokenizer.decode(ids) == pair.tokenizer.decode(ids)
    assert (llama_pair.tokenizer.bos_token_id, llama_pair.tokenizer.eos_token_id) == (1, 2)


def test_the_files_generation_defaults_are_read_without_transformers(tmp_path: Path) -> None:
    """The file's sampling keys (written as temp 0.7, top-k 40) and llama.cpp's end-of-generation
    ids, as our `FileGeneration`, resolve as the transformers engine's converted config does; a
    temperature <= 0 is greedy, as llama.cpp samples it."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    from tests.gguf_models import write_gguf

    path = write_gguf(TARGET_DIR, tmp_path / "stories.gguf", sampling={"temp": 0.7, "top_k": 40})
    pair = load_pair(
        ModelSpec(str(path)), ModelSpec("lookup"), LoadOptions(device="cpu", engine="llama.cpp", threads=1)
    )
    generation = pair.generation_config
    assert isinstance(generation, FileGeneration)  # not transformers' GenerationConfig
    resolved = SamplingRequest().resolve(generation, "stories.gguf")
    assert resolved.source == "stories.gguf's generation_config: temperature 0.7, top-k 40"
    assert generation.eos_token_id == 2 and sorted(pair.target.eos_token_ids) == [2]
    greedy = file_generation(
        {"general.sampling.temp": 0.0, "general.sampling.top_k": 40}, bos=1, eos=[3, 2], pad=None
    )
    assert not greedy.do_sample and greedy.top_k is None and greedy.eos_token_id == [2, 3]


def test_a_gguf_draft_of_another_vocabulary_is_mapped_on_llama_cpp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stories_gguf_files: tuple[Path, Path]
) -> None:
    """The draft with its token ids shuffled, as a GGUF file: its vocabulary is mapped onto the
    target's (coverage read through the llama.cpp runner), and exact greedy decoding with it is
    the target's own."""
    from tests.conftest import DRAFT_DIR
    from tests.gguf_models import write_gguf
    from tests.mapped_pairs import permuted_draft

    monkeypatch.setenv("FSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    folder, _ = permuted_draft(DRAFT_DIR, tmp_path / "shuffled", seed=0)
    draft = write_gguf(folder, tmp_path / "shuffled.gguf")
    options = LoadOptions(device="cpu", engine="llama.cpp", threads=1)
    mapped = load_pair(ModelSpec(str(stories_gguf_files[0])), ModelSpec(str(draft)), options)
    assert mapped.draft_kind == "mapped" and mapped.coverage is not None and mapped.coverage > 0.9
    prompt = mapped.tokenizer.encode(PROMPT)
    decoder = mapped.speculative(
        Controls(DecodingSettings(rule="exact", draft_tokens=3, draft_policy="fixed"))
    )
    steps = list(decoder.generate(prompt, max_new_tokens=30, sampling=SamplingConfig()))
    assert [t.id for s in steps for t in s.tokens] == decoded(mapped.autoregressive(Controls()), prompt, 30)
    assert sum(s.stats.accepted_exact for s in steps) > 0
