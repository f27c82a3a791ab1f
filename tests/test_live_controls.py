"""Settings changed from another thread, while the decoder thread generates, apply whole from the
next step; a stop ends the reply within one step and keeps what was emitted: on the transformers
and the llama.cpp engines alike."""

from __future__ import annotations

import itertools
import threading

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig, Step, StopReason
from fsd_chat.models.pair import ModelPair

SETTINGS = (
    {"rule": "fuzzy", "divergence": "js", "threshold": 0.0, "draft_tokens": 3},
    {"rule": "pure", "divergence": "tv", "threshold": 0.3, "draft_tokens": 5},
)
"""The two settings the UI thread switches between; every field differs (the divergence is read,
and recorded, because the decoder samples: greedy steps record "regret" instead)."""
UPDATES = 8


def in_force(step: Step) -> int:
    """Which of `SETTINGS` a step's stats show (its k through `drafted`, which never exceeds it);
    -1 for a mix of the two."""
    stats = step.stats
    for i, settings in enumerate(SETTINGS):
        if (stats.rule, stats.divergence, stats.threshold) == (
            settings["rule"],
            settings["divergence"],
            settings["threshold"],
        ) and stats.drafted <= settings["draft_tokens"]:
            return i
    return -1


def test_settings_retuned_while_the_decoder_runs_apply_whole_from_the_next_step(
    engine_pair: ModelPair,
) -> None:
    """A UI thread switches all of the settings at once, UPDATES times, while the decoder thread
    generates without pause, then stops it. Step i has been handed over once `received` holds i + 1
    steps, so an update made while `received` held c steps may miss step c (in progress) but not
    step c + 1; steps before c were decided before it. A stop made at c ends the reply at step c or
    c + 1. On both engines: the dial is the decoding loop's, whatever runs the models."""
    pair = engine_pair
    controls = Controls(DecodingSettings(**SETTINGS[0]))  # type: ignore[arg-type]
    decoder = pair.speculative(controls)
    received: list[Step] = []
    arrived = threading.Condition()

    def decode() -> None:
        for step in decoder.generate(
            pair.tokenizer.encode("Once upon a time"),
            max_new_tokens=500,
            sampling=SamplingConfig(1.0, seed=0),
        ):
            with arrived:
                received.append(step)
                arrived.notify_all()

    def count() -> int:
        with arrived:
            return len(received)

    def await_steps(n: int) -> None:
        with arrived:
            assert arrived.wait_for(lambda: len(received) >= n, timeout=60)

    decoding = threading.Thread(target=decode)
    decoding.start()
    updates: list[tuple[int, int, int]] = []  # (steps before, steps after, index into SETTINGS)
    for u in range(1, UPDATES + 1):
        await_steps((updates[-1][1] if updates else 0) + 2)  # the decoder runs on between updates
        before = count()
        controls.update(**SETTINGS[u % 2])
        updates.append((before, count(), u % 2))
    await_steps(updates[-1][1] + 2)
    stop_at = count()
    controls.request_stop()
    decoding.join(timeout=60)

    assert not decoding.is_alive()
    assert received[-1].stop_reason == StopReason.STOPPED and len(received) <= stop_at + 2
    shown = [in_force(step) for step in received]
    assert -1 not in shown, shown  # one snapshot per step: never a mix of old and new
    ends = [before for before, _, _ in updates[1:]] + [len(received)]
    for (_, after, settings), end in zip(updates, ends, strict=True):
        # From one step after the update to the next update, only the new settings are in force.
        assert set(shown[after + 1 : end]) == {settings}, (updates, shown)
    # Before the first update only the first settings were in force; each update took effect once.
    changes = [shown[0]] + [b for a, b in itertools.pairwise(shown) if a != b]
    assert changes == [u % 2 for u in range(UPDATES + 1)], (updates, shown)


def test_stop_from_another_thread_keeps_the_partial_reply(engine_pair: ModelPair) -> None:
    pair = engine_pair
    controls = Controls(DecodingSettings(draft_tokens=3))
    decoder = pair.speculative(controls)
    received = []
    first_step_seen = threading.Event()
    stopped = threading.Event()

    def consume() -> None:
        for step in decoder.generate(pair.tokenizer.encode("Once upon a time"), max_new_tokens=400):
            received.append(step)
            if len(received) == 1:
                first_step_seen.set()
                stopped.wait(timeout=30)

    worker = threading.Thread(target=consume)
    worker.start()
    assert first_step_seen.wait(timeout=30)
    controls.request_stop()
    stopped.set()
    worker.join(timeout=30)

    # The step in progress when the stop arrived is the last one, and nothing emitted is lost.
    assert len(received) == 2
    assert received[-1].stop_reason == StopReason.STOPPED
    assert sum(len(s.tokens) for s in received) >= 2
    # A new generation starts afresh.
    again = list(decoder.generate(pair.tokenizer.encode("Once"), max_new_tokens=5))
    assert again[-1].stop_reason == StopReason.MAX_NEW_TOKENS
