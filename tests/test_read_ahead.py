"""Reading the conversation ahead: when a reply ends, the chat feeds the target's KV cache the
conversation as the next prompt will start (the reply as the next prompt tokenises it, and the
template's end of the turn), so that the next reply prefills only the new message. The real
offline pair, both decoders; the replies stay token for token those of a decoder that starts every
reply from an empty cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.chat_template import Message, PromptBuilder, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.screens.chat import ChatScreen
from tests.decoding_helpers import collect, count_fed
from tests.test_draft_policy import CAPPED, slow_decoder, tokens_fed
from tests.test_prefix_reuse import QUESTIONS
from tests.tui.helpers import SIZE, make_app, tokens_read, wait_for, wait_for_chat

MAX_NEW_TOKENS = 24


def make(pair: ModelPair, kind: str) -> Decoder:
    # A fixed draft length: the draft drafts every step, so its cache is read ahead too.
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="fixed"))
    return pair.autoregressive(controls) if kind == "autoregressive" else pair.speculative(controls)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("kind", ["speculative", "autoregressive"])
def test_after_reading_ahead_a_reply_prefills_only_the_new_message(pair: ModelPair, kind: str) -> None:
    reusing, fresh = make(pair, kind), make(pair, kind)
    fresh.reuse_prefix = False  # type: ignore[attr-defined]
    fed = count_fed(reusing.target)  # type: ignore[attr-defined]
    builder = PromptBuilder(pair.tokenizer, raw=False)
    messages: list[Message] = []
    history: list[int] = []
    for turn, question in enumerate(QUESTIONS[:4]):
        messages.append(Message("user", question))
        _, ids = builder.build(messages, context=reusing.context, reserve=MAX_NEW_TOKENS)
        assert ids[: len(history)] == history, "the conversation read ahead starts the next prompt"
        fed.clear()
        got = collect(reusing.generate(ids, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingConfig()))
        want = collect(fresh.generate(ids, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingConfig()))
        assert got.ids == want.ids
        # The prefill (the first forward pass) feeds the prompt's tokens after what was read ahead,
        # but its last (which the first step feeds).
        assert fed[0] == len(ids) - 1 - len(history), f"turn {turn}"
        messages.append(Message("assistant", got.text))
        history = builder.history(messages[-1])
        fed.clear()
        reusing.read_ahead(history)
        # What the reply left in the cache is kept: read now are the tokens from where the cache
        # and the conversation part (its end of turn, and the reply where its text tokenises
        # otherwise), and the reply's last token, which no forward pass has fed yet.
        assert 0 < sum(fed) <= len(history) - common_prefix(ids + got.ids, history) + 1
        assert all(model.seen == len(history) for model in reusing.cached_models)  # type: ignore[attr-defined]


def test_reading_ahead_replaces_a_reply_the_text_tokenises_otherwise(pair: ModelPair) -> None:
    """A model may emit a reply in tokens its text does not tokenise back into (" time" as five
    characters): reading ahead rolls the cache back to where the spellings part and feeds the
    prompt's own tokens, so the next prompt matches the cache whole."""
    decoder = make(pair, "speculative")
    fed = count_fed(decoder.target)  # type: ignore[attr-defined]
    canonical = pair.tokenizer("Once upon a time there was a cat.").input_ids
    start = pair.tokenizer("Once upon a").input_ids
    spelled = [pair.tokenizer.convert_tokens_to_ids(c) for c in ["▁", "t", "i", "m", "e"]]
    assert pair.tokenizer.unk_token_id not in spelled
    emitted = start + spelled + canonical[len(start) + 1 :]
    assert pair.tokenizer.decode(emitted) == pair.tokenizer.decode(canonical) and emitted != canonical
    decoder.read_ahead(emitted)
    assert fed == [len(emitted)]
    fed.clear()
    decoder.read_ahead(canonical)
    assert fed == [len(canonical) - len(start)]  # from where the spellings part
    fed.clear()
    decoder.read_ahead([*canonical, 13])
    assert fed == [1]


def test_reading_ahead_past_the_context_window_reads_nothing(pair: ModelPair) -> None:
    decoder = make(pair, "speculative")
    fed = count_fed(decoder.target)  # type: ignore[attr-defined]
    assert decoder.context is not None
    decoder.read_ahead([1] + [13] * decoder.context)
    decoder.read_ahead([])
    assert fed == []


@pytest.mark.slow
async def test_the_chat_reads_the_conversation_ahead_between_replies(pair: ModelPair, tmp_path: Path) -> None:
    """The real app: the second message's prefill feeds its own tokens only."""
    app = make_app(pair, tmp_path, max_new_tokens=12)
    with tokens_read(pair.target) as fed:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for_chat(pilot)
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            for question in QUESTIONS[:2]:
                await wait_for(pilot, lambda: not app.workers)  # the last reply's reading ahead too
                fed.clear()
                await pilot.press(*question, "enter")
                await wait_for(pilot, lambda: screen.streaming is None and len(fed) > 0)
            await wait_for(pilot, lambda: not app.workers)
            turns = [Message(t.role, t.content) for t in screen.session.turns]
    assert [t.role for t in turns] == ["user", "assistant", "user", "assistant"]
    history = prompt_ids(pair.tokenizer, turns[:2], generation_prompt=False)
    second = prompt_ids(pair.tokenizer, turns[:3])
    assert second[: len(history)] == history
    assert fed[0] == len(second) - 1 - len(history)


def test_a_paused_draft_is_not_read_ahead(pair: ModelPair) -> None:
    """A draft its policy has paused (here: one that cannot pay under the CAPPED timings) reads
    nothing ahead, as it reads no prompt at a reply's start; the target does."""
    decoder = slow_decoder(pair, pair.draft, CAPPED)
    prompt = pair.tokenizer(QUESTIONS[0]).input_ids
    run = collect(decoder.generate(prompt, max_new_tokens=40))
    assert run.steps[-1].stats.paused is not None
    draft_fed = tokens_fed(decoder)
    history = [*prompt, *run.ids, 13]
    decoder.read_ahead(history)
    assert decoder.target.seen == len(history) and draft_fed == []
