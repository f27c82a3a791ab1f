"""One host synchronisation per decoding step.

On a GPU every read of a device value by the host (`.item()`, `.tolist()`, `int(t)`, `bool(t)`,
...) waits for the queued kernels; a speculative step should pay that once, when the verdict comes
back. The reads are counted here on the CPU by wrapping the tensor methods that perform them, so the
test runs anywhere (torch's CUDA sync debug mode needs a GPU). Reads made inside torch's C++ code
(indexing with a 0-dim tensor, for one) do not pass through these methods: the code avoids them
(`index_select` instead), and only a GPU run can confirm it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.models import ModelPair

READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


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
def test_one_host_read_per_step(
    pair: ModelPair,
    host_reads: collections.Counter[str],
    rule: str,
    threshold: float,
    sampling: SamplingConfig,
) -> None:
    decoder = pair.speculative(Controls(DecodingSettings(rule=rule, threshold=threshold, draft_tokens=4)))
    steps = decoder.generate(
        pair.tokenizer("Once upon a time").input_ids, max_new_tokens=64, sampling=sampling
    )
    first = next(steps)  # the prompt's prefill is outside the steady state
    host_reads.clear()
    count = sum(1 for _ in steps)
    assert first.stats.drafted and count >= 5
    assert sum(host_reads.values()) == count, dict(host_reads)
