"""Prompt lookup: the n-gram search, the point-mass forms of the rules, and the laws a lookup
decoder's tokens follow.

The statistical tests are chi-square goodness-of-fit tests of the first generated token, each at
α = 0.001 (fixed seeds: reproducible), with a power check: the same samples tested against the law
a wrong implementation would follow must be rejected at p < 1e-6.
"""

from __future__ import annotations

import collections
import itertools
import math
import random

import numpy as np
import pytest
import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.acceptance import mixture_weight, point_mass_mixture_weight, verify
from fsd_chat.decoding.divergence import DIVERGENCES, against_point_mass, divergence, kl
from fsd_chat.decoding.events import Origin
from fsd_chat.decoding.lookup import NO_MATCH, PromptLookup, find_continuation, repeat_run
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.decoding.settings import DIVERGENCE_NAMES, RULES, DivergenceName, Rule
from fsd_chat.decoding.speculative import REPEAT_GUARD
from fsd_chat.engines.torch_engine.binding import autoregressive_decoder, speculative_decoder
from fsd_chat.models.pair import ModelPair
from tests.decoding_helpers import collect, modelled
from tests.test_sampling_lossless import ALPHA, POWER, chi_square_p_value

SAMPLING = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig()


def reference_continuation(tokens: list[int], ngram: int, limit: int) -> tuple[int, int, int]:
    """The search spelled out: the longest suffix (≤ ngram) with an earlier occurrence; of its
    occurrences, the latest of those whose next token follows it most often: (start, tokens
    proposed, suffix length matched)."""
    length = len(tokens)
    for n in range(min(ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        starts = [end + 1 for end in range(n - 1, length - 1) if tokens[end - n + 1 : end + 1] == suffix]
        if starts:
            follows = collections.Counter(tokens[start] for start in starts)
            start = max(starts, key=lambda start: (follows[tokens[start]], start))
            return start, min(limit, length - start), n
    return 0, 0, 0


def test_the_most_frequent_continuation_of_the_longest_suffix_is_proposed() -> None:
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    # Each continuation of "1 2 3" seen once: the latest, after the second "1 2 3": 5 7 1 2 3.
    assert find_continuation(tokens, 3, 5) == (8, 5, 3)
    assert find_continuation(tokens, 3, 2) == (8, 2, 3)
    # "6 7" followed "4 5" twice, "8" once and last: the latest "6 7" is proposed.
    often = np.array([4, 5, 6, 7, 0, 4, 5, 6, 7, 1, 4, 5, 8, 2, 4, 5])
    assert find_continuation(often, 2, 3) == (7, 3, 2)
    # A longer suffix wins over a later shorter one: "2 9" occurs once, "9" later too.
    assert find_continuation(np.array([2, 9, 4, 5, 9, 6, 2, 9]), 2, 4) == (2, 4, 2)
    assert find_continuation(np.array([5, 6, 7]), 3, 4) == NO_MATCH  # nothing repeats
    assert find_continuation(np.array([5]), 3, 4) == NO_MATCH
    # The continuation ends at the context's end.
    assert find_continuation(np.array([5, 5]), 3, 4) == (1, 1, 1)


def test_the_search_agrees_with_its_definition_on_random_contexts() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        ngram, limit = rng.randrange(1, 5), rng.randrange(1, 8)
        assert find_continuation(np.array(tokens), ngram, limit) == reference_continuation(
            tokens, ngram, limit
        ), (tokens, ngram, limit)


def test_the_repeat_run_agrees_with_its_definition_on_random_contexts() -> None:
    """The repetition a copy from `distance` back extends: the last tokens each equal to the one
    `distance` before it, counted back from the end."""
    assert repeat_run(np.array([1, 2, 3, 4, 1, 2, 3, 4, 1, 2]), 4) == 6
    assert repeat_run(np.array([7, 7, 7]), 1) == 2 and repeat_run(np.array([7, 8]), 1) == 0
    rng = random.Random(1)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 30))]
        distance = rng.randrange(1, len(tokens))
        run = 0
        while run < len(tokens) - distance and tokens[-1 - run] == tokens[-1 - run - distance]:
            run += 1
        assert repeat_run(np.array(tokens), distance) == run, (tokens, distance)


def random_laws(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 2).softmax(-1)


@pytest.mark.parametrize("name", DIVERGENCE_NAMES)
def test_point_mass_divergences_are_the_divergences_of_one_hot_rows(name: DivergenceName) -> None:
    p = torch.cat([random_laws(6, 9, 1), torch.eye(9)[:1]])  # the last row is a point mass itself
    x = torch.tensor([0, 3, 5, 8, 1, 2, 0])
    one_hot = torch.nn.functional.one_hot(x, 9).float()
    closed = against_point_mass(name, p[torch.arange(7), x])
    assert torch.allclose(closed, divergence(name, p, one_hot), atol=1e-5), (closed, DIVERGENCES[name])


