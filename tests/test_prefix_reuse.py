"""Prefix reuse: decoders keep their KV caches between replies and prefill only what a prompt does
not share with the last sequence. The replies must be token for token those of a decoder that
starts every reply from an empty cache (greedy, float32, the offline pair, and its draft under
shuffled ids for a draft with another tokenizer), through a multi-turn conversation whose oldest
exchanges are trimmed, an edited turn and a new chat."""

from __future__ import annotations

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.kv_cache import CachedModel
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.chat_template import Message, PromptBuilder
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect

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


def count_fed(model: CachedModel) -> list[int]:
    """Count the tokens fed to `model` per forward pass (a wrapper around the real forward)."""
    fed: list[int] = []
    forward = model.forward

    def counting(seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        fed.append(upto - model.seen)
        return forward(seq, upto, keep)

    model.forward = counting  # type: ignore[method-assign]
    return fed


def decoders(pair: ModelPair, kind: str) -> tuple[Decoder, Decoder]:
    """(reusing, fresh) decoders of one kind over the pair."""

    def make() -> Decoder:
        # Exact rule: the output is the target's greedy text, and the draft's proposals show in
        # the acceptance counts, which must match too.
        controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4))
        if kind == "autoregressive":
            return pair.autoregressive(controls)
        return pair.speculative(controls, compile_draft=kind == "compiled")

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
