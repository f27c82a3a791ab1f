"""The whole-step path (`fsd_chat.engines.torch_engine.step_graph`) on the CPU: the rule chosen on the device
equals the rule chosen by name, the step keeps the static-buffer discipline a CUDA graph needs (one
read a step, no host traffic inside it, no output kept past the next call, a whole-graph trace),
decoding through it keeps greedy identity, the sampling laws and the decoders' features, and
`CapturedSteps` decodes alike on emulated CUDA graphs (`EmulatedGraph`, a mock: no GPU here).
The statistical tests are tests/test_sampling_lossless.py's: α = 0.001 each, fixed seeds."""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.decoding import sampling as sampling_module
from fsd_chat.decoding.acceptance import judge
from fsd_chat.decoding.autoregressive import AutoregressiveDecoder
from fsd_chat.decoding.divergence import DIVERGENCE_NAMES, DivergenceName
from fsd_chat.decoding.draft_policy import FixedPolicy
from fsd_chat.decoding.events import StopReason
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.sampling import SamplingTensors, exponential_noise, probabilities
from fsd_chat.decoding.settings import RULES, Rule, SamplingConfig
from fsd_chat.decoding.speculative import SpeculativeDecoder
from fsd_chat.engines.torch_engine import static_attention, step_graph
from fsd_chat.engines.torch_engine.binding import speculative_decoder
from fsd_chat.engines.torch_engine.kv_cache import CachedModel, StaticModel, compiled_capacity
from fsd_chat.engines.torch_engine.positioned_cache import PositionedLayer
from fsd_chat.engines.torch_engine.step_graph import MIN_CAPACITY, CapturedSteps, EagerSteps
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import ModelSpec
from fsd_chat.models.pair import ModelPair
from tests import test_sampling_lossless
from tests.decoding_helpers import collect, modelled
from tests.test_host_syncs import host_reads, traffic_per_step  # noqa: F401 (a fixture)
from tests.test_non_finite import CPU, OTHER_PROMPT, broken, run_until_error  # noqa: F401 (a fixture)
from tests.test_non_finite import PROMPT as BROKEN_PROMPT
from tests.test_sampling_lossless import (
    ALPHA,
    LOSSLESS_CASES,
    PROMPT,
    SAMPLING,
    assert_first_two_tokens_follow_the_target,
    chi_square_p_value,
    exact_first_two,
)

END_TO_END = 1_000
"""Seeded replies of the law test through the whole step (tests/test_sampling_lossless.py's count)."""


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("point_masses", [False, True])
def test_the_rule_selected_on_the_device_is_the_rule_named(greedy: bool, point_masses: bool) -> None:
    """Every rule × divergence × threshold (0 included, where every rule is exact), with the same
    draws: the device selection gives the named rule's judgement, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    k, vocab = 5, 64
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=0.9, top_p=0.9)
    logits = 2 * torch.randn(2 * k + 1, vocab, generator=generator)
    p = probabilities(logits[: k + 1], sampling)
    p_full = probabilities(logits[: k + 1], sampling.untruncated())
    q = None if point_masses else probabilities(logits[k + 1 :], sampling)
    # Draft tokens the target mostly keeps, some it does not.
    draft_ids = p[:k].argmax(-1) if q is None else q.argmax(-1)
    draft_ids[1] = p[1].argmin()
    uniforms = torch.rand(k, generator=generator)
    noise = exponential_noise(p, generator)
    rule_index = torch.zeros((), dtype=torch.long)
    divergence_index = torch.zeros((), dtype=torch.long)
    threshold_tensor = torch.zeros(())
    for (r, rule), (d, name), threshold in itertools.product(
        enumerate(RULES), enumerate(DIVERGENCE_NAMES), [0.0, 0.05, 0.4]
    ):
        rule_index.fill_(r)
        divergence_index.fill_(d)
        threshold_tensor.fill_(threshold)
        common: dict[str, Any] = dict(
            sampling=sampling, generator=None, p_full=p_full, uniforms=uniforms, noise=noise
        )
        named = judge(p, q, draft_ids, rule=rule, divergence_name=name, threshold=threshold, **common)
        chosen = judge(
            p,
            q,
            draft_ids,
            rule=rule_index,
            divergence_name=divergence_index,
            threshold=threshold_tensor,
            **common,
        )
        for field in ("accept", "draft_exact", "divergences", "costs", "candidates"):
            assert torch.equal(getattr(named, field), getattr(chosen, field)), (rule, name, threshold, field)


@pytest.mark.slow  # 20,000 replies a case; the device selection's equality with `judge` is the quick test above
@pytest.mark.parametrize(("rule", "threshold", "seed"), LOSSLESS_CASES)
def test_first_two_tokens_follow_the_target_with_the_rule_on_the_device(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch, rule: Rule, threshold: float, seed: int
) -> None:
    """tests/test_sampling_lossless.py's batched law test (20,000 first and second tokens, α =
    0.001 against the target's law, and rejected against the draft's for power) with the rule,
    divergence and threshold given as device values, as the captured graphs give them."""

    def on_device(
        *args: Any, rule: Rule, divergence_name: DivergenceName, threshold: float, **kwargs: Any
    ) -> Any:
        return judge(
            *args,
            rule=torch.tensor(RULES.index(rule)),
            divergence_name=torch.tensor(DIVERGENCE_NAMES.index(divergence_name)),
            threshold=torch.tensor(threshold),
            **kwargs,
        )

    monkeypatch.setattr(test_sampling_lossless, "judge", on_device)
    assert_first_two_tokens_follow_the_target(pair, rule, threshold, torch.Generator().manual_seed(seed))


def test_sampling_tensors_truncate_as_the_config_does() -> None:
    """`probabilities` from device values equals the configured truncations, neutral values included."""
    logits = 3 * torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    tensors = SamplingTensors.allocate(torch.device("cpu"))
    for temperature, top_k, top_p, min_p in itertools.product([0.0, 0.7], [0, 5, 64], [1.0, 0.9], [0.0, 0.1]):
        config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        tensors.write(config)
        torch.testing.assert_close(probabilities(logits, tensors), probabilities(logits, config))
        torch.testing.assert_close(
            probabilities(logits, tensors.untruncated()), probabilities(logits, config.untruncated())
        )


PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park. Tom"]


def whole(pair: ModelPair, settings: DecodingSettings, device_inputs: bool = False) -> SpeculativeDecoder:
    """A whole-step decoder; `device_inputs`: its settings as device values, as the CUDA graphs
    read them (every rule judged and one selected on the device)."""
    decoder = pair.speculative(Controls(settings), whole_step=True)
    steps = decoder._steps
    assert isinstance(steps, EagerSteps)
    if device_inputs:
        decoder._steps = EagerSteps(steps.target, steps.draft, device_inputs=True)
    return decoder


def ids_of(decoder: Decoder, pair: ModelPair, prompt: str, tokens: int = 80, **kwargs: Any) -> list[int]:
    return collect(decoder.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=tokens, **kwargs)).ids


@pytest.fixture(scope="module")
def targets_text(pair: ModelPair) -> dict[str, list[int]]:
    """The target's greedy reply (80 tokens) to each of PROMPTS, by target-only decoding: the same
    for every rule and k below, so decoded once."""
    target_only = pair.autoregressive(Controls())
    return {prompt: ids_of(target_only, pair, prompt) for prompt in PROMPTS}


def test_a_whole_step_target_only_decoder_gives_the_targets_greedy_text(
    pair: ModelPair, targets_text: dict[str, list[int]]
) -> None:
    whole_target = pair.autoregressive(Controls(), whole_step=True)
    for prompt in PROMPTS:
        assert ids_of(whole_target, pair, prompt) == targets_text[prompt]


@pytest.mark.parametrize(
    ("rule", "k"), [("exact", 1), ("exact", 5), ("fuzzy", 3), ("mixture", 9), ("pure", 4)]
)
def test_greedy_whole_steps_at_t0_are_the_targets_text(
    pair: ModelPair, targets_text: dict[str, list[int]], rule: Rule, k: int
) -> None:
    """Greedy identity through the whole step: at T = 0 every rule is the target's greedy text, that
    of target-only decoding (rollbacks included: the story draft is rejected at these k); the
    whole-step target-only decoder's is the test above."""
    speculative = whole(
        pair, DecodingSettings(rule=rule, threshold=0.0, draft_tokens=k, draft_policy="fixed")
    )
    for prompt in PROMPTS:
        run = collect(speculative.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=80))
        assert run.ids == targets_text[prompt]
        assert run.stats.drafted > run.stats.accepted_exact > 0  # drafts were accepted and rejected


