"""The whole step compiled by inductor on the CPU (`step_graph.compiled_step_functions`: a
speculative step in its parts, a target-only step whole, each decoder layer one nested compile
region) decides as the eager step does: for every rule, greedy and sampled, the same tokens and the
same origins on the story pair, the rule given as device values (the compiled functions of a draft
length and kind serve every rule, as on CUDA). Draft length 1, which the reply's end never cuts:
two kinds compiled in all (a minute or more on a loaded 2-core machine)."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.decoding.settings import RULES, SamplingConfig
from fsd_chat.engines.torch_engine.step_graph import EagerSteps
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect

THRESHOLDS = {"exact": 0.0, "fuzzy": 0.1, "mixture": 0.05, "pure": 0.3}
PROMPTS = ["Once upon a time", "Tom and Sue went to the park. Tom"]
"""Replies of 30 tokens: the static caches (64 tokens at first) never grow, which would compile anew."""


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.9, seed=3)])
def test_compiled_steps_decide_as_eager_ones(pair: ModelPair, sampling: SamplingConfig) -> None:
    compiled = pair.speculative(
        Controls(DecodingSettings(draft_tokens=1, draft_policy="fixed")), whole_step=True
    )
    steps = compiled._steps
    assert isinstance(steps, EagerSteps)
    compiled._steps = EagerSteps(steps.target, steps.draft, device_inputs=True, compile=True)
    for rule in RULES:
        settings = DecodingSettings(
            rule=rule, threshold=THRESHOLDS[rule], draft_tokens=1, draft_policy="fixed"
        )
        compiled.controls.update(rule=rule, threshold=THRESHOLDS[rule])
        eager = pair.speculative(Controls(settings), whole_step=True)
        for prompt in PROMPTS:
            ids = pair.tokenizer(prompt).input_ids
            got = collect(compiled.generate(ids, max_new_tokens=30, sampling=sampling))
            want = collect(eager.generate(ids, max_new_tokens=30, sampling=sampling))
            assert (got.ids, got.origins) == (want.ids, want.origins), rule
    assert compiled._steps.compile_error is None


@pytest.mark.slow
def test_a_new_draft_length_compiles_no_draft_forward(pair: ModelPair) -> None:
    """The step is compiled in its parts (`step_graph.StepParts`): once a reply at k 2 has compiled
    the draft's forwards (over 2 tokens, the first pass, and 1) and its positions' laws, a reply at
    k 4 compiles, for each draft length it reaches that the first did not, its start, the target's
    verify over k + 1 tokens and its verdict (3 graphs), and nothing of the draft; where the whole
    step compiled at k 4 traced the draft's four passes again. (A reply's last steps may draft
    fewer tokens than k, to stay within its token limit: those lengths count as reached.)"""
    decoder = pair.speculative(
        Controls(DecodingSettings(draft_tokens=2, draft_policy="fixed")), whole_step=True
    )
    steps = decoder._steps
    assert isinstance(steps, EagerSteps)
    decoder._steps = EagerSteps(steps.target, steps.draft, device_inputs=True, compile=True)
    ids = pair.tokenizer(PROMPTS[0]).input_ids
    first = collect(decoder.generate(ids, max_new_tokens=16))
    graphs = counters["stats"]["unique_graphs"]
    decoder.controls.update(draft_tokens=4)
    second = collect(decoder.generate(ids, max_new_tokens=16))
    reached = {s.stats.drafted for s in second.steps} - {s.stats.drafted for s in first.steps}
    assert 4 in reached
    new = 3 * len(reached - {0}) + (0 in reached)  # a target-only step is one graph
    assert counters["stats"]["unique_graphs"] - graphs == new
    assert decoder._steps.compile_error is None
