"""Draft-length policies: the `latency` rule follows its time model, `goodput` pauses drafting
that does not pay and probes it with backoff, and no policy changes what is decoded (greedy
identity, pauses and a draft's catch-up included; sampling losslessness while the policy drops and
keeps positions).

Timing never enters an assertion: forward timings are injected (synthetic), except where only the
measured timings' shape is checked.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.draft_policy import (
    MIN_CEILING,
    PROBE_BUDGET,
    PROBE_FIRST,
    PROBE_MOST,
    FixedPolicy,
    GoodputPolicy,
    LatencyPolicy,
    MatchedGoodput,
    Next,
    make_policy,
)
from fsd_chat.decoding.events import StepStats
from fsd_chat.decoding.forward_timings import MEASURE_CONTEXT, MEASURED_WIDTHS, ForwardTimings
from fsd_chat.decoding.lookup import PromptLookup, find_continuation
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS
from fsd_chat.decoding.speculative import SpeculativeDecoder
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.engines.torch_engine.binding import speculative_decoder
from fsd_chat.engines.torch_engine.timings import ATTENTION_SECONDS, modelled_timings, time_forwards
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import SettingsError
from tests.decoding_helpers import Collected, collect, count_fed, modelled
from tests.test_sampling_lossless import ALPHA, SAMPLING, chi_square_p_value, exact_first_two

PROMPTS = ["Once upon a time", "The little bird was sad because"]
WIDE = MAX_DRAFT_TOKENS + 1

STEEP = ForwardTimings(draft=0.01, widths=(1, 2, 3, WIDE), verify=(1.0, 2.0, 10.0, 100.0))
"""A third verified token takes eight forwards: a second draft token never pays."""
FLAT = ForwardTimings(draft=0.001, widths=(1, WIDE), verify=(1.0, 1.0))
"""Verification is free in width and drafting nearly free: draft to the cap."""
BUMPY = ForwardTimings(
    draft=0.02,
    widths=(1, 2, 3, 4, 5, 6, 8, 12, 17, WIDE),
    verify=(1, 1.5, 1.64, 1.37, 1.95, 1.8, 1.59, 2.11, 2.66, 3.95),
)
"""The shape measured on the CPU-scale pair in float32 (a 1-token forward = 1)."""
SLOW = ForwardTimings(draft=1.0, widths=(1, WIDE), verify=(1.0, 1.0 + 0.1 * (WIDE - 1)))
"""A draft as slow per forward as its target: drafting never pays, even fully accepted."""
NEAR = ForwardTimings(draft=0.8, widths=(1, WIDE), verify=(1.0, 1.0 + 0.1 * (WIDE - 1)))
"""A draft nearly as slow as its target: it pays only when nearly every token is accepted (k = 1:
1 + a tokens in 1.9 forwards; at most 1.107× with all 32 accepted, just over MIN_CEILING)."""
CAPPED = ForwardTimings(draft=0.05, widths=(1, 5, WIDE), verify=(1.0, 5.0, 5.5))
"""A verify costs a forward a token up to width 5 (k 4, the decoder tests' cap), so drafting never
pays there, fully accepted or not, while a wider block would (the draft is not hopeless: a user
could raise k): whatever the acceptance, goodput pauses and probes."""
WIDTH_COSTS = ForwardTimings(draft=0.0, widths=(1, WIDE), verify=(1.0, 1.0 + 0.3 * (WIDE - 1)))
"""Prompt lookup (no draft forward) where each verified token adds 30% to a forward (a wide
shape on this CPU): lookup pays only if its tokens are accepted."""


def confident(top: float, vocab: int = 8) -> torch.Tensor:
    """A draft distribution whose top probability is `top`."""
    q = torch.full((vocab,), (1 - top) / (vocab - 1))
    q[0] = top
    return q


def decode(pair: ModelPair, policy: str, k: int, curve: ForwardTimings | None, prompt: str, tokens: int):
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=k, draft_policy=policy))
    decoder = pair.speculative(controls)
    if curve is not None:
        decoder.timings = lambda: curve
    return collect(decoder.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=tokens))


@pytest.fixture(scope="module")
def greedy_references(pair: ModelPair) -> dict[str, list[int]]:
    refs = {}
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt).input_ids
        refs[prompt] = collect(pair.autoregressive(Controls()).generate(ids, max_new_tokens=120)).ids
    return refs


def test_settings_reject_an_unknown_policy() -> None:
    with pytest.raises(SettingsError, match="draft policy"):
        DecodingSettings(draft_policy="greedy")  # type: ignore[arg-type]


def test_forward_timings_interpolate_between_measured_widths() -> None:
    curve = ForwardTimings(draft=0.1, widths=(1, 3, 7), verify=(1.0, 2.0, 4.0))
    assert [curve.verify_seconds(w) for w in (1, 2, 3, 5, 7)] == [1.0, 1.5, 2.0, 3.0, 4.0]


def test_latency_policy_decides_by_its_rule() -> None:
    """Hand-computed decisions on V(1) = 1, V(2) = 1.2, V(3) = 1.7, c_d = 0.1, λ = 1 (the
    autoregressive pseudo-step), cap 2; bins start at their middles (top 0.75 -> a = 0.75)."""
    curve = ForwardTimings(draft=0.1, widths=(1, 2, 3, WIDE), verify=(1.0, 1.2, 1.7, 40.0))
    settings = DecodingSettings(draft_tokens=2, draft_policy="latency")
    policy = LatencyPolicy(curve)
    policy.limit(settings, room=10)
    # Position 1, a = 0.75: a second token gains a² = 0.5625 < λ·(c_d + V(3) − V(2)) = 0.6: stop.
    assert policy.extend(confident(0.75)) is Next.STOP
    policy.limit(settings, room=10)
    # a = 0.95: 0.9025 > 0.6: draft on.
    assert policy.extend(confident(0.95)) is Next.DRAFT
    # Position 2, a = 0.35: G_2 = 0.3325 < λ·(V(3) − V(2)) = 0.5 (its draft forward is spent): drop.
    assert policy.extend(confident(0.35)) is Next.DROP
    policy.limit(settings, room=10)
    assert policy.extend(confident(0.95)) is Next.DRAFT
    # a = 0.65: G_2 = 0.6175 ≥ 0.5: keep it, and the cap ends the block.
    assert policy.extend(confident(0.65)) is Next.STOP
    # The room left in the reply caps the block like k does.
    assert policy.limit(DecodingSettings(draft_tokens=8, draft_policy="latency"), room=1) == 1


def test_latency_policy_calibrates_acceptance_per_bin() -> None:
    policy = LatencyPolicy(FLAT)
    assert policy.acceptance(0.97) == pytest.approx(0.95)  # the prior: the bin's middle
    policy.limit(DecodingSettings(draft_tokens=4, draft_policy="latency"), room=10)
    for _ in range(3):
        assert policy.extend(confident(0.97)) is Next.DRAFT
    policy.observe(drafted=3, accepted=1)
    # Two positions observed (the accepted one and the first rejection), one accepted.
    assert policy.acceptance(0.97) == pytest.approx((2 * 0.95 + 1) / (2 + 2))
    assert policy.acceptance(0.15) == pytest.approx(0.15)  # other bins keep their prior


@pytest.mark.parametrize(("curve", "shortest", "longest"), [(STEEP, 1, 1), (FLAT, 7, 8)])
def test_chosen_length_follows_the_forward_timings(
    pair: ModelPair, curve: ForwardTimings, shortest: int, longest: int
) -> None:
    """Steep verify: never more than one draft token. Flat verify and cheap drafts: most steps
    draft to the cap (k = 8). Deterministic: greedy, injected curves."""
    for prompt in PROMPTS:
        run = decode(pair, "latency", 8, curve, prompt, 120)
        ks = [s.stats.drafted for s in run.steps if s.stats.drafted]
        assert min(ks) >= 1 and max(ks) <= longest
        assert sorted(ks)[len(ks) // 2] >= shortest  # the median step


@pytest.mark.slow
def test_cheaper_verification_means_longer_drafts(pair: ModelPair) -> None:
    mean_k = {}
    for name, curve in {"steep": STEEP, "bumpy": BUMPY, "flat": FLAT}.items():
        runs = [decode(pair, "latency", 12, curve, prompt, 120) for prompt in PROMPTS]
        mean_k[name] = sum(r.stats.drafted for r in runs) / sum(r.stats.target_forwards for r in runs)
    assert mean_k["steep"] < mean_k["bumpy"] < mean_k["flat"], mean_k


@pytest.mark.parametrize(
    ("policy", "curve"),
    [("fixed", None), ("heuristic", None), ("latency", BUMPY), ("latency", FLAT), ("latency", None)],
)
@pytest.mark.slow
def test_greedy_output_is_the_targets_under_every_policy(
    pair: ModelPair, greedy_references: dict[str, list[int]], policy: str, curve: ForwardTimings | None
) -> None:
    """T = 0, float32: the tokens are target-only greedy decoding's whatever k each step takes
    (curve None: the pair's measured timings)."""
    for prompt in PROMPTS:
        run = decode(pair, policy, 6, curve, prompt, 120)
        assert run.ids == greedy_references[prompt]
        assert run.stats.target_forwards < run.stats.tokens


def test_measured_timings_cover_every_width(pair: ModelPair) -> None:
    curve = time_forwards(pair.target, pair.draft, pair.vocab_size)
    assert curve.widths == MEASURED_WIDTHS and curve.widths[-1] >= MAX_DRAFT_TOKENS + 1
    assert curve.draft > 0 and all(v > 0 for v in curve.verify)
    assert pair.forward_timings() is pair.forward_timings()  # modelled once per pair


@pytest.mark.slow
def test_sampling_stays_lossless_while_the_policy_drops_positions(pair: ModelPair) -> None:
    """The first two tokens follow the target's distribution (chi-square, α = 0.001 each, so a
    false alarm has probability ≤ 0.002; fixed seeds), while the first step's block is cut by the
    latency rule after its second draft forward in some replies (DROP) and not in others.

    The curve makes it so: the draft's top probability at position 1 of this prompt is 0.72 (bin
    middle 0.75), so a second position is drafted (0.75² > c_d + V(3) − V(2) = 0.51), and it is
    kept iff 0.75·a_2 ≥ V(3) − V(2) = 0.5, i.e. iff its own top probability is ≥ 0.7, which
    depends on the first drawn token (about 81% of replies).

    Power (simulated: 400 multinomial draws of the second token's counts, run through this very
    statistic at α = 0.001): with 4,000 replies the test rejects the draft's second-token law
    always, and a bug confined to the dropped replies (about 19% of them, their second token the
    draft's: the mixture 0.81·target + 0.19·draft) with probability 0.96 (8,000 replies: 0.9975, at
    twice the time; a 10% mixture: 0.78)."""
    curve = ForwardTimings(draft=0.01, widths=(1, 2, 3, WIDE), verify=(1.0, 1.1, 1.6, 40.0))
    tokenizer, vocab = pair.tokenizer, pair.vocab_size
    prompt_ids = tokenizer("Once upon a time, there was a").input_ids
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=2, draft_policy="latency"))
    decoder = pair.speculative(controls)
    decoder.timings = lambda: curve
    samples = 4_000
    firsts = torch.zeros(vocab + 1, dtype=torch.long)
    seconds = torch.zeros(vocab + 1, dtype=torch.long)
    first_blocks = torch.zeros(3, dtype=torch.long)
    for seed in range(samples):
        sampling = SamplingConfig(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p, seed=seed)
        # max_new_tokens 3 leaves the policy room for a 2-token block; the reply is stopped once its
        # first two tokens are out (the law tested), which skips a step in a fifth of the replies.
        steps, ids = [], []
        for step in decoder.generate(prompt_ids, max_new_tokens=3, sampling=sampling):
            steps.append(step)
            ids += [t.id for t in step.tokens]
            if len(ids) >= 2:
                break
        first_blocks[steps[0].stats.drafted] += 1
        firsts[ids[0] if ids else vocab] += 1
        seconds[ids[1] if len(ids) > 1 else vocab] += 1
    assert first_blocks[1] > samples // 10 and first_blocks[2] > samples // 2, first_blocks

    first, second = exact_first_two(pair.target, prompt_ids, vocab, tokenizer.eos_token_id)
    assert chi_square_p_value(firsts, first) > ALPHA
    assert chi_square_p_value(seconds, second) > ALPHA
    _, draft_second = exact_first_two(pair.draft, prompt_ids, vocab, tokenizer.eos_token_id)
    assert chi_square_p_value(seconds, draft_second) < 1e-6