@pytest.mark.parametrize(("rule", "threshold"), [("fuzzy", 0.1), ("mixture", 0.05), ("pure", 0.3)])
def test_greedy_whole_steps_equal_the_eager_steps(pair: ModelPair, rule: Rule, threshold: float) -> None:
    """Above T = 0 the text departs from the target's: the whole step decides as the eager step
    does, token for token, origin for origin, divergence for divergence."""
    settings = DecodingSettings(rule=rule, threshold=threshold, draft_tokens=4, draft_policy="fixed")
    for prompt in PROMPTS[:2]:
        ids = pair.tokenizer(prompt).input_ids
        got = collect(whole(pair, settings).generate(ids, max_new_tokens=80))
        want = collect(pair.speculative(Controls(settings)).generate(ids, max_new_tokens=80))
        assert (got.ids, got.origins) == (want.ids, want.origins)
        divergences = [t.divergence for s in got.steps for t in s.tokens]
        expected = [t.divergence for s in want.steps for t in s.tokens]
        # Float32 attention over a static cache sums in another order than over a dynamic one.
        assert divergences == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.slow  # END_TO_END seeded replies; greedy identity through the whole step stays quick
def test_replies_through_the_whole_step_follow_the_target(pair: ModelPair) -> None:
    """The sampling law through the whole step (the sampled graph's draws, the device rule
    selection, the seeding a reply): END_TO_END seeded two-token replies at T = 0, their first
    tokens tested against the target's exact law at α = ALPHA (tests/test_sampling_lossless.py;
    its batched test has the power, the device rule equal to `judge` above carries it here)."""
    vocab, eos = pair.vocab_size, pair.tokenizer.eos_token_id
    prompt_ids = pair.tokenizer(PROMPT).input_ids
    decoder = whole(pair, DecodingSettings(rule="fuzzy", threshold=0.0, draft_tokens=2, draft_policy="fixed"))
    firsts = torch.zeros(vocab + 1, dtype=torch.long)
    drafted = 0
    for seed in range(END_TO_END):
        sampling = SamplingConfig(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p, seed=seed)
        run = collect(decoder.generate(prompt_ids, max_new_tokens=2, sampling=sampling))
        drafted += run.stats.drafted
        firsts[run.ids[0] if run.ids else vocab] += 1
    assert drafted >= END_TO_END  # every reply's first step was speculative
    assert chi_square_p_value(firsts, exact_first_two(pair.target, prompt_ids, vocab, eos)[0]) > ALPHA


def test_a_seed_gives_one_reply(pair: ModelPair) -> None:
    settings = DecodingSettings(rule="mixture", threshold=0.05, draft_tokens=3, draft_policy="fixed")
    sampling = SamplingConfig(temperature=0.9, top_k=40, min_p=0.02, seed=11)
    first = ids_of(whole(pair, settings), pair, PROMPTS[0], 60, sampling=sampling)
    assert ids_of(whole(pair, settings), pair, PROMPTS[0], 60, sampling=sampling) == first


