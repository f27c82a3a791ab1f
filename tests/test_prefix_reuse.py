"""Prefix reuse: decoders keep their KV caches between replies and prefill only what a prompt does
not share with the last sequence. The replies must be token for token those of a decoder that
starts every reply from an empty cache (greedy, float32, the offline pair, and its draft under
shuffled ids for a draft with another tokenizer), through a multi-turn conversation whose oldest
exchanges are trimmed, an edited turn and a new chat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.engines.torch_engine.kv_cache import CachedModel
from fsd_chat.models.chat_template import Message, PromptBuilder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.conftest import COMPILED_FORWARDS
from tests.decoding_helpers import collect, count_fed
from tests.tiny_models import GEMMA3_WINDOW, save_gemma3

QUESTIONS = [
    "Once upon a time, there was a little girl named Lily.",
    "What did Lily find in the park?",
    "Then the dog came and they played together.",
    "Why was the sun so happy that day?",
    "Tom and Sue went to the big red house.",
    "The little bird sang a song to the cat.",
    "What did mom say when she saw the mess?",
    "They all went home and had a nap.",
]
MAX_NEW_TOKENS = 60
pytestmark = COMPILED_FORWARDS  # its compiled conversation reuses test_compile's graphs


def decoders(pair: ModelPair, kind: str) -> tuple[Decoder, Decoder]:
    """(reusing, fresh) decoders of one kind over the pair."""

    def make() -> Decoder:
        # Exact rule: the output is the target's greedy text, and the draft's proposals show in
        # the acceptance counts, which must match too.
        controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4))
        if kind == "autoregressive":
            return pair.autoregressive(controls)
        return pair.speculative(controls, compiled=kind == "compiled")

    reusing, fresh = make(), make()
    fresh.reuse_prefix = False  # type: ignore[attr-defined]
    return reusing, fresh


@pytest.mark.parametrize("kind", ["speculative", "autoregressive", "compiled", "mapped"])
@pytest.mark.slow
def test_a_reused_cache_replies_as_a_fresh_one(request: pytest.FixtureRequest, kind: str) -> None:
    pair: ModelPair = request.getfixturevalue("shuffled" if kind == "mapped" else "pair")
    reusing, fresh = decoders(pair, kind)
    owned = [d.owned_models for d in (reusing, fresh)]  # type: ignore[attr-defined]
    fed = count_fed(owned[0][0])
    # The draft's tokens fed per reply, reusing and fresh: the replies and their acceptances are
    # the same, so their steps feed the same tokens and the difference is what the prefill kept.
    draft_fed = [count_fed(models[1]) for models in owned if len(models) > 1]
    builder = PromptBuilder(pair.tokenizer, raw=False)
    messages = [Message("system", "Tell short stories.")]
    trims = 0
    reused: list[int] = []
    draft_reused: list[int] = []

    def reply(messages: list[Message]) -> str:
        nonlocal trims
        dropped, ids = builder.build(messages, context=reusing.context, reserve=MAX_NEW_TOKENS)
        trims += dropped > 0
        fed.clear()
        for counts in draft_fed:
            counts.clear()
        got = collect(reusing.generate(ids, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingConfig()))
        want = collect(fresh.generate(ids, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingConfig()))
        assert got.ids == want.ids
        assert [s.stats.accepted for s in got.steps] == [s.stats.accepted for s in want.steps]
        reused.append(len(ids) - 1 - fed[0])  # the prefill is the first forward pass
        if draft_fed:
            draft_reused.append(sum(draft_fed[1]) - sum(draft_fed[0]))
        return got.text

    for question in QUESTIONS:
        messages += [Message("user", question)]
        messages += [Message("assistant", reply(messages))]
    assert trims > 0, "the conversation should outgrow the 512-token window"
    # Every reply but the first and those after a trim reused most of its prompt.
    assert reused[0] == 0 and sum(r > 100 for r in reused) >= len(QUESTIONS) // 2
    if draft_fed:  # the draft too, a mapped one in its own spelling
        assert draft_reused[0] == 0 and sum(r > 100 for r in draft_reused) >= len(QUESTIONS) // 2
    edited = [*messages[:3], Message("user", "An edited question?")]  # an edit: the prefix changes
    reply(edited)
    reply([Message("user", "A new chat.")])  # ctrl+n: only the start of the text is shared
    with_system = [Message("system", "Be brief."), *messages[1:3], Message("user", "And?")]
    reply(with_system)
    assert reusing.compile_error is None  # the compiled draft's catch-ups included


@pytest.mark.parametrize("upto", [1, 2])
def test_keep_prefix_rolls_back_to_the_common_prefix(pair: ModelPair, upto: int) -> None:
    model = CachedModel(pair.target, pair.vocab_size)
    first = torch.tensor([[1, 5, 6, 7, 8, 9]])
    model.forward(first, 6, keep=1)
    second = torch.tensor([[1, 5, 6, 4, 8, 9]])
    assert model.keep_prefix(second, 6) == 3
    assert model.keep_prefix(torch.tensor([[2, 5]]), upto) == 0  # nothing shared: emptied
    assert model.cache.get_seq_length() == 0


SLIDING_WINDOW = GEMMA3_WINDOW
LAYER_TYPES = [  # a full layer between sliding ones, not Gemma 3's own pattern
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> ModelPair:
    """A tiny Gemma 3 target and a perturbed copy as its draft (some drafts accepted, some rolled back)."""
    root = tmp_path_factory.mktemp("gemma3")
    target = save_gemma3(root / "target", target_dir, layers=4, layer_types=LAYER_TYPES)
    draft = save_gemma3(root / "draft", target_dir, noise=0.3, layers=4, layer_types=LAYER_TYPES)
    return load_pair(
        ModelSpec(str(target)), ModelSpec(str(draft)), LoadOptions(device="cpu", dtype="float32")
    )


def test_sliding_layers_keep_their_whole_cache(gemma3: ModelPair) -> None:
    model = CachedModel(gemma3.target, gemma3.vocab_size)
    seq = torch.arange(3 * SLIDING_WINDOW)[None] % 500 + 3
    model.forward(seq, 3 * SLIDING_WINDOW, keep=1)
    assert model.cache.is_sliding == [False] * 4  # no layer trims itself to the window
    assert [layer.get_seq_length() for layer in model.cache.layers] == [3 * SLIDING_WINDOW] * 4
    # Three windows back is still there to keep.
    assert model.keep_prefix(seq, 3 * SLIDING_WINDOW - 2) == 3 * SLIDING_WINDOW - 2


@pytest.mark.slow
def test_sliding_window_replies_equal_transformers_generate(gemma3: ModelPair) -> None:
    # A prompt and a reply each several windows long: the window's edge moves through both.
    prompt = gemma3.tokenizer("Once upon a time there was a little girl named Lily who loved").input_ids
    assert len(prompt) > 2 * SLIDING_WINDOW
    new = 6 * SLIDING_WINDOW
    with torch.inference_mode():
        reference = gemma3.target.generate(
            torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )[0, len(prompt) :].tolist()
    target_only = collect(gemma3.autoregressive(Controls()).generate(prompt, max_new_tokens=new))
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4))
    speculative = collect(gemma3.speculative(controls).generate(prompt, max_new_tokens=new))
    assert target_only.ids == reference[: len(target_only.ids)]
    assert speculative.ids == target_only.ids
    # Both paths ran: accepted drafts and rolled-back ones.
    assert 0 < speculative.stats.accepted_exact < speculative.stats.drafted


@pytest.mark.slow
def test_sliding_window_chat_prefills_only_what_is_new(gemma3: ModelPair) -> None:
    """Ten turns: each reply equals a fresh decoder's, and each prefill feeds the new turn's tokens
    only (first-token time stays flat: counted in tokens, not timed)."""
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4))
    reusing, fresh = gemma3.speculative(controls), gemma3.speculative(controls)
    fresh.reuse_prefix = False
    fed = count_fed(reusing.target)
    builder = PromptBuilder(gemma3.tokenizer, raw=False)
    messages: list[Message] = []
    prefills: list[int] = []
    lengths: list[int] = []
    for turn in range(10):
        messages.append(Message("user", QUESTIONS[turn % len(QUESTIONS)]))
        _, ids = builder.build(messages, context=reusing.context, reserve=3 * SLIDING_WINDOW)
        fed.clear()
        got = collect(reusing.generate(ids, max_new_tokens=3 * SLIDING_WINDOW))
        want = collect(fresh.generate(ids, max_new_tokens=3 * SLIDING_WINDOW))
        assert got.ids == want.ids
        prefills.append(fed[0])
        lengths.append(len(ids))
        messages.append(Message("assistant", got.text))
    assert lengths[-1] > 20 * SLIDING_WINDOW, "the chat should grow many windows long"
    # After the first turn a prefill feeds only what the last prompt did not hold (the last reply,
    # re-tokenised from its text, and the new question): the cache kept every earlier token, three
    # windows back and more, however long the chat has grown.
    assert prefills[0] == lengths[0] - 1
    for turn in range(1, len(lengths)):
        assert prefills[turn] <= lengths[turn] - lengths[turn - 1]
    assert max(prefills) < lengths[-1] // 3
