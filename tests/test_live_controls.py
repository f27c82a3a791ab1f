"""Settings changed from another thread apply from the next step; a stop ends within one step."""

from __future__ import annotations

import threading

from fsd_chat.decoding import Controls, DecodingSettings, StopReason
from fsd_chat.models.pair import ModelPair


def test_threshold_changed_from_another_thread_shows_in_the_next_step(pair: ModelPair) -> None:
    controls = Controls(DecodingSettings(rule="fuzzy", divergence="js", threshold=0.0, draft_tokens=3))
    steps = pair.speculative(controls).generate(
        pair.tokenizer("Once upon a time").input_ids, max_new_tokens=120
    )
    first = next(steps)

    # The UI thread retunes while the decoder is between two steps.
    ui = threading.Thread(
        target=controls.update, kwargs={"threshold": 0.3, "divergence": "tv", "draft_tokens": 5}
    )
    ui.start()
    ui.join()

    second = next(steps)
    assert (first.stats.threshold, first.stats.divergence, first.stats.drafted) == (0.0, "js", 3)
    assert (second.stats.threshold, second.stats.divergence, second.stats.drafted) == (0.3, "tv", 5)
    assert all(s.stats.threshold == 0.3 for s in steps)


def test_stop_from_another_thread_keeps_the_partial_reply(pair: ModelPair) -> None:
    controls = Controls(DecodingSettings(draft_tokens=3))
    decoder = pair.speculative(controls)
    received = []
    first_step_seen = threading.Event()
    stopped = threading.Event()

    def consume() -> None:
        for step in decoder.generate(pair.tokenizer("Once upon a time").input_ids, max_new_tokens=400):
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
    again = list(decoder.generate(pair.tokenizer("Once").input_ids, max_new_tokens=5))
    assert again[-1].stop_reason == StopReason.MAX_NEW_TOKENS