@pytest.mark.parametrize("kind", ["speculative", "speculative-device-inputs", "target-only"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=3)])
def test_a_whole_step_reads_once_and_writes_no_python_value(
    pair: ModelPair,
    host_reads: collections.Counter[str],  # noqa: F811 (tests/test_host_syncs.py's fixture)
    kind: str,
    sampling: SamplingConfig,
) -> None:
    """The static-buffer discipline, step by step after the prefill: one read (the block), and
    inside the step no C++-side read, no Python value written into a tensor, no data-sized output
    (tests/test_host_syncs.py's counters)."""
    settings = DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=4, draft_policy="fixed")
    decoder: Decoder = (
        whole(pair, settings, device_inputs=kind.endswith("device-inputs"))
        if kind.startswith("speculative")
        else pair.autoregressive(Controls(settings), whole_step=True)
    )
    steps = decoder.generate(pair.tokenizer(PROMPTS[2]).input_ids, max_new_tokens=48, sampling=sampling)
    per_step = traffic_per_step(steps, host_reads)
    assert len(per_step) >= 5
    assert all(reads == 1 and not other for reads, other, _ in per_step), per_step


def test_no_step_reads_an_output_after_the_next_call(pair: ModelPair) -> None:
    """As a CUDA graph's next replay overwrites the last one's output, each call here fills the
    previous call's block with NaN: the replies are unchanged, so nothing kept one."""
    settings = DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=4, draft_policy="heuristic")
    sampling = SamplingConfig(temperature=0.9, seed=2)
    want = ids_of(whole(pair, settings), pair, PROMPTS[1], 60, sampling=sampling)
    emulated = whole(pair, settings)
    assert emulated._steps is not None
    emulated._steps._emulate = True
    assert ids_of(emulated, pair, PROMPTS[1], 60, sampling=sampling) == want


@pytest.mark.parametrize(
    ("rule", "threshold", "sampling"),
    [
        ("exact", 0.0, SamplingConfig(temperature=0.9, seed=1)),
        ("fuzzy", 0.1, SamplingConfig()),
        ("fuzzy", 0.1, SamplingConfig(temperature=0.9, top_p=0.9, seed=2)),
        ("mixture", 0.05, SamplingConfig(temperature=0.7, top_k=20, min_p=0.05, seed=3)),
        ("pure", 0.3, SamplingConfig(temperature=1.1, seed=4)),
    ],
)
def test_settings_on_the_device_decide_as_settings_on_the_host(
    pair: ModelPair, rule: Rule, threshold: float, sampling: SamplingConfig
) -> None:
    """The graphs' inputs (rule, divergence, T and sampling as device values, every truncation
    applied, every rule judged) against the eager path's Python values: the same draws give the
    same reply, token for token."""
    settings = DecodingSettings(rule=rule, threshold=threshold, draft_tokens=4, draft_policy="fixed")
    for prompt in PROMPTS[:2]:
        got = collect(
            whole(pair, settings, device_inputs=True).generate(
                pair.tokenizer(prompt).input_ids, max_new_tokens=60, sampling=sampling
            )
        )
        want = collect(
            whole(pair, settings).generate(
                pair.tokenizer(prompt).input_ids, max_new_tokens=60, sampling=sampling
            )
        )
        assert (got.ids, got.origins) == (want.ids, want.origins)


@pytest.mark.parametrize("greedy", [True, False])
def test_each_step_traces_whole(pair: ModelPair, greedy: bool) -> None:
    """torch.compile(fullgraph=True) of each step function: a host read or a branch on a device
    value would break the graph, which fullgraph makes an error. The "eager" backend traces without
    generating code (cheap on a CPU); the traced steps decide as the plain ones."""
    settings = DecodingSettings(rule="mixture", threshold=0.05, draft_tokens=2, draft_policy="fixed")
    decoder = whole(pair, settings, device_inputs=True)
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=0.8, top_p=0.9, seed=4)
    want = ids_of(decoder, pair, PROMPTS[0], 24, sampling=sampling)
    steps = decoder._steps
    assert steps is not None
    traced = {
        name: torch.compile(getattr(step_graph, name), fullgraph=True, dynamic=False, backend="eager")
        for name in ("speculative_step", "target_step")
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, function in traced.items():
            patch.setattr(step_graph, name, function)
        assert ids_of(decoder, pair, PROMPTS[0], 24, sampling=sampling) == want


def test_prefix_reuse_and_read_ahead(pair: ModelPair) -> None:
    """A second reply that starts with the first's text prefills only what is new; a read-ahead
    conversation prefills nothing at its reply; the text is a fresh decoder's."""
    settings = DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="fixed")
    decoder = whole(pair, settings)
    first = pair.tokenizer(PROMPTS[0]).input_ids
    reply = ids_of(decoder, pair, PROMPTS[0], 30)
    longer = [*first, *reply, *pair.tokenizer(" Then").input_ids[1:]]
    run = collect(decoder.generate(longer, max_new_tokens=30))
    assert decoder.controls.cached_prompt_tokens >= len(first) + len(reply) - 1
    assert run.ids == collect(whole(pair, settings).generate(longer, max_new_tokens=30)).ids
    other = pair.tokenizer(PROMPTS[2]).input_ids
    decoder.read_ahead(other)
    again = collect(decoder.generate(other, max_new_tokens=30))
    assert decoder.controls.cached_prompt_tokens == len(other) - 1
    assert again.ids == collect(whole(pair, settings).generate(other, max_new_tokens=30)).ids


def test_a_long_prompt_grows_the_caches(pair: ModelPair) -> None:
    """Eagerly the static caches grow to a reply's need (doubling from MIN_CAPACITY)."""
    decoder = whole(pair, DecodingSettings(threshold=0.0, draft_tokens=4, draft_policy="fixed"))
    prompt = pair.tokenizer(" ".join([PROMPTS[2]] * 25)).input_ids
    assert len(prompt) > MIN_CAPACITY
    run = collect(decoder.generate(prompt, max_new_tokens=20))
    assert run.ids == collect(pair.autoregressive(Controls()).generate(prompt, max_new_tokens=20)).ids
    assert all(m.capacity >= len(prompt) + 20 for m in decoder.owned_models)  # type: ignore[attr-defined]