def zero_runs(policy: GoodputPolicy, settings: DecodingSettings, steps: int, accepted: bool) -> list[int]:
    """Drive `policy` for `steps` steps whose drafts are all accepted (or all rejected); the lengths
    of its runs of target-only steps (k = 0) between drafting steps."""
    runs, zeros = [], 0
    for _ in range(steps):
        k = policy.limit(settings, room=100)
        if k == 0:
            zeros += 1
            continue
        if zeros:
            runs.append(zeros)
            zeros = 0
        policy.observe(k, k if accepted else 0)
    return runs


def test_goodput_never_drafts_from_a_draft_as_slow_as_its_target() -> None:
    policy = GoodputPolicy(SLOW, "model")
    settings = DecodingSettings(draft_tokens=5)
    # Even every token accepted, 2 tokens would cost a draft forward and a 2-wide verify: 2 / 2.1.
    assert policy.pause == "draft ≤ 0.95× target"
    assert [policy.limit(settings, room=100) for _ in range(1000)] == [0] * 1000  # no probe either


def test_goodput_never_drafts_from_a_draft_that_promises_too_little() -> None:
    """A draft at 0.85 of its target's forward could gain at most 5% with every token accepted
    (k → 32: 33 tokens in 0.85·32 + 4.2 forwards): under MIN_CEILING, so it is never run."""
    policy = GoodputPolicy(ForwardTimings(draft=0.85, widths=(1, WIDE), verify=SLOW.verify), "model")
    ceiling = (MAX_DRAFT_TOKENS + 1) / (
        0.85 * MAX_DRAFT_TOKENS + SLOW.verify_seconds(WIDE)
    )  # the best k: the cap
    assert 1.0 < ceiling < MIN_CEILING
    assert policy.pause == f"draft ≤ {ceiling:.2f}× target"
    assert [policy.limit(DecodingSettings(draft_tokens=5), room=100) for _ in range(300)] == [0] * 300


