"""One host synchronisation per decoding step, and no host-to-device copy of Python values.

On a GPU every read of a device value by the host (`.item()`, `.tolist()`, `int(t)`, `bool(t)`,
...) waits for the queued kernels; a speculative step should pay that once, when the verdict comes
back. The reads are counted here on the CPU by wrapping the tensor methods that perform them, so the
test runs anywhere (torch's CUDA sync debug mode needs a GPU). Reads made inside torch's C++ code
(indexing with a 0-dim tensor, for one) do not pass through these methods: the code avoids them
(`index_select` instead). Torch's profiler sees those too; it checks `verify`, the step's part that
decides on the device.

The other way, a Python value written into a device tensor (`seq[0, i] = token_id`,
`torch.tensor(ids)`) is a host-to-device copy that waits for the queue as well. On the CPU it shows
as the operator `aten::lift_fresh` (torch wraps the Python value in a fresh tensor first), which a
`TorchDispatchMode` sees with the C++-side reads (`aten::_local_scalar_dense`): a whole decoding
step, for every kind of draft and for target-only steps, must run neither.

The `latency` draft policy reads the draft's top probability once per draft forward to decide whether
to draft on (`fsd_chat.decoding.draft_policy`): one more read per draft forward, and only then.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding import sampling as sampling_module
from fsd_chat.decoding.acceptance import verify
from fsd_chat.decoding.events import Step
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.sampling import draw, probabilities
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import lookup_decoder

READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
READING_OPERATORS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim")
"""Operators that wait for a device value: a scalar read (`item`, `bool`, a 0-dim index), or an
output sized by the data (boolean masks, `unique`)."""


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Counts of each tensor-to-host read while the test runs, on the path every device takes: on
    the CPU the loop also reads float32 laws and logits with numpy where that is faster
    (`sampling.READ_CPU_ON_HOST`), reads that wait for no queue there (`tests/test_host_paths.py`
    checks that those give the same replies)."""
    monkeypatch.setattr(sampling_module, "READ_CPU_ON_HOST", False)
    counts: collections.Counter[str] = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield counts


@pytest.mark.parametrize(
    ("rule", "threshold"), [("exact", 0.0), ("fuzzy", 0.1), ("pure", 0.3), ("mixture", 0.05)]
)
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=3)])
@pytest.mark.parametrize("policy", ["fixed", "heuristic", "latency"])
@pytest.mark.slow
def test_host_reads_per_step(
    pair: ModelPair,
    host_reads: collections.Counter[str],
    rule: str,
    threshold: float,
    sampling: SamplingConfig,
    policy: str,
) -> None:
    """One read per step (the verdict); under `latency`, one more per draft forward."""
    settings = DecodingSettings(rule=rule, threshold=threshold, draft_tokens=4, draft_policy=policy)
    decoder = pair.speculative(Controls(settings))
    decoder.timings = lambda: ForwardTimings(draft=0.02, widths=(1, 3, 33), verify=(1.0, 1.2, 4.0))
    steps = decoder.generate(
        pair.tokenizer("Once upon a time").input_ids, max_new_tokens=64, sampling=sampling
    )
    first = next(steps)  # the prompt's prefill is outside the steady state
    host_reads.clear()
    rest = list(steps)
    assert first.stats.drafted and len(rest) >= 5
    draft_reads = sum(s.stats.draft_forwards for s in rest) if policy == "latency" else 0
    assert sum(host_reads.values()) == len(rest) + draft_reads, dict(host_reads)


def device_reads(events: Iterable[FunctionEvent]) -> list[str]:
    """The profiled operators that read a device value, less those within `_assert_async`: on the
    CPU it reads its flag, on CUDA it is a device-side assert that waits for nothing."""
    reads = []
    for event in events:
        parent, inside_assert = event.cpu_parent, False
        while parent is not None and not inside_assert:
            inside_assert, parent = parent.name == "aten::_assert_async", parent.cpu_parent
        if event.name in READING_OPERATORS and not inside_assert:
            reads.append(event.name)
    return reads