def test_the_dial_and_a_stop_mid_reply(pair: ModelPair) -> None:
    """Settings read at every step (the rule and T written into the step's buffers): a rule and
    threshold changed mid-reply show in the next steps; a stop ends the reply at the next step."""
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="fixed"))
    decoder = pair.speculative(controls, whole_step=True)
    steps = decoder.generate(pair.tokenizer(PROMPTS[0]).input_ids, max_new_tokens=200)
    firsts = [next(steps) for _ in range(3)]
    assert all(s.stats.rule == "exact" and s.stats.accepted_fuzzy == 0 for s in firsts)
    controls.update(rule="pure", threshold=math.log(2.0), divergence="js")
    relaxed = [next(steps) for _ in range(4)]
    # js ≤ ln 2 everywhere: `pure` accepts every draft token the target can emit.
    assert all(
        s.stats.rule == "pure" and s.stats.accepted_exact + s.stats.accepted_fuzzy == 4 for s in relaxed
    )
    assert all(s.stats.threshold == math.log(2.0) for s in relaxed)
    controls.request_stop()
    rest = list(steps)
    assert len(rest) == 1 and rest[0].stop_reason == StopReason.STOPPED


@pytest.mark.parametrize("kind", ["target-only", "model"])
def test_non_finite_logits_end_a_whole_step_reply(
    broken: tuple[Path, list[int]],  # noqa: F811 (tests/test_non_finite.py's fixture)
    draft_dir: Path,
    kind: str,
) -> None:
    """tests/test_non_finite.py's broken target through the whole step: the reply keeps what it
    emitted, ends in one line, and the next reply works."""
    directory, reply = broken
    broken_pair = load_pair(ModelSpec(str(directory)), ModelSpec(str(draft_dir)), CPU)
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="fixed"))
    decoder: Decoder = (
        broken_pair.autoregressive(controls, whole_step=True)
        if kind == "target-only"
        else broken_pair.speculative(controls, whole_step=True)
    )
    steps, message = run_until_error(
        decoder, broken_pair.tokenizer(BROKEN_PROMPT).input_ids, SamplingConfig()
    )
    emitted = [t.id for s in steps for t in s.tokens]
    assert emitted == reply[: len(emitted)] and len(emitted) <= len(reply)
    assert "float16" in message
    again = list(decoder.generate(broken_pair.tokenizer(OTHER_PROMPT).input_ids, max_new_tokens=24))
    assert again[-1].stop_reason is not None and sum(len(s.tokens) for s in again) > 0


class EmulatedGraph:
    """A CUDA graph emulated on the CPU (a mock of `torch.cuda.CUDAGraph`, because CUDA cannot
    run here): the capture records every aten operator run inside it, with its arguments and
    outputs, and a replay runs them again in order on the recorded tensors, writing each result
    into the recorded output. As on a GPU, a replay sees only what lives in those tensors: a
    Python value read or computed during the capture stays baked in, a tensor made of Python
    values is refused, and so is a read of a device value on the host."""

    REFUSED = ("aten.lift_fresh.default", "aten._local_scalar_dense.default", "aten.nonzero.default")

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self.generators: list[torch.Generator] = []

    def register_generator_state(self, generator: torch.Generator) -> None:
        self.generators.append(generator)

    @torch.inference_mode()  # the recorded tensors are inference tensors (a GPU replay has no modes)
    def replay(self) -> None:
        TIMELINE.append("launch")
        for func, args, kwargs, out in self.ops:
            result = func(*args, **kwargs)
            olds = out if isinstance(out, tuple | list) else (out,)
            news = result if isinstance(result, tuple | list) else (result,)
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for old, new in zip(olds, news, strict=True):
                # A view or an in-place result aliases its input, which the replay updated; any
                # other output (`reshape` and `to` may copy) is written into the recorded one.
                if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() not in inputs:
                    old.copy_(new)