PRICED = ForwardTimings(draft=0.25, widths=(1, WIDE), verify=(1.0, 1.0), follows_clock=True)
"""Measured here: a draft at a quarter of its target's forward, verification free in width."""


def priced(k: int) -> float:
    """PRICED's seconds of a step drafting k tokens (k = 0: a target-only step)."""
    return k * PRICED.draft + PRICED.verify_seconds(k + 1)


def drive(
    policy: GoodputPolicy, steps: int, draft_cost: float, target_cost: float, accepted: float = 1.0
) -> list[int]:
    """Run `steps` steps of `policy` (timed by PRICED) whose drafting steps take `draft_cost` times
    what the timing pass priced them at and whose target forwards (a target-only step, a drafting
    step's verify) `target_cost` times, each accepting round(accepted·k) of k draft tokens; the k
    of each step."""
    ks = []
    for _ in range(steps):
        k = policy.limit(DecodingSettings(draft_tokens=3), room=100)
        if k:
            policy.observe(k, round(accepted * k))
            policy.timed(k, draft_cost * priced(k), target_cost * PRICED.verify_seconds(k + 1))
        else:
            policy.timed(0, target_cost * priced(0), None)
        ks.append(k)
    return ks


def test_goodput_prices_steps_by_their_own_seconds() -> None:
    """The timing pass says a 3-token block pays 4 tokens for 1.75 forwards; if drafting steps take
    three times that (a shifted load, a spelling cost the pass left out) and target-only steps what
    it said, drafting does not pay: goodput pauses within a few steps. The same times scaled alike
    (the whole machine slower) change no decision."""
    dear = GoodputPolicy(PRICED, "model")
    ks = drive(dear, 6, draft_cost=3.0, target_cost=1.0)
    assert ks[0] >= 1 and ks[-1] == 0 and dear.pause is not None and dear.pause.startswith("draft 0.")
    assert dear.drafting_price > 2.0
    as_written = drive(
        GoodputPolicy(replace(PRICED, follows_clock=False), "model"), 40, draft_cost=3.0, target_cost=1.0
    )
    assert as_written[-30:] == [3] * 30  # not measured here: taken as is, and drafting pays
    slower = GoodputPolicy(PRICED, "model")
    assert drive(slower, 40, draft_cost=3.0, target_cost=3.0) == as_written
    assert slower.pause is None and slower.drafting_price == pytest.approx(1.0)


