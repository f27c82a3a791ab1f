"""On the CPU the decoding loop reads float32 laws and logits with numpy where that is faster
(`sampling.READ_CPU_ON_HOST`: `argmax`, and the greedy target step's `greedy_on_host`); every other
device takes torch's path. The two give the same indices, tokens and replies, bit for bit: checked
here on rows built to catch the edge cases (NaN, ties, infinities, a near tie the softmax rounds
away) and on whole replies of both engines, greedy and sampled, with each kind of draft."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig, Step
from fsd_chat.decoding import sampling as sampling_module
from fsd_chat.decoding.sampling import argmax, draw, greedy_on_host, probabilities
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import resolve_target
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.conftest import LLAMA_CPP_MISSING

GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95, seed=3)


def edge_rows(generator: torch.Generator) -> torch.Tensor:
    """Rows of 49,152 float32 logits (SmolLM2's vocabulary): plain, with ties for the top, NaNs,
    +inf, all -inf, some -inf."""
    rows = 4 * torch.randn(8, 49_152, generator=generator)
    rows[1, [7, 900, 40_000]] = 30.0  # a three-way tie for the top
    rows[2, [5, 6_000]] = float("nan")
    rows[3, 123] = float("inf")
    rows[4] = float("-inf")
    rows[5, :20_000] = float("-inf")
    rows[6, 17] = rows[6].max() + 2**-20  # nearly tied with the former top
    return rows


def test_argmax_on_the_host_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = edge_rows(torch.Generator().manual_seed(0))
    on_host = [argmax(rows), argmax(rows[0]), argmax(rows[2:3])]
    monkeypatch.setattr(sampling_module, "READ_CPU_ON_HOST", False)
    for got, expected in zip(on_host, [argmax(rows), argmax(rows[0]), argmax(rows[2:3])], strict=True):
        assert got.dtype == expected.dtype == torch.int64
        assert got.shape == expected.shape
        assert torch.equal(got, expected)
    assert torch.equal(on_host[0], rows.argmax(-1))


def test_the_greedy_shortcut_is_the_laws_argmax_or_declines() -> None:
    """Where it answers, the token is `draw(probabilities(row))`'s; it declines on rows whose law
    is not finite (the law's path raises there) and on near ties."""
    generator = torch.Generator().manual_seed(1)
    # Logits this close together (top two 0.002 apart on average) put a near tie in a third of the rows.
    rows = torch.cat([edge_rows(generator), 0.01 * torch.randn(200, 49_152, generator=generator)])
    answered = 0
    for row in rows:
        token = greedy_on_host(row)
        probs = probabilities(row, GREEDY)
        if token is None:
            continue
        answered += 1
        assert not sampling_module.non_finite(probs)
        assert token == int(draw(probs, GREEDY, None))
    assert 100 < answered < len(rows) - 50  # both ways taken
    for bad in rows[2:5]:  # NaN, +inf, all -inf
        assert greedy_on_host(bad) is None
    assert greedy_on_host(rows[1]) is None  # a tie
    assert greedy_on_host(rows[6]) is None  # closer than the margin


def test_a_near_tie_the_softmax_rounds_away_is_left_to_the_law() -> None:
    """Why the shortcut refuses near ties: two logits 2^-27 apart, near 0, have one probability
    after the softmax, whose argmax is the first; the logits' own argmax is the second."""
    row = torch.full((49_152,), -20.0)
    row[10], row[20] = 0.0, 2.0**-27
    probs = probabilities(row, GREEDY)
    assert probs[10] == probs[20]
    assert int(draw(probs, GREEDY, None)) == 10
    assert int(row.numpy().argmax()) == 20
    assert greedy_on_host(row) is None


def replies(decoder: object, prompt: list[int], sampling: SamplingConfig, n: int) -> list[Step]:
    """A reply's steps from empty caches, their clock readings zeroed (the only fields that may
    differ)."""
    for model in decoder.cached_models:  # type: ignore[attr-defined]
        model.reset()
    steps = list(decoder.generate(prompt, max_new_tokens=n, sampling=sampling))  # type: ignore[attr-defined]
    zero = {"draft_seconds": 0.0, "target_seconds": 0.0, "other_seconds": 0.0, "prefill_seconds": 0.0}
    return [replace(step, stats=replace(step.stats, **zero)) for step in steps]


def both_paths(
    monkeypatch: pytest.MonkeyPatch, make: object, prompt: list[int], sampling: SamplingConfig, n: int
) -> tuple[list[Step], list[Step]]:
    """The reply of a fresh decoder (`make()`) on the host path, then on the device path."""
    on_host = replies(make(), prompt, sampling, n)  # type: ignore[operator]
    with monkeypatch.context() as patch:
        patch.setattr(sampling_module, "READ_CPU_ON_HOST", False)
        on_device = replies(make(), prompt, sampling, n)  # type: ignore[operator]
    return on_host, on_device


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["target-only", "model", "lookup"])
def test_replies_are_the_device_paths(
    engine_pair: ModelPair, monkeypatch: pytest.MonkeyPatch, kind: str, sampling: SamplingConfig
) -> None:
    """Every token, origin, divergence, cost and count of a reply is the same on both paths, on
    both engines (the offline pair: a 512-token vocabulary)."""
    pair = engine_pair
    settings = DecodingSettings(rule="fuzzy", threshold=0.3, draft_tokens=4)

    def make() -> object:
        if kind == "target-only":
            return pair.autoregressive(Controls(settings))
        if kind == "model":
            return pair.speculative(Controls(settings))
        # The target over prompt lookup, on its own engine: the pair less its draft model.
        return replace(pair, draft=None).speculative(Controls(settings))

    prompt = pair.tokenizer.encode("Tom had a red ball. Tom had a red ball. Tom had a")
    on_host, on_device = both_paths(monkeypatch, make, prompt, sampling, 48)
    assert on_host == on_device
    assert sum(len(step.tokens) for step in on_host) >= 10


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_default_chats_replies_are_the_device_paths(
    monkeypatch: pytest.MonkeyPatch, sampling: SamplingConfig
) -> None:
    """The same on the default chat model on llama.cpp (49,152 tokens, where the host path pays):
    target-only, and the default chat's prompt lookup at the dial's default and at T = 0."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_MISSING)
    pair = load_pair(
        ModelSpec(resolve_target("default")), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1)
    )
    text = "Retell in one sentence: Lily found a red ball in the park and gave it to her friend Tom."
    prompt = prompt_ids(pair.tokenizer, [Message("user", text)])
    dials = [DecodingSettings(threshold=1.0 if sampling.greedy else 0.05), DecodingSettings(threshold=0.0)]
    makers = [lambda: pair.autoregressive(Controls())] + [
        lambda dial=dial: pair.speculative(Controls(dial)) for dial in dials
    ]
    for make in makers:
        on_host, on_device = both_paths(monkeypatch, make, prompt, sampling, 40)
        assert on_host == on_device
        assert sum(len(step.tokens) for step in on_host) >= 10