class Recording(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        assert str(func) not in EmulatedGraph.REFUSED, f"{func} cannot be captured"
        out = func(*args, **(kwargs or {}))
        self.graph.ops.append((func, args, kwargs or {}, out))
        return out


class _Stream:
    def __init__(self, *_: Any, **__: Any) -> None: ...

    def wait_stream(self, _: Any) -> None: ...


TIMELINE: list[str] = []
"""What the emulated device saw, in order: "launch" (a replay) and "read" (a wait on an event)."""


class _Event:
    """A CUDA event (a mock): the copy queued before it (`_copy_to_host`) arrives when it is
    waited on."""

    def __init__(self) -> None:
        self.arrive: Callable[[], object] | None = None

    def record(self) -> None: ...

    @torch.inference_mode()  # the host buffers are inference tensors
    def synchronize(self) -> None:
        TIMELINE.append("read")
        if self.arrive is not None:
            self.arrive()
            self.arrive = None


def _copy_to_host(out: torch.Tensor, host: torch.Tensor, done: _Event) -> None:
    """`step_graph.copy_to_host` emulated (a mock of CUDA's asynchronous copy): the host buffer is
    poisoned (NaN) from the moment a copy into it is queued until its event is waited on, and it
    then receives the output as it was when the copy was queued (the stream's order). A block read
    after its buffer was reused, or before its event, is NaN or another step's."""
    data = out.clone()
    host.fill_(float("nan"))
    done.arrive = partial(host.copy_, data)


@contextlib.contextmanager
def _capture(graph: EmulatedGraph, **_: Any) -> Iterator[None]:
    with Recording(graph):
        yield


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda's graph API replaced by `EmulatedGraph`, no-op streams, and events that deliver
    the asynchronous copies (`_copy_to_host`) (mocks: there is no GPU here), so that
    `CapturedSteps` captures and replays on the CPU. Returns the `TIMELINE`, emptied."""
    TIMELINE.clear()
    # A GPU's path: the CPU's own reads of laws with numpy cannot be captured.
    monkeypatch.setattr(sampling_module, "READ_CPU_ON_HOST", False)
    monkeypatch.setattr(step_graph, "copy_to_host", _copy_to_host)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: _Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return TIMELINE


def captured(decoder: SpeculativeDecoder | AutoregressiveDecoder) -> CapturedSteps:
    """The decoder's steps captured (on emulated graphs), its caches at the size a GPU's have."""
    steps = decoder._steps
    assert isinstance(steps, EagerSteps) and decoder.context is not None
    steps.fit(compiled_capacity(decoder.context))
    # Every k up to 3: near a reply's end the room cuts k, and a k rounded down to a captured
    # length would draw another (equally lawful) reply than the eager step's.
    graphs = CapturedSteps(steps.target, steps.draft, lengths=(1, 2, 3), lookup=steps.lookup)
    decoder._steps = graphs
    return graphs


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(top_p=0.5), SamplingConfig(temperature=0.9, top_p=0.9, seed=5)],
)
def test_captured_steps_replayed_decode_as_eager_ones(
    pair: ModelPair, emulated_cuda: list[str], sampling: SamplingConfig
) -> None:
    """`CapturedSteps` on emulated CUDA graphs: the graphs captured once, then replayed for every
    step of several replies (prefix reuse in the shared buffer, the dial moved between replies,
    k 4 rounded down to the longest captured, 3, the registered generator reseeded per reply) give the
    eager whole step's replies, token for token: with one step in flight (each step but a reply's
    last few launched before the last one is read, a block read only once its copy arrived,
    `_copy_to_host`), as the eager path reads each step before the next."""
    controls = Controls(DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=4, draft_policy="fixed"))
    graphs_decoder = pair.speculative(controls, whole_step=True)
    graphs = captured(graphs_decoder)
    kinds = [(False, True), (True, False), (True, True)]  # sampled, greedy, greedy truncating
    # A greedy target-only step reads no law: one graph, whether the reply truncates or not.
    assert sorted(graphs._graphs) == [
        (k, *kind) for k in range(4) for kind in kinds if (k, *kind) != (0, True, True)
    ]
    target_only = pair.autoregressive(Controls(), whole_step=True)
    captured(target_only)
    eager_controls = Controls(replace(controls.snapshot(), draft_tokens=3))
    eager = pair.speculative(eager_controls, whole_step=True)
    eager_target = pair.autoregressive(Controls(), whole_step=True)
    first = pair.tokenizer(PROMPTS[0]).input_ids
    replies = [(0.1, first), (0.3, [*first, *pair.tokenizer(" Lily").input_ids[1:]]), (0.0, PROMPTS[1])]
    for index, (threshold, prompt) in enumerate(replies):
        if isinstance(prompt, str):
            prompt = pair.tokenizer(prompt).input_ids
        controls.update(threshold=threshold)
        eager_controls.update(threshold=threshold)
        got = collect(graphs_decoder.generate(prompt, max_new_tokens=40, sampling=sampling))
        if index == 1:  # the first reply's prompt kept in the shared buffer's copy
            assert graphs_decoder.controls.cached_prompt_tokens == len(first)
        want = collect(eager.generate(prompt, max_new_tokens=40, sampling=sampling))
        assert (got.ids, got.origins) == (want.ids, want.origins)
        assert got.stats.drafted > 0
        got_target = collect(target_only.generate(prompt, max_new_tokens=40, sampling=sampling)).ids
        assert got_target == collect(eager_target.generate(prompt, max_new_tokens=40, sampling=sampling)).ids
    assert launched_ahead(emulated_cuda) > 20


SAMPLING_OPS = ("sort", "topk", "kthvalue", "cumsum", "exponential", "uniform", "multinomial")
"""aten operators of sampling work: truncation (ranks, cumulative sums) and noise."""


def test_greedy_graphs_do_no_sampling_work(pair: ModelPair, emulated_cuda: list[str]) -> None:
    """The operators each captured graph records (`EmulatedGraph`: the kernels a CUDA graph would
    launch): a greedy graph, target-only or speculative, neither sorts, nor accumulates top-p's
    sums, nor draws noise; a greedy target-only graph computes no law at all (no softmax), even
    for a reply that truncates (truncations keep the largest logit: one graph serves both). The greedy speculative graph
    of a reply that truncates, and the sampled ones, do such work: the check sees it where it is."""
    settings = DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=2, draft_policy="fixed")
    graphs = captured(pair.speculative(Controls(settings), whole_step=True))

    def ops(key: tuple[int, bool, bool]) -> set[str]:
        return {str(op[0]) for op in graphs._graphs[key][0].ops}

    def sampling_work(key: tuple[int, bool, bool]) -> set[str]:
        return {op for op in ops(key) if any(name in op for name in SAMPLING_OPS)}

    assert not any("softmax" in op for op in ops((0, True, False)))
    assert (0, True, True) not in graphs._graphs  # a truncating reply's greedy steps replay that graph
    assert any("softmax" in op for op in ops((0, False, True)))
    for k in range(4):
        assert sampling_work((k, True, False)) == set(), k
        if k:
            assert any("sort" in op for op in sampling_work((k, True, True))), k
        assert any("exponential" in op for op in sampling_work((k, False, True))), k


class Pausing(FixedPolicy):
    """k = 0 (a target-only step) at `pauses` steps in a row, then one speculative step: the draft
    falls behind, and its cache catches up before the next speculative step."""

    def __init__(self, pauses: int) -> None:
        self.pauses = pauses
        self.calls = 0

    def limit(
        self, settings: DecodingSettings, room: int, evidence: int | None = None, context: int = 0
    ) -> int:
        self.calls += 1
        return 0 if self.calls % (self.pauses + 1) else min(settings.draft_tokens, room)


@pytest.mark.parametrize("pauses", [1, 3])
def test_target_only_steps_between_speculative_ones(pair: ModelPair, pauses: int) -> None:
    """A policy that drafts nothing on some steps (goodput pausing a draft that does not pay):
    target-only whole steps, then a speculative one whose draft first catches up; greedy at T = 0
    the target's text still."""
    settings = DecodingSettings(rule="exact", threshold=0.0, draft_tokens=3, draft_policy="fixed")
    decoder = whole(pair, settings)
    decoder._kept_policy = ("fixed", Pausing(pauses))
    prompt = pair.tokenizer(PROMPTS[0]).input_ids
    run = collect(decoder.generate(prompt, max_new_tokens=60))
    assert run.ids == collect(pair.autoregressive(Controls()).generate(prompt, max_new_tokens=60)).ids
    assert 0 < sum(bool(s.stats.drafted) for s in run.steps) < len(run.steps)
    assert any(s.stats.draft_forwards > s.stats.drafted for s in run.steps)  # a catch-up pass