def test_goodput_leaves_a_draft_models_catch_up_out_of_its_prices() -> None:
    """A probe after target-only steps also reads what they emitted (one wide draft forward): its
    seconds are not a drafting step's price for a draft model, and are for prompt lookup (which has
    no catch-up)."""
    for kind, counted in (("model", False), ("lookup", True)):
        policy = GoodputPolicy(PRICED, kind)
        drive(policy, 3, draft_cost=1.0, target_cost=1.0, accepted=0.0)  # rejected: paused
        assert policy.pause is not None
        while not (k := policy.limit(DecodingSettings(draft_tokens=3), room=100)):
            policy.timed(0, priced(0), None)  # target-only steps up to the probe
        policy.timed(k, 10 * priced(k), None)
        assert (policy.drafting_price > 1.5) is counted, kind


def test_goodput_pauses_a_draft_that_does_not_pay_and_probes_with_backoff() -> None:
    policy = GoodputPolicy(NEAR, "mapped")
    settings = DecodingSettings(draft_tokens=5)
    # At its prior (½) a k = 1 block pays 1.5 tokens for 1.9 forwards: paused from the start, and
    # the first probe waits until its loss (0.4 forwards) is within PROBE_BUDGET a step.
    assert policy.pause == "mapped draft 0.79× target"
    runs = zero_runs(policy, settings, 600, accepted=False)
    first = math.ceil((1.9 - 1.5) / PROBE_BUDGET)
    # Exponential backoff from PROBE_FIRST to PROBE_MOST target-only steps between probes, each at
    # least the probe budget's wait (longer as rejections make a probe's loss larger).
    assert first > PROBE_FIRST and runs[0] == first
    assert runs[2:4] == [4 * PROBE_FIRST, 8 * PROBE_FIRST] and runs[4:6] == [PROBE_MOST, PROBE_MOST]
    assert 2 * PROBE_FIRST < runs[1] < 4 * PROBE_FIRST
    assert policy.limit(settings, room=0) == 0  # no room: nothing to draft, paused or not


def test_a_carried_policy_restarts_its_backoff_with_each_reply() -> None:
    """A conversation's next reply (`begin_reply`) keeps what was measured but restarts the pause's
    backoff: a lookup policy whose waits had grown to PROBE_MOST probes again after PROBE_FIRST
    target-only steps, then backs off afresh; a policy that drafts is left as it is."""
    settings = DecodingSettings(draft_tokens=5)
    policy = GoodputPolicy(WIDTH_COSTS, "lookup")
    runs = zero_runs(policy, settings, 600, accepted=False)
    assert runs[-1] == PROBE_MOST and policy.pause is not None
    estimate = policy.estimate
    policy.begin_reply()
    assert policy.estimate == estimate and policy.pause is not None
    assert zero_runs(policy, settings, 40, accepted=False)[:2] == [PROBE_FIRST, 2 * PROBE_FIRST]
    drafting = GoodputPolicy(FLAT, "model")
    zero_runs(drafting, settings, 20, accepted=True)
    drafting.begin_reply()
    assert drafting.pause is None and drafting.limit(settings, room=100) == 5