def test_the_point_mass_mixture_weight_is_the_largest_within_budget() -> None:
    a = torch.tensor([0.0, 1e-4, 0.05, 0.3, 0.7, 0.99, 1.0])
    p = torch.stack([torch.tensor([v, 1 - v]) for v in a.tolist()])  # x = token 0
    for budget in (0.01, 0.1, 1.0):
        lam, cost = point_mass_mixture_weight(a, budget)
        r = (1 - lam[:, None]) * p + lam[:, None] * torch.tensor([1.0, 0.0])
        assert torch.allclose(cost, kl(r, p), atol=1e-5)
        assert bool((cost <= budget + 1e-6).all())
        assert lam[0] == 0 and lam[-1] == 1  # KL = +inf for any λ > 0 at a = 0; r = p at a = 1
        # Maximal: a little more weight overspends the budget (where λ < 1).
        more = (lam + 1e-4).clamp(max=1.0)
        r_more = (1 - more[:, None]) * p + more[:, None] * torch.tensor([1.0, 0.0])
        assert bool((kl(r_more, p)[(lam < 1) & (a > 0)] > budget).all())
        # Never below the general routine's (Newton from λ = 1) on the materialised rows.
        general, _ = mixture_weight(p, torch.tensor([[1.0, 0.0]]).expand_as(p), budget)
        assert bool((lam >= general - 1e-5).all())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("sampling", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
def test_point_masses_give_the_verdict_of_materialised_one_hot_rows(
    rule: Rule, sampling: SamplingConfig
) -> None:
    """Everything but the mixture's λ (a finer search here) is the general code's on one-hot q."""
    p = random_laws(5, 12, 2)
    draft_ids = torch.tensor([3, 0, 7, 7])
    one_hot = torch.nn.functional.one_hot(draft_ids, 12).float()
    for seed in range(40):
        verdicts = [
            verify(
                p,
                q,
                draft_ids,
                rule=rule,
                divergence_name="reverse-kl",
                threshold=0.0 if rule == "mixture" and not sampling.greedy else 1.5,
                sampling=sampling,
                generator=torch.Generator().manual_seed(seed),
            )
            for q in (None, one_hot)
        ]
        closed, general = verdicts
        assert closed.token_ids == general.token_ids and closed.exact == general.exact
        assert closed.divergences == pytest.approx(general.divergences, abs=1e-5)
        assert closed.costs == pytest.approx(general.costs, abs=1e-5)


def first_token_law(
    p: torch.Tensor, x: int, rule: Rule, divergence_name: DivergenceName, threshold: float
) -> torch.Tensor:
    """The law of the first emitted token when lookup proposes x (derivations: acceptance's docstring)."""
    a = p[x]
    point = torch.nn.functional.one_hot(torch.tensor(x), p.shape[0]).float()
    if rule == "exact":
        return p
    if rule == "mixture":
        lam, _ = point_mass_mixture_weight(a.view(1), threshold)
        return (1 - lam) * p + lam * point
    passes = bool(against_point_mass(divergence_name, a.view(1)) <= threshold)
    return point if passes else p


@pytest.fixture(scope="module")
def lookup_context(pair: ModelPair) -> tuple[list[int], int, torch.Tensor]:
    """A prompt whose last 3-gram occurred before, followed by a token x of moderate probability
    under the target: (prompt ids, x, p of the first token)."""
    base = pair.tokenizer("Once upon a time, there was a little")["input_ids"]

    def law(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return probabilities(pair.target(torch.tensor([ids])).logits[0, -1, : pair.vocab_size], SAMPLING)

    # The most likely token below 1/2, so that every rule's law differs from p and from δ.
    x = int(torch.where(law(base) < 0.5, law(base), 0.0).argmax())
    prompt = [*base[:1], *base[-3:], x, *base[1:]]
    p = law(prompt)
    assert 0.1 < float(p[x]) < 0.5
    return prompt, x, p


SAMPLES = 2_500
"""Verdicts per rule tested by chi-square; each test checks its own power: the wrong law must be
rejected at p < POWER. Simulated (300 multinomial draws of SAMPLES verdicts from each rule's law,
through the same statistic): exact's and mixture's power checks rejected in all 300, at p ≤ 4e-29
in the worst draw; at most 1 false alarm at α = 0.001 in each law's 300 draws (as the nominal
rate predicts; 300 draws resolve no finer). 10,000 verdicts took four times as long (mixture's
37 s alone on this machine) for no bound the test states."""
POINT_MASS_SAMPLES = 10_000
"""Verdicts for fuzzy's point mass, where one stray token fails the test: a rule that leaked
0.07% of its verdicts would pass with probability (1 − 0.0007)^10,000 < 0.001. Cheap (0.4 ms a
verdict), so kept at this size."""


@pytest.mark.parametrize(
    ("rule", "divergence_name", "threshold"),
    [("exact", "js", 0.0), ("fuzzy", "tv", 0.9), ("pure", "reverse-kl", 0.5), ("mixture", "js", 0.05)],
)
@pytest.mark.slow
def test_the_first_token_follows_each_rules_law(
    pair: ModelPair,
    lookup_context: tuple[list[int], int, torch.Tensor],
    rule: Rule,
    divergence_name: DivergenceName,
    threshold: float,
) -> None:
    """The first token of a lookup step proposing x, with the real target's p at that context:
    exact follows p (lossless); fuzzy (tv = 1 − a ≤ 0.9) emits x for sure; pure (−log a > 0.5)
    rejects x and draws from p; mixture follows (1 − λ)p + λδ_x. Each verdict is the decoder's
    `verify` on the step's rows (a whole reply per sample takes 80 ms on this machine; the decoder's
    end-to-end use of the same rows is the greedy test below). Power: exact's samples are tested
    against the mixture's law, the others' (but pure's, which is p) against p."""
    prompt, x, p = lookup_context
    decoder = speculative_decoder(
        pair.target,
        PromptLookup(3),
        pair.tokenizer,
        vocab_size=pair.vocab_size,
        timings=modelled(pair.target),
    )
    first = next(iter(decoder.generate(prompt, max_new_tokens=2, sampling=SAMPLING)))
    assert first.stats.lookup_hits == 1 and first.stats.drafted == 1  # the decoder proposes x here
    rows = torch.stack([p, p])  # the bonus row is never drawn from here: x is either kept or replaced
    draft = torch.tensor([x])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(pair.vocab_size)
    samples = POINT_MASS_SAMPLES if rule == "fuzzy" else SAMPLES
    for _ in range(samples):
        verdict = verify(
            rows,
            None,
            draft,
            rule=rule,
            divergence_name=divergence_name,
            threshold=threshold,
            sampling=SAMPLING,
            generator=generator,
        )
        counts[verdict.token_ids[0]] += 1
    law = first_token_law(p, x, rule, divergence_name, threshold)
    if rule == "fuzzy":
        assert law[x] == 1 and counts[x] == samples  # a point mass: no sample may fall elsewhere
    else:
        assert chi_square_p_value(counts, law) > ALPHA
    if rule != "pure":
        wrong = first_token_law(p, x, "mixture", "js", 0.05) if rule == "exact" else p
        assert chi_square_p_value(counts, wrong) < POWER


@pytest.mark.parametrize("rule", RULES)
def test_greedy_lookup_at_zero_threshold_is_the_targets_greedy_text(pair: ModelPair, rule: Rule) -> None:
    prompt = pair.tokenizer(
        "Lily had a red ball. She played with the red ball in the park. Lily had a red ball. She"
    )["input_ids"]
    reference = collect(
        autoregressive_decoder(pair.target, pair.tokenizer).generate(prompt, max_new_tokens=40)
    )
    decoder = speculative_decoder(
        pair.target,
        PromptLookup(2),
        pair.tokenizer,
        controls=Controls(DecodingSettings(rule=rule, threshold=0.0, draft_tokens=4)),
        timings=modelled(pair.target),
    )
    run = collect(decoder.generate(prompt, max_new_tokens=40))
    assert run.ids == reference.ids
    assert run.stats.lookup_hits > 0  # lookup proposed
    assert (
        run.stats.accepted_exact + run.stats.accepted_fuzzy > 0 or rule == "pure"
    )  # and paid, but under pure, which accepts by D ≤ T alone
    assert run.stats.draft_forwards == 0 and run.stats.cost == 0.0
    assert math.isclose(run.stats.lookup_hits, sum(s.stats.drafted > 0 for s in run.steps))


@pytest.mark.parametrize("whole_step", [False, True], ids=["steps", "whole-step"])
def test_a_copy_that_makes_the_reply_repeat_itself_is_verified_exactly(
    pair: ModelPair, whole_step: bool
) -> None:
    """Relaxed acceptance of the reply's own text lets a repetition feed itself (the default chat
    looped so at T 0.25 and 0.5 with every self-copy relaxed): at a threshold that relaxes every
    copy, copies of the prompt are accepted fuzzily, and a copy of the reply that would make it
    repeat itself for `REPEAT_GUARD` tokens or more only where it is the target's own choice."""
    prompt = pair.tokenizer(
        "Lily had a red ball. She played with the red ball in the park. Lily had a red ball. She"
    )["input_ids"]
    settings = DecodingSettings(rule="fuzzy", threshold=100.0, draft_tokens=4, draft_policy="fixed")
    decoder = speculative_decoder(
        pair.target,
        PromptLookup(3),
        pair.tokenizer,
        controls=Controls(settings),
        whole_step=whole_step,
        timings=modelled(pair.target),
    )
    run = collect(decoder.generate(prompt, max_new_tokens=60))
    contexts = itertools.accumulate(([t.id for t in s.tokens] for s in run.steps), initial=list(prompt))
    of_prompt = guarded = 0
    for step, context in zip(run.steps, contexts, strict=False):
        found = find_continuation(np.array(context), 3, 4)
        fuzzy = sum(t.origin == Origin.DRAFT_FUZZY for t in step.tokens)
        if not step.stats.drafted:
            continue
        if found.start < len(prompt):
            of_prompt += fuzzy
        elif repeat_run(np.array(context), len(context) - found.start) + step.stats.drafted >= REPEAT_GUARD:
            guarded += 1
            assert fuzzy == 0, step
    assert of_prompt > 0 and guarded > 0  # both kinds of copy were met
