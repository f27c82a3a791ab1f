"""A long prompt is read in chunks, its progress reported to whoever listens on the `Controls`
(the chat shows it), with the same reply as a prefill in one forward pass. Real offline pair."""

from __future__ import annotations

from typing import Any

import pytest

from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.decoding import reply as reply_module
from fsd_chat.decoding.events import StopReason
from fsd_chat.models.pair import ModelPair

PROMPT = (
    "Once upon a time, there was a little girl named Lily. She liked to play in the park with her ball. " * 10
)
CHUNK = 64
"""A chunk small enough for the offline pair's 512-token window to hold several."""
SETTINGS = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.1, draft_tokens=4)


def decode(
    pair: ModelPair, prompt: list[int], *, autoregressive: bool, reports: list[tuple[int, int]]
) -> list[int]:
    """Greedy token ids of a 12-token reply, reporting the prefill's progress into `reports`."""
    controls = Controls(SETTINGS)
    controls.listen_prefill(lambda done, total: reports.append((done, total)))
    decoder = pair.decoder(controls, autoregressive=autoregressive)
    return [t.id for step in decoder.generate(prompt, max_new_tokens=12) for t in step.tokens]


@pytest.mark.parametrize("autoregressive", [False, True], ids=["speculative", "autoregressive"])
def test_a_long_prefill_reports_its_progress_and_changes_no_token(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch, autoregressive: bool
) -> None:
    prompt = pair.tokenizer(PROMPT).input_ids
    prefix = len(prompt) - 1  # the last prompt token is fed by the first step
    assert 3 * CHUNK < prefix < 400
    whole: list[tuple[int, int]] = []
    expected = decode(pair, prompt, autoregressive=autoregressive, reports=whole)
    assert whole == []  # within one chunk (512 tokens): one forward pass, nothing to report
    monkeypatch.setattr(reply_module, "PREFILL_CHUNK", CHUNK)
    reports: list[tuple[int, int]] = []
    assert decode(pair, prompt, autoregressive=autoregressive, reports=reports) == expected
    # At the start, after every chunk in order, then the rest: tokens every model has read, of the
    # prompt's.
    assert reports == [(n, prefix) for n in range(0, prefix, CHUNK)] + [(prefix, prefix)]


@pytest.mark.parametrize("autoregressive", [False, True], ids=["speculative", "autoregressive"])
def test_a_stop_while_the_prompt_is_read_ends_the_reply_within_a_chunk(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch, autoregressive: bool
) -> None:
    monkeypatch.setattr(reply_module, "PREFILL_CHUNK", CHUNK)
    prompt = pair.tokenizer(PROMPT).input_ids
    chunks = -(-(len(prompt) - 1) // CHUNK)  # the prefill's forward passes, but for a stop
    assert chunks >= 4
    controls = Controls(SETTINGS)
    # A stop (esc, a client gone) once the first chunk is read; the listener runs in the decoding
    # thread between chunks, as a stop from another thread would land there.
    controls.listen_prefill(lambda done, total: controls.request_stop() if done >= CHUNK else None)
    decoder = pair.decoder(controls, autoregressive=autoregressive)
    fed: list[int] = []

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        fed.append(kwargs["input_ids"].shape[1])

    hook = pair.target.register_forward_pre_hook(count, with_kwargs=True)
    try:
        steps = list(decoder.generate(prompt, max_new_tokens=12))
    finally:
        hook.remove()
    assert fed == [CHUNK]  # the target read one chunk of the prompt's `chunks`, and nothing after it
    assert [(s.tokens, s.stop_reason) for s in steps] == [((), StopReason.STOPPED)]
    assert not controls.stop_requested  # consumed by the reply it ended
    # The next reply reads the rest (its cache kept the chunk read) and decodes as a fresh one.
    controls.listen_prefill(None)
    again = [t.id for step in decoder.generate(prompt, max_new_tokens=12) for t in step.tokens]
    assert again == decode(pair, prompt, autoregressive=autoregressive, reports=[])