@pytest.mark.parametrize(
    ("rule", "threshold"), [("exact", 0.0), ("fuzzy", 0.1), ("pure", 0.3), ("mixture", 0.05)]
)
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=3)])
def test_verify_reads_the_device_once(
    host_reads: collections.Counter[str], rule: str, threshold: float, sampling: SamplingConfig
) -> None:
    """The verdict's transfer (`tolist`) is the only read, in Python or in torch's C++ code."""
    generator = torch.Generator().manual_seed(0)
    k, vocab = 5, 64
    p = probabilities(3 * torch.randn(k + 1, vocab, generator=generator), sampling)
    q = probabilities(3 * torch.randn(k, vocab, generator=generator), sampling)
    draft_ids = draw(q, sampling, generator)
    host_reads.clear()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        verdict = verify(
            p,
            q,
            draft_ids,
            rule=rule,
            divergence_name="js",
            threshold=threshold,
            sampling=sampling,
            generator=generator,
        )
    assert len(verdict.token_ids) == verdict.accepted + 1
    assert dict(host_reads) == {"tolist": 1}
    assert device_reads(profiled.events()) == []


HOST_TRAFFIC = {
    "aten._local_scalar_dense.default": "a device value read in torch's C++ code (a 0-dim index)",
    "aten.lift_fresh.default": "a tensor made of Python values (a host-to-device copy on a GPU)",
    "aten.nonzero.default": "an output sized by the data",
}


class HostTraffic(TorchDispatchMode):
    """Counts the operators of `HOST_TRAFFIC` run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func) in HOST_TRAFFIC:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def traffic_per_step(
    steps: Iterator[Step], host_reads: collections.Counter[str]
) -> list[tuple[int, dict[str, int], bool]]:
    """Each step of a reply after its first (the prompt's prefill is outside the steady state):
    the host reads it made (`host_reads`), the other host traffic `HostTraffic` saw, and whether
    it drafted."""
    next(steps)
    per_step = []
    while True:
        host_reads.clear()
        with HostTraffic() as traffic:
            step = next(steps, None)
        if step is None:
            return per_step
        per_step.append((sum(host_reads.values()), dict(traffic.counts), step.stats.drafted > 0))


def test_host_traffic_sees_a_python_scalar_written_into_a_tensor() -> None:
    """The test below would see a scalar write put back into a step (as `seq[0, i] = id` was)."""
    seq = torch.zeros(1, 8, dtype=torch.long)
    token = torch.tensor([5])
    with HostTraffic() as traffic:
        seq[0, 2:3].copy_(token)  # device to device: nothing
    assert traffic.counts == {}
    with HostTraffic() as traffic:
        seq[0, 3] = 7
        seq[0, 4:6] = torch.tensor([1, 2])
        _ = seq[0][token[0]]  # a 0-dim index is read on the host
    assert traffic.counts == {"aten.lift_fresh.default": 2, "aten._local_scalar_dense.default": 1}


def _decoder(kind: str, pair: ModelPair, shuffled: ModelPair, settings: DecodingSettings) -> Decoder:
    if kind == "model":
        return pair.speculative(Controls(settings))
    if kind == "mapped":
        return shuffled.speculative(Controls(settings))
    if kind == "lookup":
        return lookup_decoder(pair, Controls(settings))
    return pair.autoregressive(Controls(settings))


@pytest.mark.parametrize("kind", ["model", "mapped", "lookup", "target-only"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=3)])
def test_each_step_reads_once_and_writes_no_python_value(
    pair: ModelPair,
    shuffled: ModelPair,
    host_reads: collections.Counter[str],
    kind: str,
    sampling: SamplingConfig,
) -> None:
    """Every step after the prefill: one read (the verdict, or a target step's token) and no
    C++-side read or Python value sent to the device. Prompt lookup's steps are both kinds: a
    verified copy where an n-gram matches, a target step where none does."""
    settings = DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=4, draft_policy="fixed")
    decoder = _decoder(kind, pair, shuffled, settings)
    # A prompt that repeats itself, so that lookup finds n-grams to copy.
    prompt = pair.tokenizer("Tom had a red ball. Tom had a red ball. Tom had a").input_ids
    steps = decoder.generate(prompt, max_new_tokens=48, sampling=sampling)
    per_step = traffic_per_step(steps, host_reads)
    assert len(per_step) >= 5
    assert all(reads == 1 and not other for reads, other, _ in per_step), per_step
    if kind != "target-only":
        assert any(drafted for *_, drafted in per_step)  # speculative steps were among them
    if kind == "lookup":
        assert not all(drafted for *_, drafted in per_step)  # and target steps too