def test_goodput_drafts_to_the_best_k_where_drafting_pays() -> None:
    policy = GoodputPolicy(FLAT, "model")
    settings = DecodingSettings(draft_tokens=6)
    assert zero_runs(policy, settings, 50, accepted=True) == []
    assert policy.pause is None and policy.limit(settings, room=100) == 6  # flat verify: the cap
    assert policy.limit(settings, room=2) == 2  # the reply's room caps it
    # A third verified token costing eight forwards makes a second draft token too dear.
    steep = GoodputPolicy(ForwardTimings(draft=0.01, widths=(1, 2, 3, WIDE), verify=(1, 1.1, 8, 40)), "model")
    steep.observe(1, 1)
    assert steep.limit(settings, room=100) == 1 and steep.pause is None


def test_goodput_pauses_lookup_that_is_rarely_accepted_and_resumes_when_it_is() -> None:
    policy = GoodputPolicy(WIDTH_COSTS, "lookup")
    settings = DecodingSettings(draft_tokens=5)
    rejected = 0
    while policy.pause is None and rejected < 5:
        policy.observe(policy.limit(settings, room=100), 0)
        rejected += 1
    # Drafting that has not paid yet must pay at the mean acceptance: one block rejected at its
    # first token pauses it (optimism only keeps drafting that has paid from pausing on a bad patch).
    assert rejected == 1
    assert (
        policy.pause == f"lookup accepts {policy.estimate:.0%}" and policy.estimate < 0.5
    )  # below its prior
    assert [policy.limit(settings, room=100) for _ in range(PROBE_FIRST)] == [0] * PROBE_FIRST
    # The text turns to quoting: the next probe is accepted whole, and drafting resumes at once.
    k = policy.limit(settings, room=100)
    assert k >= 1
    policy.observe(k, k)
    assert policy.pause is None and policy.limit(settings, room=100) >= 1


def test_goodput_keeps_lookup_acceptance_apart_by_matched_length() -> None:
    """1-token matches that are never accepted pause 1-token matches only: 3-token matches, always
    accepted, go on drafting to the cap; a step where nothing matched drafts nothing and shows the
    last length's state."""
    policy = make_policy("goodput", lambda: WIDTH_COSTS, "lookup", ngram=3)
    assert isinstance(policy, MatchedGoodput)
    settings = DecodingSettings(draft_tokens=5)
    for _ in range(20):
        k = policy.limit(settings, room=100, evidence=1)
        if k:
            policy.observe(k, 0)
        k = policy.limit(settings, room=100, evidence=3)
        assert k >= 1 and policy.pause is None
        policy.observe(k, k)
    assert policy.limit(settings, room=100, evidence=3) == 5
    assert policy.limit(settings, room=100, evidence=1) == 0
    assert policy.pause is not None and policy.pause.endswith("after 1-token matches")
    assert policy.limit(settings, room=100, evidence=0) == 0 and policy.pause is not None
    assert policy.limit(settings, room=100, evidence=3) == 5 and policy.pause is None


def test_a_long_pause_fades_to_the_drafts_long_run_acceptance_not_to_the_prior() -> None:
    """A draft never accepted, paused for hundreds of steps: its acceptance estimate fades to what
    it showed all along, so one rejected probe pauses it again (at the prior's ½ it paid again on a
    cheap verify, and drafted nine rejected steps after every long pause)."""
    # A verify 2% dearer than a forward: any acceptance above 2% pays, so the ½ prior, discounted
    # counts of ~20 tokens (FORGET) beside it, kept every step drafting.
    timings = replace(WIDTH_COSTS, verify=(1.0, 1.0 + 0.02 * (WIDE - 1)))
    policy = GoodputPolicy(timings, "lookup")
    settings = DecodingSettings(draft_tokens=1)
    drafted = []
    for step in range(600):
        k = policy.limit(settings, room=100)
        if k:
            policy.observe(k, 0)
            drafted.append(step)
    assert policy.long_run < 0.05 and policy.estimate < 0.05
    # Drafting until the long run shows it does not pay, then probes only, each wait doubling up
    # to PROBE_MOST: under 1% of the steps after the first hundred.
    assert len(drafted) < 40 and len([s for s in drafted if s >= 100]) <= 5


