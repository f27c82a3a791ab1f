"""Acceptance rules on teacher-forced positions of real text, with the real models' distributions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fsd_chat.decoding.acceptance import judge, verify
from fsd_chat.decoding.events import Origin
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.decoding.settings import SamplingConfig
from fsd_chat.models.pair import ModelPair

TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play with her red ball in the"
    " park. One day, a big dog came and took the ball away. Lily was sad, but her friend Tom helped her."
)
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def teacher_forced(pair: ModelPair) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p and q at every position of TEXT ([n, vocab] each) and the tokens that actually follow ([n])."""
    ids = torch.tensor([pair.tokenizer(TEXT).input_ids])
    with torch.inference_mode():
        p = probabilities(pair.target(ids).logits[0, :-1, : pair.vocab_size], GREEDY)
        q = probabilities(pair.draft(ids).logits[0, :-1, : pair.vocab_size], GREEDY)
    return p, q, ids[0, 1:]


def accepted_positions(
    teacher_forced, rule: str, divergence: str, threshold: float, sampling: SamplingConfig = GREEDY
) -> set[int]:
    """Positions whose next text token the rule accepts, each tested as a block of k = 1 (the
    same uniform draws for every call under sampling: a fixed seed)."""
    p, q, tokens = teacher_forced
    generator = torch.Generator().manual_seed(0)
    accepted = set()
    for i in range(tokens.shape[0]):
        verdict = verify(
            torch.stack([p[i], p[i]]),  # the second row stands for the bonus position
            q[i : i + 1],
            tokens[i : i + 1],
            rule=rule,
            divergence_name=divergence,
            threshold=threshold,
            sampling=sampling,
            generator=generator,
        )
        if verdict.accepted:
            accepted.add(i)
    return accepted


@pytest.mark.parametrize("divergence", ["kl", "reverse-kl", "js", "tv"])
def test_acceptance_set_grows_with_the_threshold(teacher_forced, divergence: str) -> None:
    n = teacher_forced[2].shape[0]
    thresholds = [0.0, 0.01, 0.03, 0.1, 0.3, 1.0, math.inf]
    sets = [accepted_positions(teacher_forced, "fuzzy", divergence, t) for t in thresholds]
    for smaller, larger in itertools.pairwise(sets):
        assert smaller <= larger
    assert len(sets[0]) < n  # the exact test rejects some of the real text...
    assert len(sets[-1]) == n  # ...and T = ∞ accepts every position
    assert len(set(map(len, sets))) >= 3  # the dial really moves the rule


def test_fuzzy_at_zero_is_the_exact_test(teacher_forced) -> None:
    exact = accepted_positions(teacher_forced, "exact", "js", 0.0)
    assert accepted_positions(teacher_forced, "fuzzy", "js", 0.0) == exact
    # Greedy exact test: the text token is the target's argmax.
    p, _, tokens = teacher_forced
    assert exact == {i for i in range(tokens.shape[0]) if int(p[i].argmax()) == int(tokens[i])}


def test_pure_rule_ignores_the_exact_test(teacher_forced) -> None:
    # Sampling (temperature 1, p and q as computed): the same seed gives every call the same u_i.
    sampled = SamplingConfig(temperature=1.0)
    exact = accepted_positions(teacher_forced, "exact", "tv", 0.0, sampled)
    assert exact  # the exact test accepts some of the text, which pure at a tiny T > 0 does not...
    assert accepted_positions(teacher_forced, "pure", "tv", 1e-6, sampled) == set()
    # ...while T = 0 is exact speculative decoding under every rule, pure included.
    assert accepted_positions(teacher_forced, "pure", "tv", 0.0, sampled) == exact
    n = teacher_forced[2].shape[0]
    assert accepted_positions(teacher_forced, "pure", "tv", 1.0, sampled) == set(range(n))


@pytest.mark.parametrize("rule", ["fuzzy", "pure", "mixture"])
@pytest.mark.parametrize("divergence", ["kl", "js"])
def test_greedy_rules_accept_by_regret(teacher_forced, rule: str, divergence: str) -> None:
    """Greedy: every relaxed rule accepts exactly the tokens within T nats of the argmax's
    log-probability, whatever the divergence, and the first steps of the dial already move it."""
    p, _, tokens = teacher_forced
    regret = p.max(-1).values.log() - p[torch.arange(tokens.shape[0]), tokens].log()
    counts = []
    for threshold in (0.05, 0.1, 0.5, 2.0):
        accepted = accepted_positions(teacher_forced, rule, divergence, threshold)
        assert accepted == {i for i in range(tokens.shape[0]) if regret[i] <= threshold}
        counts.append(len(accepted))
    exact = len(accepted_positions(teacher_forced, "exact", divergence, 0.0))
    assert exact < counts[-1] and counts == sorted(counts)