LOOKUP_PROMPT = "Tom had a red ball. Tom had a red ball. Tom had a"
"""A prompt that repeats itself, so that lookup finds n-grams to copy."""


def whole_lookup(
    pair: ModelPair, settings: DecodingSettings, device_inputs: bool = False
) -> SpeculativeDecoder:
    """A whole-step decoder over prompt lookup (`device_inputs` as in `whole`)."""
    decoder = speculative_decoder(
        pair.target,
        PromptLookup(),
        pair.tokenizer,
        controls=Controls(settings),
        whole_step=True,
        timings=modelled(pair.target),
    )
    steps = decoder._steps
    assert isinstance(steps, EagerSteps) and steps.lookup
    if device_inputs:
        decoder._steps = EagerSteps(steps.target, None, device_inputs=True, lookup=True)
    return decoder


@pytest.mark.parametrize(
    ("rule", "threshold", "divergence", "sampling"),
    [
        ("exact", 0.0, "js", SamplingConfig()),
        ("fuzzy", 0.3, "reverse-kl", SamplingConfig()),
        ("fuzzy", 0.3, "reverse-kl", SamplingConfig(temperature=0.9, top_p=0.9, seed=6)),
        ("mixture", 0.05, "js", SamplingConfig(temperature=0.8, seed=7)),
    ],
)
def test_lookup_whole_steps_decide_as_lookup_steps(
    pair: ModelPair, rule: Rule, threshold: float, divergence: DivergenceName, sampling: SamplingConfig
) -> None:
    """Prompt lookup through the whole step (a copy from a device source, point-mass laws), with
    the settings on the host and on the device: today's lookup decoder's reply, token for token
    (greedy at T = 0: the target's), verified copies and target-only steps among the steps."""
    settings = DecodingSettings(
        rule=rule, threshold=threshold, divergence=divergence, draft_tokens=6, draft_policy="fixed"
    )
    prompt = pair.tokenizer(LOOKUP_PROMPT).input_ids
    today = speculative_decoder(
        pair.target,
        PromptLookup(),
        pair.tokenizer,
        controls=Controls(settings),
        timings=modelled(pair.target),
    )
    want = collect(today.generate(prompt, max_new_tokens=60, sampling=sampling))
    for device_inputs in (False, True):
        got = collect(
            whole_lookup(pair, settings, device_inputs).generate(prompt, max_new_tokens=60, sampling=sampling)
        )
        assert (got.ids, got.origins) == (want.ids, want.origins)
        assert 0 < got.stats.lookup_hits < got.stats.steps
    if rule == "exact" and sampling.greedy:
        assert want.ids == collect(pair.autoregressive(Controls()).generate(prompt, max_new_tokens=60)).ids


@pytest.mark.parametrize("device_inputs", [False, True])
def test_a_lookup_whole_step_reads_once_and_writes_no_python_value(
    pair: ModelPair,
    host_reads: collections.Counter[str],  # noqa: F811 (tests/test_host_syncs.py's fixture)
    device_inputs: bool,
) -> None:
    """The static-buffer discipline for lookup's steps: one read, no host traffic (the copy's
    source is written with `fill_`, a kernel's argument, not a tensor made of a Python value),
    with every rule's point-mass formulas run when the rule is on the device."""
    settings = DecodingSettings(
        rule="fuzzy", threshold=0.3, divergence="js", draft_tokens=4, draft_policy="fixed"
    )
    steps = whole_lookup(pair, settings, device_inputs).generate(
        pair.tokenizer(LOOKUP_PROMPT).input_ids, max_new_tokens=48
    )
    per_step = traffic_per_step(steps, host_reads)
    assert len(per_step) >= 5 and any(drafted for *_, drafted in per_step)
    assert all(reads == 1 and not other for reads, other, _ in per_step), per_step


def test_captured_lookup_steps_replayed_decode_as_eager_ones(
    pair: ModelPair, emulated_cuda: list[str]
) -> None:
    """`CapturedSteps(lookup=True)` on emulated CUDA graphs: a graph per copy length, replayed
    with the source written between replays, gives the eager lookup whole step's replies."""
    settings = DecodingSettings(
        rule="fuzzy", threshold=0.3, divergence="js", draft_tokens=3, draft_policy="fixed"
    )
    sampling = SamplingConfig(temperature=0.9, seed=8)
    graphs = whole_lookup(pair, settings)
    captured(graphs)
    prompt = pair.tokenizer(LOOKUP_PROMPT).input_ids
    got = collect(graphs.generate(prompt, max_new_tokens=40, sampling=sampling))
    want = collect(whole_lookup(pair, settings).generate(prompt, max_new_tokens=40, sampling=sampling))
    assert (got.ids, got.origins) == (want.ids, want.origins)
    assert got.stats.lookup_hits > 0
    # The copy is found on the host, in the tokens the last step emitted: no step runs ahead.
    assert launched_ahead(emulated_cuda) == 0 and emulated_cuda.count("launch") == got.stats.steps


def launched_ahead(timeline: list[str]) -> int:
    """Reads of a step while the step after it was in flight already (two launches unread)."""
    unread = ahead = 0
    for event in timeline:
        unread += 1 if event == "launch" else -1
        ahead += event == "read" and unread == 1  # one left after this read: the next step's
    return ahead


def test_a_host_buffer_is_poisoned_while_reused(pair: ModelPair, emulated_cuda: list[str]) -> None:
    """The mock's check (`_copy_to_host`): two host buffers taken in turn, so a step's block stays
    readable while the next step is launched, and the launch after next poisons it; a block read
    after that sees NaN, or, through its event, that later step's block."""
    graphs = captured(pair.autoregressive(Controls(), whole_step=True))
    generator = torch.Generator()
    graphs.inputs.position.fill_(1)
    first = graphs.target_only(True, generator)
    second = graphs.target_only(True, generator)
    assert first.read().isfinite().all()
    kept = first.block.clone()
    third = graphs.target_only(True, generator)
    assert first.block.isnan().all()  # reused by the third launch, its copy not yet arrived
    assert second.read().isfinite().all()
    assert torch.equal(third.read(), first.block) and not torch.equal(first.block, kept)


