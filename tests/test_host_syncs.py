"""One host synchronisation per decoding step.

On a GPU every read of a device value by the host (`.item()`, `.tolist()`, `int(t)`, `bool(t)`,
...) waits for the queued kernels; a speculative step should pay that once, when the verdict comes
back. The reads are counted here on the CPU by wrapping the tensor methods that perform them, so the
test runs anywhere (torch's CUDA sync debug mode needs a GPU). Reads made inside torch's C++ code
(indexing with a 0-dim tensor, for one) do not pass through these methods: the code avoids them
(`index_select` instead). Torch's profiler sees those too; it checks `verify`, the step's part that
decides on the device.

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

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.acceptance import verify
from fsd_chat.decoding.draft_policy import ForwardTimings
from fsd_chat.decoding.sampling import draw, probabilities
from fsd_chat.models.pair import ModelPair

READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
READING_OPERATORS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim")
"""Operators that wait for a device value: a scalar read (`item`, `bool`, a 0-dim index), or an
output sized by the data (boolean masks, `unique`)."""


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Counts of each tensor-to-host read while the test runs."""
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
