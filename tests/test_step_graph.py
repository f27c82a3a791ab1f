"""The whole-step path (`fsd_chat.decoding.step_graph`) on the CPU: the rule chosen on the device
equals the rule chosen by name, the step keeps the static-buffer discipline a CUDA graph needs, and
decoding through it keeps greedy identity, the sampling laws and the decoders' features."""

from __future__ import annotations

import itertools

import pytest
import torch

from fsd_chat.decoding.acceptance import judge
from fsd_chat.decoding.divergence import DIVERGENCE_NAMES
from fsd_chat.decoding.sampling import SamplingTensors, exponential_noise, probabilities
from fsd_chat.decoding.settings import RULES, SamplingConfig


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
        common = dict(sampling=sampling, generator=None, p_full=p_full, uniforms=uniforms, noise=noise)
        named = judge(p, q, draft_ids, rule=rule, divergence_name=name, threshold=threshold, **common)
        chosen = judge(
            p, q, draft_ids, rule=rule_index, divergence_name=divergence_index, threshold=threshold_tensor, **common
        )
        for field in ("accept", "draft_exact", "divergences", "costs", "candidates"):
            assert torch.equal(getattr(named, field), getattr(chosen, field)), (rule, name, threshold, field)


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