def test_goodput_drafts_less_where_a_long_context_makes_a_wide_verify_dear() -> None:
    """Each further verified token reads the whole context again (`attention_width`): over a short
    context lookup at 50% acceptance drafts, over a long one the same acceptance does not pay."""
    timings = replace(
        WIDTH_COSTS, verify=(1.0, 1.0 + 0.05 * (WIDE - 1)), attention=1e-3, attention_width=1e-3
    )
    settings = DecodingSettings(draft_tokens=5)
    drafted = {MEASURE_CONTEXT: 0, 2000: 0}
    for context in drafted:
        policy = GoodputPolicy(timings, "lookup")
        for _ in range(60):
            k = policy.limit(settings, room=100, context=context)
            if k:
                policy.observe(k, k // 2)
                drafted[context] += 1
    assert drafted[MEASURE_CONTEXT] == 60  # every step
    assert drafted[2000] <= 6  # its first steps and probes
    # The priced table: V(w) over 2000 tokens of context.
    table = timings.verify_table(2000)
    assert table[3] == pytest.approx(timings.verify_seconds(3) + (2000 - MEASURE_CONTEXT) * 3e-3)


def test_modelled_attention_follows_the_models_depth_and_width(pair: ModelPair) -> None:
    timings = modelled_timings(pair.target, pair.draft)
    config = pair.target.config
    assert timings.attention == pytest.approx(
        config.num_hidden_layers * config.hidden_size * ATTENTION_SECONDS
    )
    short, long = timings.verify_table(), timings.verify_table(1000)
    assert long[6] / long[1] > short[6] / short[1]


def test_the_decoder_tells_the_policy_how_long_a_suffix_lookup_matched(pair: ModelPair) -> None:
    """The evidence each step's `limit` gets is the length of the suffix its copy follows, from the
    context the step starts with (0: nothing matched, and the step drafts nothing)."""
    seen: list[int | None] = []

    class Recording(FixedPolicy):
        def limit(
            self, settings: DecodingSettings, room: int, evidence: int | None = None, context: int = 0
        ) -> int:
            seen.append(evidence)
            return super().limit(settings, room, evidence, context)

    decoder = speculative_decoder(
        pair.target,
        PromptLookup(3),
        pair.tokenizer,
        controls=Controls(DecodingSettings(rule="exact", draft_tokens=3, draft_policy="fixed")),
        vocab_size=pair.vocab_size,
        timings=modelled(pair.target),
    )
    decoder._kept_policy = ("fixed", Recording())
    prompt = pair.tokenizer(PROMPTS[0]).input_ids * 2  # repeats itself: long matches abound
    run = collect(decoder.generate(prompt, max_new_tokens=30))
    contexts = itertools.accumulate(([t.id for t in s.tokens] for s in run.steps), initial=list(prompt))
    expected = [find_continuation(np.array(c), 3, 3).matched for c in contexts][: len(run.steps)]
    assert seen == expected and 3 in seen
    assert [s.stats.drafted > 0 for s in run.steps] == [e > 0 for e in expected]


def drafting_steps(
    timings: ForwardTimings, acceptance: float, replies: int, tokens: int
) -> tuple[int, int, float]:
    """Drafting steps and all steps of `replies` fresh goodput replies of `tokens` tokens, k ≤ 5,
    each draft token accepted with probability `acceptance` given the ones before it were (seeded),
    and the modelled seconds those replies took over target-only decoding's, as a share of it."""
    rng = random.Random(0)
    drafting = steps = 0
    seconds = 0.0
    v = timings.verify_table()
    for _ in range(replies):
        policy, emitted = GoodputPolicy(timings, "model"), 0
        while emitted < tokens:
            k = policy.limit(DecodingSettings(draft_tokens=5), room=tokens - emitted)
            accepted = next((i for i in range(k) if rng.random() >= acceptance), k)
            if k:
                policy.observe(k, accepted)
                drafting += 1
                seconds += k * timings.draft + v[k + 1] + timings.step
            else:
                seconds += v[1]
            emitted += accepted + 1 if k else 1
            steps += 1
    return drafting, steps, seconds / (replies * tokens * v[1]) - 1.0


def test_goodput_settles_at_target_only_steps_on_the_story_pair(pair: ModelPair) -> None:
    """On the CPU the story pair never pays at T 0 (fixed k 5: 0.80× the target alone at 73%
    acceptance; a drafting step costs 2.35–4.55 target-only steps for k 1–5): its modelled prices
    say so at any k ≤ 5 up to 85% acceptance, and goodput drafts about once a reply (a probe), where
    it drafted every other step when untried positions counted as likely accepted."""
    timings = modelled_timings(pair.target, pair.draft)
    v = timings.verify_table()
    for a in (0.73, 0.8, 0.85):
        for k in range(1, 6):
            seconds = k * timings.draft + v[k + 1] + timings.step
            assert sum(a**i for i in range(k + 1)) * v[1] < seconds, (a, k)
    assert GoodputPolicy(timings, "model").pause == "draft 0.63× target"  # at its prior
    drafting, steps, loss = drafting_steps(timings, 0.73, replies=16, tokens=128)
    assert drafting <= 3 * 16 and steps > 1900  # ≤ 3 probes a reply
    assert loss <= PROBE_BUDGET  # which cost what the budget allows
    # Where drafting pays (no draft forward, a flat verify), it drafts nearly every step.
    drafting, steps, loss = drafting_steps(FLAT, 0.73, replies=4, tokens=128)
    assert drafting > 0.9 * steps and loss < 0


def slow_decoder(pair: ModelPair, draft: object, curve: ForwardTimings) -> SpeculativeDecoder:
    """A goodput decoder over `draft` (a model or a proposer) whose timings are `curve`."""
    controls = Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="goodput"))
    decoder = speculative_decoder(
        pair.target,
        draft,
        pair.tokenizer,
        controls=controls,
        vocab_size=pair.vocab_size,
        timings=lambda: curve,
    )
    return decoder


