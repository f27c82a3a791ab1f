"""Sampling with the `exact` rule (whatever T), and with `fuzzy` at T = 0, is lossless: the first
two generated tokens follow the target's exact distribution.

The law is tested on batched draws (`acceptance.judge` over many rows that repeat one position's
real target and draft laws of the offline pair): 20,000 first tokens from a fixed context, then
20,000 second tokens, each drawn from the rule at the rows its first token leads to (the target's
and the draft's next-token laws after it). That is the law of a two-token reply: the rule at
position 2 sees exactly those rows whether the first token was accepted or corrected. Chi-square
goodness-of-fit tests against probabilities computed exactly from the target (the second token's
marginal sums over every first token), α = 0.001 per test, so the four raise a false alarm with
probability ≤ 0.004; the seeds are fixed, so the outcome is reproducible. The same samples, within
the draft's support, tested against the draft's distribution must be rejected at p < 1e-6, which
shows the test has the power to see a wrong distribution. One short end-to-end run (1,000 replies
through the decoder) checks the plumbing around the rule: seeds, caches, the reply's end.

Every test runs on both engines (`engine_pair`): transformers, and llama.cpp over the same pair
written as GGUF files, whose laws are read through the engine's own KV cache (`ModelRunner`).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PreTrainedModel

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig, sampling
from fsd_chat.decoding.acceptance import judge
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.decoding.settings import Rule
from fsd_chat.models.pair import ModelPair

pytestmark = pytest.mark.slow  # statistical: 10,000 replies per rule

SAMPLES = 20_000
"""Draws per rule and position: the draft's distribution is rejected at p < 1e-13 by 10,000
(measured on draws from the target's exact distribution), far below the 1e-6 the power check asks."""
END_TO_END = 1_000
"""Replies through the decoder for the plumbing check (its power is not claimed: the law's is above)."""
JUDGED_ROWS = 500
"""Rows `emitted` judges at a time: [500, vocab] float32 laws, 1 MB at the offline pair's 512."""
ALPHA = 1e-3
POWER = 1e-6
SAMPLING = SamplingConfig(temperature=0.9, top_p=0.95)
PROMPT = "Once upon a time, there was a"


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts `observed` [categories] against probabilities
    `expected_probs` [categories]; categories expected fewer than 5 times are pooled into one.

    A category observed at all but of expected probability 0 gives p = 0: no sample of that
    distribution can fall there, whatever the other categories show.
    """
    if bool((observed[expected_probs == 0] > 0).any()):
        return 0.0
    n = observed.sum()
    expected = expected_probs.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    # The pooled category is empty (and never observed, by the guard above) when none is pooled.
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    # Survival function of chi-square(dof): the regularised upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_a_sampled_category_of_probability_zero_fails_the_test() -> None:
    expected = torch.tensor([0.5, 0.5, 0.0])
    assert chi_square_p_value(torch.tensor([500, 500, 0]), expected) == pytest.approx(1.0)
    # A single sample where the distribution has no mass, however well the rest fits.
    assert chi_square_p_value(torch.tensor([500, 500, 1]), expected) == 0.0


def rejected_by_the_statistic(observed: torch.Tensor, wrong: torch.Tensor) -> bool:
    """Whether the chi-square statistic itself rejects `wrong` [categories] at p < POWER, on the
    samples inside its support: samples outside it would be rejected by the zero-probability
    guard alone, which shows nothing of the statistic's power."""
    support = wrong > 0
    return chi_square_p_value(observed[support], wrong[support]) < POWER


@torch.inference_mode()
def next_token_laws(
    model: PreTrainedModel | ModelRunner, prompt_ids: list[int], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's law of token 1, shape [vocab], and of token 2 after each token 1, [vocab, vocab],
    on the model's device: a transformers model's batched forward, or a runner's passes over its
    KV cache (the prompt read once, each token 1 fed and rolled back)."""
    if isinstance(model, PreTrainedModel):
        p1 = probabilities(
            model(torch.tensor([prompt_ids], device=model.device)).logits[0, -1, :vocab], SAMPLING
        )
        batch = torch.tensor([[*prompt_ids, x] for x in range(vocab)], device=model.device)
        return p1, probabilities(model(batch).logits[:, -1, :vocab], SAMPLING)
    n = len(prompt_ids)
    seq = torch.tensor([[*prompt_ids, 0]], device=model.device)
    model.reset()
    p1 = probabilities(model.forward(seq, n, keep=1)[-1, :vocab], SAMPLING)
    rows = []
    for x in range(vocab):
        seq[0, n] = x
        rows.append(probabilities(model.forward(seq, n + 1, keep=1)[-1, :vocab], SAMPLING))
        model.rollback(n)
    model.reset()
    return p1, torch.stack(rows)


def exact_first_two(
    model: PreTrainedModel | ModelRunner, prompt_ids: list[int], vocab: int, eos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 1) and P(token 2) over vocab + 1 categories; the last one is "reply ended" (EOS).
    On the CPU, wherever the model is (the counts they are tested against are there)."""
    p1, p2_given = (law.cpu() for law in next_token_laws(model, prompt_ids, vocab))
    first = torch.cat([p1, torch.zeros(1)])
    first[vocab], first[eos] = p1[eos], 0.0
    weights = p1.clone()
    weights[eos] = 0.0
    second = torch.cat([weights @ p2_given, torch.zeros(1)])
    second[vocab] = p1[eos] + second[eos]
    second[eos] = 0.0
    return first, second


def emitted(
    p: torch.Tensor,
    q: torch.Tensor,
    rule: Rule,
    threshold: float,
    generator: torch.Generator,
    sampling: SamplingConfig = SAMPLING,
) -> torch.Tensor:
    """One token per row [n] int64: a draft x̃ ~ q[i], judged by `rule` against p[i] (rows [n, vocab]
    of laws under `sampling`, js divergence), kept when accepted, else the target's correction.

    `judge` decides each row on its own (a row is a draft position; the caller, not `judge`, cuts a
    block at its first rejection), so the rows are judged JUDGED_ROWS at a time: the same law, and
    each block's tensors fit in a CPU's cache (20,000 rows at once: 3.4 times the time on the
    device-selected rules' path, whose mixture weight takes 14 passes over every row)."""
    draft = torch.multinomial(q, 1, generator=generator)[:, 0]
    tokens = []
    for start in range(0, len(draft), JUDGED_ROWS):
        rows = slice(start, start + JUDGED_ROWS)
        judged = judge(
            torch.cat([p[rows], p[rows][-1:]]),  # the last row stands for the bonus position (unused)
            q[rows],
            draft[rows],
            rule=rule,
            divergence_name="js",
            threshold=threshold,
            sampling=sampling,
            generator=generator,
        )
        tokens.append(torch.where(judged.accept, draft[rows], judged.candidates[:-1]))
    return torch.cat(tokens)


def categories(tokens: torch.Tensor, eos: int, vocab: int) -> torch.Tensor:
    """Counts over vocab + 1 categories, EOS counted as the last ("reply ended")."""
    return torch.bincount(torch.where(tokens == eos, vocab, tokens), minlength=vocab + 1)


def assert_first_two_tokens_follow_the_target(
    pair: ModelPair, rule: Rule, threshold: float, generator: torch.Generator
) -> None:
    """SAMPLES first and second tokens drawn by `rule` through `judge` on the pair's device, with
    `generator` (on that device), tested against the target's exact law (α = ALPHA each) and, for
    power, against the draft's (rejected at p < POWER)."""
    tokenizer, vocab = pair.tokenizer, pair.vocab_size
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer.encode(PROMPT)
    p1, p2_given = next_token_laws(pair.target, prompt_ids, vocab)
    q1, q2_given = next_token_laws(pair.draft, prompt_ids, vocab)

    first = emitted(p1.expand(SAMPLES, -1), q1.expand(SAMPLES, -1), rule, threshold, generator)
    second = emitted(p2_given[first], q2_given[first], rule, threshold, generator)
    firsts = categories(first, eos, vocab).cpu()
    # A reply whose first token is EOS has ended: its second category is "ended" too.
    seconds = categories(torch.where(first == eos, eos, second), eos, vocab).cpu()

    target_first, target_second = exact_first_two(pair.target, prompt_ids, vocab, eos)
    assert chi_square_p_value(firsts, target_first) > ALPHA
    assert chi_square_p_value(seconds, target_second) > ALPHA

    draft_first, draft_second = exact_first_two(pair.draft, prompt_ids, vocab, eos)
    assert rejected_by_the_statistic(firsts, draft_first)
    assert rejected_by_the_statistic(seconds, draft_second)


# `exact` ignores T: at js's upper bound `fuzzy` would accept every draft token.
LOSSLESS_CASES = [("fuzzy", 0.0, 0), ("exact", math.log(2.0), 1)]


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.99])
def test_top_p_among_candidates_keeps_the_full_sorts_set(top_p: float) -> None:
    """Top-p on a large vocabulary (SmolLM2's 49,152 entries) ranks each row's `TOP_P_CANDIDATES`
    + 1 most likely tokens and sorts only the rows those leave open: it keeps exactly the tokens
    the full sort keeps, in a batch of peaked rows (candidates enough) and flat ones (sorted whole),
    and `probabilities` gives the full sort's law bit for bit."""
    generator = torch.Generator().manual_seed(7)
    vocab = 49_152
    scales = torch.tensor([12.0, 8.0, 4.0, 2.0, 1.0, 0.25]).unsqueeze(-1)  # peaked ... flat
    logits = scales * torch.randn(len(scales), vocab, generator=generator)
    probs = logits.softmax(-1)
    fast = sampling._kept_among_candidates(probs, top_p)
    full = ~sampling._dropped_sorted(probs, top_p)
    assert torch.equal(fast, full)
    kept = full.sum(-1)
    assert (kept <= sampling.TOP_P_CANDIDATES).any() and (kept > sampling.TOP_P_CANDIDATES).any()
    config = SamplingConfig(temperature=1.0, top_p=top_p)
    reference = logits.masked_fill(~full, float("-inf")).softmax(-1)
    assert torch.equal(probabilities(logits, config), reference)


@pytest.mark.parametrize(("rule", "threshold", "seed"), LOSSLESS_CASES)
def test_first_two_tokens_follow_the_target(
    engine_pair: ModelPair, rule: Rule, threshold: float, seed: int
) -> None:
    assert_first_two_tokens_follow_the_target(
        engine_pair, rule, threshold, torch.Generator().manual_seed(seed)
    )


def test_replies_through_the_decoder_follow_the_target(engine_pair: ModelPair) -> None:
    pair = engine_pair
    tokenizer, vocab = pair.tokenizer, pair.vocab_size
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer.encode(PROMPT)
    settings = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.0, draft_tokens=2)
    decoder = pair.speculative(Controls(settings))
    firsts = torch.zeros(vocab + 1, dtype=torch.long)
    for seed in range(END_TO_END):
        sampling = SamplingConfig(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p, seed=seed)
        ids = [
            t.id
            for step in decoder.generate(prompt_ids, max_new_tokens=2, sampling=sampling)
            for t in step.tokens
        ]
        firsts[ids[0] if ids else vocab] += 1
    assert chi_square_p_value(firsts, exact_first_two(pair.target, prompt_ids, vocab, eos)[0]) > ALPHA