def in_flight_pair(
    pair: ModelPair, kind: str, settings: DecodingSettings
) -> tuple[SpeculativeDecoder | AutoregressiveDecoder, Decoder]:
    """A whole-step decoder of `kind` (speculative with the story draft, or target-only) on
    emulated CUDA graphs, which launches each step before it reads the last, and the same
    decoder on the eager whole step (the CPU's), which reads each step before the next."""
    if kind == "target-only":
        graphs: SpeculativeDecoder | AutoregressiveDecoder = pair.autoregressive(
            Controls(settings), whole_step=True
        )
        captured(graphs)
        return graphs, pair.autoregressive(Controls(settings), whole_step=True)
    graphs = pair.speculative(Controls(settings), whole_step=True)
    captured(graphs)
    return graphs, pair.speculative(Controls(settings), whole_step=True)


IN_FLIGHT = [
    ("speculative", SamplingConfig()),
    ("speculative", SamplingConfig(temperature=0.9, top_p=0.9, seed=9)),
    ("target-only", SamplingConfig()),
]


@pytest.mark.parametrize(("kind", "sampling"), IN_FLIGHT)
def test_a_step_launched_past_the_end_of_text_is_discarded(
    pair: ModelPair, emulated_cuda: list[str], kind: str, sampling: SamplingConfig
) -> None:
    """End of text at a token in mid-reply (the token taken as EOS: the story model's own EOS
    comes late): the step launched before the EOS was read is never read, the reply is the
    synchronous path's, token for token and origin for origin, and the next reply, which reuses
    the first's prefix over what the discarded step wrote past it, is too."""
    settings = DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=3, draft_policy="fixed")
    graphs, eager = in_flight_pair(pair, kind, settings)
    prompt = pair.tokenizer(PROMPTS[0]).input_ids
    full = collect(eager.generate(prompt, max_new_tokens=60, sampling=sampling)).ids
    # The token whose first use comes latest (past a few steps), taken as EOS.
    eos = max(set(full[:40]), key=full.index)
    assert full.index(eos) >= 12
    for decoder in (graphs, eager):
        decoder.eos_token_ids = frozenset({eos})
    emulated_cuda.clear()
    got = collect(graphs.generate(prompt, max_new_tokens=60, sampling=sampling))
    want = collect(eager.generate(prompt, max_new_tokens=60, sampling=sampling))
    assert (got.ids, got.origins) == (want.ids, want.origins) and got.ids == full[: full.index(eos)]
    assert got.steps[-1].stop_reason == StopReason.EOS
    assert launched_ahead(emulated_cuda) >= 3
    assert emulated_cuda.count("launch") == emulated_cuda.count("read") + 1  # the discarded step
    longer = [*prompt, *got.ids, *pair.tokenizer(" Then").input_ids[1:]]
    again = collect(graphs.generate(longer, max_new_tokens=30, sampling=sampling))
    assert graphs.controls.cached_prompt_tokens >= len(prompt) + len(got.ids) - 1
    assert again.ids == collect(eager.generate(longer, max_new_tokens=30, sampling=sampling)).ids


@pytest.mark.parametrize(("kind", "sampling"), IN_FLIGHT)
def test_no_step_is_launched_past_the_token_limit(
    pair: ModelPair, emulated_cuda: list[str], kind: str, sampling: SamplingConfig
) -> None:
    """At the token limit nothing is discarded: the last steps, whose room could bind, are each
    read before the next is launched (`whole_step.room_ahead`), every launched step is read, and
    the reply is the synchronous path's, token for token, to the limit; the steps before ran one
    ahead."""
    settings = DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=3, draft_policy="fixed")
    graphs, eager = in_flight_pair(pair, kind, settings)
    prompt = pair.tokenizer(PROMPTS[1]).input_ids
    for limit in (37, 38):
        emulated_cuda.clear()
        got = collect(graphs.generate(prompt, max_new_tokens=limit, sampling=sampling))
        want = collect(eager.generate(prompt, max_new_tokens=limit, sampling=sampling))
        assert (got.ids, got.origins) == (want.ids, want.origins)
        assert len(got.ids) == limit and got.steps[-1].stop_reason == StopReason.MAX_NEW_TOKENS
        assert launched_ahead(emulated_cuda) >= 5
        assert emulated_cuda.count("launch") == emulated_cuda.count("read") == got.stats.steps
        # A speculative reply's last step runs alone (its room binds); a target-only step's
        # room never does (one token a step): its last step was launched ahead, and nothing after.
        assert emulated_cuda[-2:] == (["launch", "read"] if kind == "speculative" else ["read", "read"])


def test_the_dial_acts_from_the_next_launched_step(pair: ModelPair, emulated_cuda: list[str]) -> None:
    """With one step in flight a setting changed after step t is read reaches step t + 2: step
    t + 1 was launched with the old one. A stop request ends the reply at the next step read, and
    the step launched after it is discarded."""
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=3, draft_policy="fixed"))
    decoder = pair.speculative(controls, whole_step=True)
    captured(decoder)
    steps = decoder.generate(pair.tokenizer(PROMPTS[0]).input_ids, max_new_tokens=200)
    firsts = [next(steps) for _ in range(3)]
    assert all(s.stats.rule == "exact" and s.stats.accepted_fuzzy == 0 for s in firsts)
    controls.update(rule="pure", threshold=math.log(2.0), divergence="js")
    launched_before, *relaxed = [next(steps) for _ in range(4)]
    assert launched_before.stats.rule == "exact" and launched_before.stats.accepted_fuzzy == 0
    # js ≤ ln 2 everywhere: `pure` accepts every draft token the target can emit.
    assert all(
        s.stats.rule == "pure" and s.stats.accepted_exact + s.stats.accepted_fuzzy == 3 for s in relaxed
    )
    controls.request_stop()
    rest = list(steps)
    assert len(rest) == 1 and rest[0].stop_reason == StopReason.STOPPED
    assert emulated_cuda.count("launch") == emulated_cuda.count("read") + 1