def tokens_fed(decoder: SpeculativeDecoder) -> list[int]:
    """A list that records, for each forward pass of the decoder's draft model from now on, the
    tokens it reads."""
    return count_fed(decoder.proposer.cached_models[0])


@pytest.mark.slow
def test_paused_steps_do_no_draft_work_and_the_draft_catches_up_in_one_forward(
    pair: ModelPair, greedy_references: dict[str, list[int]]
) -> None:
    """Greedy, T = 0, a model draft under the CAPPED curve: pauses, probes and catch-ups, and the
    output is still the target's."""
    decoder = slow_decoder(pair, pair.draft, CAPPED)
    fed = tokens_fed(decoder)
    prompt = PROMPTS[0]
    run = collect(decoder.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=120))
    assert run.ids == greedy_references[prompt]
    paused = [s for s in run.steps if not s.stats.drafted]
    assert len(paused) > 60 and all(s.stats.draft_forwards == 0 for s in paused)
    # A step counts as paused when the step before left the policy paused: CAPPED pauses at its
    # prior, so the reply's first step is target-only with no step before it.
    assert run.steps[0].stats.drafted == 0
    assert run.stats.paused_steps == len(paused) - 1 and run.stats.paused is not None
    assert run.stats.to_dict()["paused"] == run.stats.paused  # generate --json's stats
    # Each probe's first draft forward feeds every token emitted while paused, at once.
    # No prefill: paused from its first step, the draft reads the prompt on its first probe.
    assert max(fed) >= PROBE_FIRST + 1 and len(fed) == run.stats.draft_forwards


@pytest.mark.parametrize("kind", ["lookup", "mapped"])
@pytest.mark.slow
def test_goodput_keeps_greedy_output_for_lookup_and_mapped_drafts(
    request: pytest.FixtureRequest, pair: ModelPair, greedy_references: dict[str, list[int]], kind: str
) -> None:
    if kind == "lookup":
        decoder = slow_decoder(pair, PromptLookup(2), WIDTH_COSTS)
    else:
        decoder = request.getfixturevalue("shuffled").speculative(
            Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="goodput"))
        )
        decoder.timings = lambda: CAPPED
    for prompt in PROMPTS:
        run = collect(decoder.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=120))
        assert run.ids == greedy_references[prompt]
        assert run.stats.paused_steps > 0 and run.stats.drafted > 0  # paused, and probed


@pytest.mark.parametrize("kind", ["model", "mapped"])
def test_a_draft_that_cannot_pay_is_never_run(
    request: pytest.FixtureRequest, pair: ModelPair, greedy_references: dict[str, list[int]], kind: str
) -> None:
    prompt = PROMPTS[1]
    if kind == "model":
        slow = slow_decoder(pair, pair.draft, SLOW)
    else:
        slow = request.getfixturevalue("shuffled").speculative(
            Controls(DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="goodput"))
        )
        slow.timings = lambda: SLOW
    run = collect(slow.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=120))
    assert run.ids == greedy_references[prompt]
    assert run.stats.draft_forwards == 0 and run.stats.drafted == 0
    (draft,) = slow.proposer.owned_models
    assert draft.seen == 0  # not even the prompt's prefill
    who = "draft" if kind == "model" else "mapped draft"
    assert run.stats.paused == f"{who} ≤ 0.95× target" and run.stats.paused_steps == len(run.steps) - 1


def test_a_conversation_keeps_its_policy_from_reply_to_reply(pair: ModelPair) -> None:
    """The chat's decoder (reuse_prefix) carries what goodput measured into the next reply: a
    lookup that did not pay is not tried afresh at the next reply's start; a decoder that does
    not reuse its prefix (the bench's runs) starts every reply afresh."""
    prompt = pair.tokenizer(PROMPTS[0]).input_ids

    def first_match(run: Collected) -> StepStats:
        """The first step where lookup found a copy: drafted, or not drafted as paused."""
        return next(s.stats for s in run.steps if s.stats.drafted or s.stats.paused)

    conversation = slow_decoder(pair, PromptLookup(2), WIDTH_COSTS)
    first = collect(conversation.generate(prompt, max_new_tokens=40))
    assert first_match(first).drafted > 0 and first.stats.paused_steps > 0
    second = collect(conversation.generate(prompt, max_new_tokens=40))
    assert first_match(second).drafted == 0 and first_match(second).paused is not None
    afresh = slow_decoder(pair, PromptLookup(2), WIDTH_COSTS)
    afresh.reuse_prefix = False
    assert collect(afresh.generate(prompt, max_new_tokens=40)).stats.paused_steps > 0
    assert first_match(collect(afresh.generate(prompt, max_new_tokens=40))).drafted > 0


