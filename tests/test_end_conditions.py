"""How replies end: EOS (not emitted), stop strings (emitted, then stop), and models whose cache
cannot be rolled back (refused before decoding)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, MambaConfig

from fsd_chat.conversation.session import ReplyBuilder
from fsd_chat.decoding import Controls, DecodingSettings, StopReason
from fsd_chat.decoding.events import GenerationStats, Origin, Step, StepStats, Token
from fsd_chat.decoding.reply import Reply
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import UnsupportedCacheError
from tests.decoding_helpers import collect

PROMPT = "Once upon a time"


@pytest.mark.parametrize("k", [1, 4])
def test_eos_ends_the_reply_and_is_not_emitted(pair: ModelPair, k: int) -> None:
    decoder = pair.speculative(Controls(DecodingSettings(threshold=0.0, draft_tokens=k)))
    full = collect(decoder.generate(pair.tokenizer(PROMPT).input_ids, max_new_tokens=60)).ids
    # Make a frequent word the end-of-sequence token: the reply must stop right before it,
    # wherever it falls inside a draft block.
    was = pair.tokenizer.convert_tokens_to_ids("▁was")
    assert was in full
    decoder.eos_token_ids = frozenset({was})
    run = collect(decoder.generate(pair.tokenizer(PROMPT).input_ids, max_new_tokens=60))
    assert run.ids == full[: full.index(was)]
    assert run.steps[-1].stop_reason == StopReason.EOS
    # Draft tokens accepted past the EOS were never emitted: the stats count none of them (the
    # EOS itself is decided, so it may count).
    last = run.steps[-1]
    assert last.stats.accepted <= len(last.tokens) + 1
    assert run.stats.accepted_exact + run.stats.accepted_fuzzy <= len(run.ids) + 1


def test_stop_string_ends_the_reply_after_the_token_that_completes_it(pair: ModelPair) -> None:
    decoder = pair.speculative(Controls(DecodingSettings(threshold=0.0, draft_tokens=4)))
    full = collect(decoder.generate(pair.tokenizer(PROMPT).input_ids, max_new_tokens=100)).text
    assert " park" in full
    run = collect(
        decoder.generate(pair.tokenizer(PROMPT).input_ids, max_new_tokens=100, stop_strings=(" park",))
    )
    assert run.text == full[: full.index(" park") + len(" park")]
    assert run.steps[-1].stop_reason == StopReason.STOP_STRING


def test_text_held_back_is_flushed_when_a_step_starts_with_eos(pair: ModelPair) -> None:
    tokenizer = pair.tokenizer
    partial = tokenizer.convert_tokens_to_ids("<0xE2>")  # the first byte of a 3-byte character
    eos = tokenizer.eos_token_id
    controls = Controls()
    reply = Reply(
        tokenizer(PROMPT).input_ids,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        max_new_tokens=10,
        context=None,
        headroom=0,
        eos_token_ids=frozenset({eos}),
        stop_strings=(),
        controls=controls,
    )
    stats = StepStats(1, 0, 0, 1, 1, 1, 0.0, 0.0, 0.0, 0.0, "js", "fuzzy")
    clock = PhaseClock(torch.device("cpu"))
    steps = []
    for token in (partial, eos):
        reply.seq[0, reply.length] = token
        steps.append(reply.commit([token], [Origin.TARGET], [None], [0.0], stats, clock))
    assert steps[0].text == ""  # held back: an incomplete character
    assert steps[1].tokens == () and steps[1].stop_reason == StopReason.EOS
    assert steps[1].flushed == tokenizer.decode([partial]) != ""  # not lost
    builder = ReplyBuilder()
    for step in steps:
        builder.add(step)
    assert builder.record.text == tokenizer.decode([partial])


def test_model_with_recurrent_state_is_refused(tmp_path: Path, target_dir: Path) -> None:
    config = MambaConfig(
        vocab_size=512, hidden_size=32, num_hidden_layers=1, state_size=4, bos_token_id=1, eos_token_id=2
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mamba")
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(tmp_path / "mamba")
    pair = load_pair(
        ModelSpec(str(tmp_path / "mamba")), ModelSpec(str(target_dir)), LoadOptions(device="cpu")
    )
    with pytest.raises(UnsupportedCacheError, match="cannot be rolled back"):
        pair.speculative(Controls())


def test_the_end_token_counts_in_the_mean_accepted_length() -> None:
    """τ of a target-only reply that ends on EOS is 1: the EOS step made a forward pass for it."""
    stats = GenerationStats()
    one = StepStats(
        drafted=0,
        accepted_exact=0,
        accepted_fuzzy=0,
        emitted=1,
        target_forwards=1,
        draft_forwards=0,
        draft_seconds=0.0,
        target_seconds=0.01,
        other_seconds=0.0,
        threshold=0.0,
        divergence="js",
        rule="autoregressive",
    )
    token = Token(id=5, text="a", origin=Origin.TARGET, divergence=None, cost=0.0)
    for _ in range(6):
        stats.add(Step(tokens=(token,), stats=one))
    stats.add(Step(tokens=(), stats=replace(one, emitted=0), stop_reason=StopReason.EOS))
    assert stats.tokens == 6 and stats.mean_accepted_length == 1.0