def test_a_paused_draft_catches_up_in_a_step_launched_ahead(
    pair: ModelPair, emulated_cuda: list[str]
) -> None:
    """A speculative step launched while the target-only step before it is in flight, its draft
    behind (`Pausing`): the draft's catch-up reads only the tokens before that target-only step's
    token, so it runs ahead too; greedy at T = 0 the reply is the target's text, with catch-up
    passes among its steps, as on the synchronous path."""
    settings = DecodingSettings(rule="exact", threshold=0.0, draft_tokens=3, draft_policy="fixed")
    decoder = pair.speculative(Controls(settings), whole_step=True)
    captured(decoder)
    decoder._kept_policy = ("fixed", Pausing(2))
    prompt = pair.tokenizer(PROMPTS[0]).input_ids
    run = collect(decoder.generate(prompt, max_new_tokens=60))
    assert run.ids == collect(pair.autoregressive(Controls()).generate(prompt, max_new_tokens=60)).ids
    assert any(s.stats.draft_forwards > s.stats.drafted for s in run.steps)  # a catch-up pass
    assert launched_ahead(emulated_cuda) >= 10
    # The draft proposed what it proposes on the synchronous path: its cache was caught up right.
    eager = whole(pair, settings)
    eager._kept_policy = ("fixed", Pausing(2))
    want = collect(eager.generate(prompt, max_new_tokens=60))

    def drafting(steps: list[Any]) -> list[tuple[int, int, int]]:
        return [(s.stats.drafted, s.stats.accepted_exact, s.stats.draft_forwards) for s in steps]

    assert drafting(run.steps) == drafting(want.steps)


def test_a_static_models_grouped_attention_gives_transformers_sdpa_logits(pair: ModelPair) -> None:
    """The static model's attention (`static_attention`: SDPA's own grouped-query attention under
    the mask, no `repeat_kv`) gives transformers' SDPA's logits, pass by pass (a prompt's prefill,
    then a 5-token verify), on the story model (8 query heads, 4 key/value heads); it is the
    model's attention from then on, and the same model's `DynamicCache` passes (today's steps) are
    transformers' SDPA's bit for bit."""
    model = pair.target
    assert isinstance(model, PreTrainedModel)
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    ids = torch.tensor([pair.tokenizer(PROMPTS[2]).input_ids])
    calls = 0

    def counted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        nonlocal calls
        calls += int(kwargs.get("static_cache", False))
        return static_attention.static_sdpa_forward(*args, **kwargs)

    def passes(static: CachedModel) -> list[torch.Tensor]:
        return [static.forward(ids, ids.shape[1] - 5, keep=1), static.forward(ids, ids.shape[1], keep=5)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(AttentionInterface._global_mapping, static_attention.NAME, counted)
        ours = passes(StaticModel(model, pair.vocab_size, capacity=64))
        assert calls >= 2 * model.config.num_hidden_layers  # the two passes went through it
        calls = 0
        dynamic = passes(CachedModel(model, pair.vocab_size))
        assert calls == 0
    assert model.config._attn_implementation == static_attention.NAME
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(AttentionInterface._global_mapping, static_attention.NAME, sdpa_attention_forward)
        theirs = passes(StaticModel(model, pair.vocab_size, capacity=64))
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("sdpa")
    try:
        for mine, reference in zip(dynamic, passes(CachedModel(model, pair.vocab_size)), strict=True):
            assert torch.equal(mine, reference)
    finally:
        static_attention.use(model)


def test_an_eager_step_attends_over_the_slots_its_reply_reaches(pair: ModelPair) -> None:
    """On the CPU each pass of a whole-step reply (the prefill, every draft pass and verify)
    attends over the slots up to its reply's length + k (`StaticModel.attending`), not the static
    cache's capacity, and the step decides as over the whole capacity: the same ids and origins
    (a fuzzy rule, sampled: divergences and draws, not only argmaxes). A target-only step's pass
    (one query at the window's last slot) runs its attention without a mask, and decides as the
    masked pass over the whole capacity does."""
    k = 4
    settings = DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=k, draft_policy="fixed")
    sampling = SamplingConfig(temperature=0.9, seed=5)
    ids = pair.tokenizer(PROMPTS[2]).input_ids
    passes: list[tuple[int, int, int]] = []
    unmasked: list[tuple[int, int]] = []
    update = PositionedLayer.update

    def recorded(layer: PositionedLayer, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = update(layer, *args, **kwargs)
        passes.append((keys.shape[2], int(layer.cache.positions.max()), layer.max_cache_len))
        if layer.cache.unmasked:
            unmasked.append((keys.shape[2], int(layer.cache.positions.max())))
        return keys, values

    target_only = pair.autoregressive(Controls(), whole_step=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PositionedLayer, "update", recorded)
        got = collect(whole(pair, settings).generate(ids, max_new_tokens=60, sampling=sampling))
        got_target = collect(target_only.generate(ids, max_new_tokens=60, sampling=sampling))
    assert len(unmasked) > 60
    assert all(slots == position + 1 for slots, position in unmasked)
    assert len(got.ids) == 60
    # Every slot a pass writes is attended; at most k + 2 beyond it (a draft pass's window is
    # its step's); below the capacity. (The one-token probe at position 0 that allocates a
    # cache as it grows, `StaticModel._check_rollback`, attends over all of it.)
    replied = [(slots, position, capacity) for slots, position, capacity in passes if position > 0]
    assert len(replied) > 60
    assert all(position < slots <= position + k + 2 < capacity for slots, position, capacity in replied)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StaticModel, "attending", lambda _, window, last=False: contextlib.nullcontext())
        whole_capacity = collect(whole(pair, settings).generate(ids, max_new_tokens=60, sampling=sampling))
        target_whole_capacity = collect(target_only.generate(ids, max_new_tokens=60, sampling=sampling))
    assert (got.ids, got.origins) == (whole_capacity.ids, whole_capacity.origins)
    assert got_target.ids == target_whole_capacity.ids