def test_verdict_origins_and_correction() -> None:
    # k = 2; position 0 identical distributions (accepted exactly), position 1 rejected greedily.
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.1, 0.4]])
    drafts = torch.tensor([0, 2])
    gen = torch.Generator().manual_seed(0)
    verdict = verify(
        p, q, drafts, rule="fuzzy", divergence_name="tv", threshold=0.3, sampling=GREEDY, generator=gen
    )
    assert verdict.accepted == 1
    assert verdict.token_ids[-1] == 1 and verdict.next_origin == Origin.TARGET_RESAMPLED
    assert verdict.origins() == [Origin.DRAFT_EXACT, Origin.TARGET_RESAMPLED]
    assert verdict.divergences == pytest.approx([0.0, 0.7])
    # Greedy tests the regret: raising T above log(0.8 / 0.1) = 2.08 nats accepts position 1 as
    # fuzzy, then a bonus from the last row.
    verdict = verify(
        p, q, drafts, rule="fuzzy", divergence_name="tv", threshold=2.1, sampling=GREEDY, generator=gen
    )
    assert verdict.origins() == [Origin.DRAFT_EXACT, Origin.DRAFT_FUZZY, Origin.TARGET_BONUS]
    assert verdict.token_ids[-1] == 2


def test_sampled_correction_comes_from_the_residual() -> None:
    # q puts mass on token 1 where p has little; a rejected token 1 must be replaced by token 0,
    # the only token where p > q (residual max(0, p − q) = [0.5, 0, 0]).
    p = torch.tensor([[0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.1, 0.7, 0.2]])
    sampling = SamplingConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    outcomes = [
        verify(
            p,
            q,
            torch.tensor([1]),
            rule="exact",
            divergence_name="js",
            threshold=0.0,
            sampling=sampling,
            generator=gen,
        )
        for _ in range(2000)
    ]
    rejected = [v for v in outcomes if v.accepted == 0]
    assert {v.token_ids[-1] for v in rejected} == {0}
    # Acceptance probability p(1)/q(1) = 2/7: 2000 trials, 6-sigma band (false alarm < 1e-8).
    rate = 1 - len(rejected) / len(outcomes)
    sigma = math.sqrt((2 / 7) * (5 / 7) / len(outcomes))
    assert abs(rate - 2 / 7) < 6 * sigma


def test_u_zero_rejects_a_token_the_target_cannot_emit() -> None:
    """u = 0 (`torch.rand` can return it) must not accept x̃ with p(x̃) = 0: u·q(x̃) ≤ p(x̃) did,
    labelling a token outside top-k `draft-exact` at cost 0. Forced through `judge`'s draws."""
    sampling = SamplingConfig(temperature=1.0, top_k=2, seed=0)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    p = probabilities(logits, sampling)  # top-2: tokens 0 and 1
    q = torch.tensor([[0.1, 0.1, 0.7, 0.1]] * 2)
    draft_ids = torch.tensor([2, 2])  # outside p's support
    zeros = torch.zeros(2)
    for rule in ("exact", "fuzzy", "mixture"):
        for proposal in (q, None):  # a model's law, and a point mass (prompt lookup)
            judged = judge(
                p,
                proposal,
                draft_ids,
                rule=rule,  # type: ignore[arg-type]
                divergence_name="tv",
                threshold=0.0 if rule == "exact" else 0.9,
                sampling=sampling,
                generator=torch.Generator().manual_seed(0),
                p_full=probabilities(logits, sampling.untruncated()),
                uniforms=zeros,
            )
            assert not judged.accept.any(), (rule, proposal)
    # And u = 0 still accepts a token the target can emit.
    judged = judge(
        p,
        None,
        torch.tensor([1, 0]),
        rule="exact",
        divergence_name="tv",
        threshold=0.0,
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
        uniforms=zeros,
    )
    assert judged.accept.all() and judged.draft_exact.all()