@pytest.mark.slow
def test_a_reply_that_starts_paused_feeds_the_draft_on_its_first_probe(
    pair: ModelPair, greedy_references: dict[str, list[int]]
) -> None:
    """The conversation's second reply starts paused (the policy carried over): the draft model
    reads no prompt at its start, its first probe reads it whole, and greedy output is the target's."""
    decoder = slow_decoder(pair, pair.draft, CAPPED)
    first, second = PROMPTS[0], PROMPTS[1]
    assert (
        collect(decoder.generate(pair.tokenizer(first).input_ids, max_new_tokens=120)).ids
        == (greedy_references[first])
    )
    fed = tokens_fed(decoder)
    prompt_ids = pair.tokenizer(second).input_ids
    run = collect(decoder.generate(prompt_ids, max_new_tokens=120))
    assert run.ids == greedy_references[second]
    assert run.steps[0].stats.paused is not None and run.stats.drafted > 0  # it probed
    assert len(fed) == run.stats.draft_forwards  # no prefill pass of its own
    assert fed[0] > len(prompt_ids)  # the first probe read the prompt and the paused steps at once


def _goodput_reply(
    pair: ModelPair, sampling: SamplingConfig, follows_clock: bool = False
) -> tuple[list[int], list[int]]:
    """The tokens and the per-step draft lengths of one reply under goodput and a lossy rule
    (`follows_clock`: the pair's timings handed in as following the steps' seconds)."""
    settings = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.5, draft_policy="goodput")
    decoder = pair.speculative(Controls(settings))
    if follows_clock:
        timings = replace(pair.forward_timings(), follows_clock=True)
        decoder.timings = lambda: timings
    run = collect(
        decoder.generate(pair.tokenizer(PROMPTS[1]).input_ids, max_new_tokens=160, sampling=sampling)
    )
    return [t.id for s in run.steps for t in s.tokens], [s.stats.drafted for s in run.steps]


def _loaded_clock(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Every clock read of the decoder advances by a random 0–50 ms: a machine under a load that
    comes and goes (the story pair's steps take about 1 ms)."""
    rng = random.Random(seed)
    ticks = itertools.accumulate(rng.uniform(0.0, 0.05) for _ in itertools.count())
    monkeypatch.setattr(PhaseClock, "now", lambda self: next(ticks))


def _steady_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every clock read of the decoder advances by 0.2 ms: a quiet machine, the same on every run
    (the real clock is not: on a loaded one it can look like `_loaded_clock`)."""
    ticks = itertools.count(0.0, 2e-4)
    monkeypatch.setattr(PhaseClock, "now", lambda self: next(ticks))


@pytest.mark.parametrize(
    "sampling",
    # Five 160-token replies a case: the greedy one is the quick suite's.
    [SamplingConfig(), pytest.param(SamplingConfig(temperature=1.0, seed=3), marks=pytest.mark.slow)],
    ids=["greedy", "sampled"],
)
def test_goodput_replies_do_not_follow_the_clock(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch, sampling: SamplingConfig
) -> None:
    """The same prompt, settings and seed give the same reply however long the steps take: goodput
    decides k from acceptance counts and forward costs fixed before the reply, never from a clock (under a
    lossy rule an undrafted position is a target token, so a k that followed the load would change
    the text)."""
    quiet = _goodput_reply(pair, sampling)
    assert any(quiet[1]), "the policy drafts on this pair"
    for seed in (1, 2):
        with monkeypatch.context() as patch:
            _loaded_clock(patch, seed)
            assert _goodput_reply(pair, sampling) == quiet
    # The check has teeth: timings that follow the clock (as the app's did) change the draft lengths.
    with monkeypatch.context() as patch:
        _steady_clock(patch)
        measured_quiet = _goodput_reply(pair, sampling, follows_clock=True)
    _loaded_clock(monkeypatch, 1)
    assert _goodput_reply(pair, sampling, follows_clock=True)[1] != measured_quiet[1]


def test_a_draft_too_dear_to_probe_stays_paused() -> None:
    """A draft whose catch-up after a pause costs more than PROBE_BUDGET of a target step per
    missed token is never probed once paused (a paused draft costs nothing); a cheap one probes."""
    # CAPPED pauses and probes whatever the acceptance at k ≤ 4.
    dear = replace(CAPPED, catch_up=0.05)  # 5% of V(1) a missed token
    cheap = replace(CAPPED, catch_up=0.01)
    settings = DecodingSettings(draft_tokens=4)
    for timings, probes in ((dear, False), (cheap, True)):
        policy = GoodputPolicy(timings, "mapped")
        for _ in range(3):  # drafting that never pays
            if policy.limit(settings, 100):
                policy.observe(1, 0)
        assert policy.pause is not None
        assert any(policy.limit(settings, 100) for _ in range(PROBE_MOST + 1)) == probes
