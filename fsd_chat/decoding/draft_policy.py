"""How many tokens each step drafts: `goodput` (the app's default), `fixed`, `heuristic` and
`latency` draft-length policies.

A decoder that reuses its prefix (the chat, the server) keeps its policy from reply to reply, so
what a policy measured carries over a conversation; a new decoder (each of the bench's runs)
starts afresh.

A policy only decides the length of a step's draft block, from the draft's own outputs and past
verdicts, never from the target's distributions at the step being decided; the acceptance rules
and their guarantees (`fsd_chat.decoding.acceptance`) are untouched. The decoder asks it, per
step, the most tokens the step may draft (`limit`), after each draft forward pass whether that
position joins the block and whether to draft another (`extend`; the first position always joins,
so k ≥ 1), and after the verdict how many drafted tokens were accepted (`observe`). A limit of 0
makes the step a target-only step (one target forward over one token, no draft work).

- `fixed`: k = settings.draft_tokens.
- `heuristic`: transformers' "heuristic" schedule (`num_assistant_tokens_schedule`): start at
  settings.draft_tokens, +2 after a fully accepted block (up to MAX_DRAFT_TOKENS), −1 after a
  rejection (down to 1); a k set by the user restarts it.
- `latency`: the block length that maximises expected tokens per second, with k = settings.draft_tokens
  as the cap:

  Let a_i be the estimated probability that draft token i is accepted given tokens 1..i−1 were,
  G_i = a_1···a_i, and E_m = 1 + G_1 + … + G_m the expected tokens a block of m draft tokens emits
  (the target adds one after the accepted prefix). It takes T_m = m·c_d + V(m + 1) seconds (c_d: one
  draft position; V(w): a target forward over w tokens). λ is the reply's running rate: tokens
  emitted by its speculative steps / their modelled seconds, starting from one pseudo-step of
  autoregressive decoding (1 token in V(1)). Long-run tokens per second E[tokens]/E[seconds] is at
  its best when every step maximises E_m − λ·T_m with λ that best rate (renewal-reward; Dinkelbach
  1967), i.e. drafting goes on while the marginal ratio G_m / (T_m − T_{m−1}) beats λ.

  After the draft forward that proposes token j + 1 (j tokens kept so far), a_{j+1} is known and
  later positions are predicted with the same a (G_m = G_{j+1}·a_{j+1}^{m−j−1}). Among block lengths
  m = j..cap (m ≥ 1) take the first maximiser m* of E_m − λ·T_m, where stopping at m = j still
  pays the forward just made (T = (j + 1)·c_d + V(j + 1)). m* = j: token j + 1 is dropped and the
  step verifies j tokens; m* = j + 1: it is kept and drafting stops; m* > j + 1: it is kept and
  the next position is drafted. Looking ahead to the cap lets a block cross a bump of a
  non-monotone V (on this CPU, float32: V(3) > V(4)).

  a comes from the draft's confidence, its top probability c = max_x q(x), calibrated against the
  acceptance measured in this reply: c falls in one of `BINS` equal-width bins of [0, 1], and a is
  the posterior mean of that bin's Beta counts: accepted / observed draft tokens of the bin so far
  in the reply (a position is observed when the tokens before it were accepted, so a is the
  acceptance given the prefix was) plus a prior of `PRIOR_STRENGTH` pseudo-tokens centred on the
  bin's middle (a calibrated draft). Whatever the rule and threshold, acceptance is what the
  verdicts count.

  The decision is taken before x̃_{j+1} is drawn and depends on q_{j+1} alone (not on the sampled
  token's probability q_{j+1}(x̃_{j+1})), so a kept position's token is still a draw from q_{j+1}
  and the exact test keeps sampling lossless. Reading c takes one host synchronisation per draft
  forward under `latency` (the other policies read nothing: one per step, the verdict's).

  c_d and V(w) are found once per loaded pair (`ModelPair.forward_timings` keeps them: modelled for
  transformers models, measured once and cached per machine on llama.cpp) and can be injected (tests pass synthetic `ForwardTimings`). Sampling, verification and rollback are left out of the timings.

- `goodput` (the app's default, `DEFAULT_DRAFT_POLICY`): each step's k in 0..settings.draft_tokens with the most expected tokens
  per second, k = 0 being a target-only step (one target forward over one token, no draft forward,
  no verify width). With â_i the measured acceptance at position i of a block (accepted /
  observed draft tokens there, a position being observed when the ones before it were accepted;
  the counts are discounted by `FORGET` a step, paused ones included, so that â follows the text;
  a Beta prior of `PRIOR_STRENGTH` pseudo-tokens at the pooled acceptance â of all positions, itself
  with a prior at the draft's long-run acceptance, every verdict undiscounted, ½ before any: what
  a long pause fades to), a block of k yields E_k = 1 + G_1 + … + G_k tokens, G_i = â_1···â_i
  (Leviathan et al. 2023, eq. 1, with an acceptance per position: acceptance comes in runs, a draft
  that got the first tokens right tends to get the next ones right too, so one â for every
  position undercounts long blocks) in T_k = k·c_d + V(k + 1) + s seconds (s: a drafting step's
  own work, `ForwardTimings.step`), target-only decoding 1 token in V(1). The step drafts the k ≥ 1
  that maximises E_k / T_k while that beats 1 / V(1) (speculation pays only where
  E_k·V(1) / T_k > 1); when it does not, the policy pauses: drafting that has paid pauses only
  when it would not pay even at an optimistic acceptance (`PAUSE_OPTIMISM` standard deviations of
  the pooled â above the mean: a pause costs several steps, a drafting step that does not pay
  one), drafting that has not (a reply's first step, a probe) when it does not pay at the mean. A
  policy that does not pay at its prior starts paused. Paused: target-only steps, then a probe (one
  drafting step) after `PROBE_FIRST` of them, each later pause waiting twice as long as the one
  before (up to `PROBE_MOST`: exponential backoff) until drafting pays for `PROBE_FIRST` steps in a
  row, and each long enough that the probe's expected loss (with a draft model's catch-up
  forward) is within `PROBE_BUDGET` of a target-only step over the wait. A draft that could not gain `MIN_CEILING` even with every token accepted
  (max_k (k + 1)·V(1) / T_k < MIN_CEILING: nearly as slow per forward as its target) is never
  drafted from, not even to probe, and a draft model's cache is never filled ("draft ≤ 1.04× target").

  The prices c_d and V(w) are fixed before a reply and never read from a clock during one:
  modelled from the models' shapes and sizes for transformers models (`modelled_timings`), timed
  once on the machine and cached per machine, file and threads on llama.cpp
  (`fsd_chat.engines.llama_calibration`). Under a lossy rule an undrafted position is a target
  token, so a k that followed the machine's load would change the text from run to run. The
  policy's every decision is then a function of the acceptance counts alone, and a seed gives the
  same reply on every run on a machine (and, for transformers models, on any). Only timings handed
  in as following the clock (`ForwardTimings.follows_clock`, from `time_forwards`: an
  experiment, not the app) follow the steps' own seconds: two running factors scale them to what steps actually take: the target's
  (a target-only step's seconds / V(1), and a drafting step's verify forward / V(k + 1) where that
  lap is its own: on the CPU, or with a synchronisation per phase) and drafting's (a drafting
  step's seconds / (k·c_d + V(k + 1))), each a geometric mean discounted by `TIME_FORGET` a
  sample. A step's seconds include what the timing pass leaves out (sampling, the acceptance test,
  rollback, a mapped draft's spelling) and follow a load that shifts after the pass. A factor
  shared by both would cancel in E_k·V(1) / T_k: only their ratio moves the decision (until both
  are measured it is 1). The first drafting step after target-only steps is not counted for a
  draft model: its first forward also reads the tokens the pause emitted (prompt lookup has no
  such catch-up).
  â needs no confidence, so one test covers a draft model, a mapped draft and prompt lookup
  (whose laws are point masses, q = δ, which `latency` cannot tell apart, and whose draft positions
  cost c_d = 0: only the verify width is at stake). Prompt lookup does know something of its copy
  before proposing it, the length of the suffix that matched, and its acceptance follows that
  length (on the default chat about 16%, 43% and 85% after 1, 2 and 3 tokens): `MatchedGoodput`
  keeps one such policy per length. V(w) grows with the context, a wide verify's faster
  (`ForwardTimings.attention`, `attention_width`): the table is priced over the step's context. k is chosen before drafting, so the policy reads
  nothing from the device (one host synchronisation per step, the verdict's). `pause` says why it
  is paused ("lookup accepts 5%", "draft 0.87× target": the expected speed of the best k ≥ 1 over
  target-only's), shown by the chat and `generate --json`.
  Source: TurboSpec (Liu et al. 2024, arXiv 2406.14066): choose the proposal length, 0 included,
  that maximises goodput (accepted tokens per second) from measured acceptance and forward times.

Sources: SpecDec++ (Huang, Guo, Wang 2024, arXiv 2405.19715: stop drafting when a predicted
acceptance probability says a rejection is likely; here the threshold comes from measured forward times);
DISCO (Mamou et al. 2024, arXiv 2405.04304: a dynamic draft length from the draft's confidence);
transformers' `assistant_confidence_threshold` (stop when the draft token's probability is below a
constant, 0.4 by default) and `num_assistant_tokens_schedule="heuristic"` (the +2/−1 schedule);
llama.cpp's `--draft-p-min` (drop a draft token whose top probability is below a constant).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

import torch

from fsd_chat.decoding.forward_timings import MEASURE_CONTEXT, ForwardTimings
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS, DecodingSettings, DraftPolicyName

BINS = 10
"""Equal-width bins of the draft's top probability over which acceptance is calibrated."""

PRIOR_STRENGTH = 2.0
"""Pseudo-tokens of each bin's Beta prior (centred on the bin's middle): measured acceptance
outweighs it after a couple of observations."""

FORGET = 0.95
"""`goodput`: the weight the acceptance counts keep from one step to the next, target-only steps
included (they follow the last 1 / (1 − FORGET) = 20 steps or so: the acceptance of a reply drifts
between quoting and free text, and a long pause forgets what paused it)."""

CONTEXT_STEP = 32
"""`goodput`: how far the context may grow (tokens) before the forwards are priced anew over it."""

PROBE_FIRST = 8
"""`goodput`: target-only steps before the first probe of a paused draft."""

PROBE_MOST = 128
"""`goodput`: the longest wait between probes, in target-only steps (one probe costs one draft block,
so at most about 1/128 of the steps are spent on a draft that never pays)."""

PAUSE_OPTIMISM = 1.22
"""`goodput`: standard deviations of the pooled acceptance's posterior added to every position's
acceptance when deciding whether drafting that has paid pauses (drafting that has not must pay at
the mean: see `GoodputPolicy.observe`).
A pause costs at least PROBE_FIRST target-only steps where drafting might have paid, a drafting step
that does not pay costs one step's difference: pausing is right only when drafting pays with a
probability under 1 / (1 + PROBE_FIRST) ≈ 0.11, i.e. when it would not pay even at the acceptance's
89th percentile (normal approximation of the Beta posterior: 1.22 standard deviations). The draft
length itself is chosen at the posterior mean."""

TIME_FORGET = 0.8
"""`goodput`: the weight a running time factor keeps from one step of its kind to the next (it follows
the last 1 / (1 − TIME_FORGET) = 5 steps or so: a load that shifts shows within a few steps)."""

PROBE_BUDGET = 0.03
"""`goodput`: the most a paused draft's probes may add to a target-only step, as a share of it: a
wait before a probe is at least the probe's expected loss (its block against the target-only steps
it replaces, plus a draft model's catch-up forward) over this share of V(1) less the catch-up's
per-token price (story pair, at its prior: a k = 1 probe loses about 1.3 V(1), so probes come
65 steps apart or more, not 8). A probe of a draft model first feeds its cache every token it
missed while paused: when that alone
costs more than this per paused token (a draft over about 30% of its target's size on a CPU), no
interval keeps probes within budget, and a pause lasts as long as the decoder (the conversation):
a paused draft then costs nothing, as a user who sees `paused` expects."""

MIN_CEILING = 1.1
"""`goodput`: the least speed-up over target-only decoding a draft must promise with every token
accepted (at the best k) to be drafted from at all. Real acceptance is lower (at 90% a k = 1 block
keeps 95% of that promise) and the timing pass leaves the acceptance test and rollback out, so a
draft that promises less than 10% gains nothing a user would see, and costs its prefill."""


def _bin(confidence: float) -> int:
    """The calibration bin of a top probability."""
    return min(int(confidence * BINS), BINS - 1)


class Next(StrEnum):
    """What follows a drafted position (`DraftPolicy.extend`)."""

    DROP = "drop"
    """The position does not join the block; the step verifies the tokens before it."""
    STOP = "stop"
    """The position joins the block, and the step drafts no more."""
    DRAFT = "draft"
    """The position joins the block, and the step drafts the next one (up to its limit)."""


class DraftPolicy(Protocol):
    """Chooses each step's draft length (see the module docstring)."""

    @property
    def pause(self) -> str | None:
        """Why the policy takes target-only steps for now (None: it drafts; only `goodput` pauses)."""
        ...

    def limit(
        self,
        settings: DecodingSettings,
        room: int,
        evidence: int | None = None,
        context: int = MEASURE_CONTEXT,
    ) -> int:
        """The most tokens the coming step may draft, ≤ `room` (the reply's room left; 0: none).
        Starts a step. `evidence`: what the proposer knows of its proposal before making it:
        prompt lookup's matched suffix length in tokens (`fsd_chat.decoding.lookup.Match`; 0:
        nothing matches); None for a draft model. `context`: the tokens the step's forwards
        attend to (prompt and reply so far), which make a wide verify dearer (`goodput`)."""
        ...

    def extend(self, q: torch.Tensor) -> Next:
        """What to do with the position whose draft distribution `q` ([vocab]) was just computed
        (never DROP for the step's first position)."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """The verdict of the step: `drafted` tokens in the block, `accepted` of them accepted."""
        ...

    def timed(self, drafted: int, seconds: float, verify_seconds: float | None) -> None:
        """The wall-clock `seconds` a step that drafted `drafted` tokens took (0: a target-only
        step), prefill excluded, and of those the target's verify forward (None: not known on its
        own, e.g. on CUDA without a synchronisation per phase); called after every step."""
        ...

    def begin_reply(self) -> None:
        """The conversation's next reply starts with this policy, carried from the last one."""
        ...


class FixedPolicy:
    """k = settings.draft_tokens at every step."""

    pause: str | None = None

    def limit(
        self,
        settings: DecodingSettings,
        room: int,
        evidence: int | None = None,
        context: int = MEASURE_CONTEXT,
    ) -> int:
        """settings.draft_tokens (at most `room`)."""
        return min(settings.draft_tokens, room)

    def extend(self, q: torch.Tensor) -> Next:
        """Always DRAFT (no host read)."""
        return Next.DRAFT

    def observe(self, drafted: int, accepted: int) -> None:
        """Nothing to learn."""

    def timed(self, drafted: int, seconds: float, verify_seconds: float | None) -> None:
        """Nothing to learn."""

    def begin_reply(self) -> None:
        """Nothing to restart."""


class HeuristicPolicy(FixedPolicy):
    """transformers' heuristic schedule: +2 after a fully accepted block, −1 after a rejection,
    starting from (and restarted by a change of) settings.draft_tokens."""

    def __init__(self) -> None:
        self._start = 0
        self._k = 0

    def limit(
        self,
        settings: DecodingSettings,
        room: int,
        evidence: int | None = None,
        context: int = MEASURE_CONTEXT,
    ) -> int:
        """The scheduled k (at most `room`)."""
        if settings.draft_tokens != self._start:
            self._start = self._k = settings.draft_tokens
        return min(self._k, room)

    def observe(self, drafted: int, accepted: int) -> None:
        """+2 (up to MAX_DRAFT_TOKENS) when all `drafted` were accepted, else −1 (down to 1)."""
        self._k = min(drafted + 2, MAX_DRAFT_TOKENS) if accepted == drafted else max(drafted - 1, 1)


class LatencyPolicy:
    """The block length that maximises E_m − λ·T_m, decided position by position (module docstring).

    Args:
        timings: The device's draft and verify forward times.
    """

    pause: str | None = None

    def __init__(self, timings: ForwardTimings) -> None:
        self._draft = timings.draft
        self._verify = timings.verify_table()
        self._accepted = [PRIOR_STRENGTH * (b + 0.5) / BINS for b in range(BINS)]
        self._observed = [PRIOR_STRENGTH] * BINS
        self._tokens, self._seconds = 1.0, self._verify[1]  # λ's pseudo-step: autoregressive
        self._cap = 0
        self._forwards = 0
        self._bins: list[int] = []
        self._all_accepted = 1.0  # G_j
        self._expected = 1.0  # E_j

    def limit(
        self,
        settings: DecodingSettings,
        room: int,
        evidence: int | None = None,
        context: int = MEASURE_CONTEXT,
    ) -> int:
        """settings.draft_tokens, the cap (at most `room`)."""
        self._cap = min(settings.draft_tokens, room)
        self._forwards, self._bins, self._all_accepted, self._expected = 0, [], 1.0, 1.0
        return self._cap

    @property
    def rate(self) -> float:
        """λ: the reply's tokens per modelled second so far (tokens/s)."""
        return self._tokens / self._seconds

    def acceptance(self, confidence: float) -> float:
        """a: the calibrated probability that a draft token of top probability `confidence` is
        accepted, given the tokens before it in the block were."""
        b = _bin(confidence)
        return self._accepted[b] / self._observed[b]

    def extend(self, q: torch.Tensor) -> Next:
        """The first maximiser m* of E_m − λ·T_m over m = j..cap, as DROP / STOP / DRAFT (one host
        read)."""
        confidence = float(q.max())
        a = self.acceptance(confidence)
        j = len(self._bins)
        self._forwards += 1
        rate = self.rate
        best_m = j
        best = self._expected - rate * ((j + 1) * self._draft + self._verify[j + 1]) if j else -math.inf
        expected, all_accepted = self._expected, self._all_accepted
        for m in range(j + 1, self._cap + 1):
            all_accepted *= a
            expected += all_accepted
            value = expected - rate * (m * self._draft + self._verify[m + 1])
            if value > best:
                best_m, best = m, value
        if best_m == j:
            return Next.DROP
        self._bins.append(_bin(confidence))
        self._all_accepted *= a
        self._expected += self._all_accepted
        return Next.STOP if best_m == j + 1 else Next.DRAFT

    def observe(self, drafted: int, accepted: int) -> None:
        """Count the accepted positions and the first rejected one in their bins, and the step's
        tokens and modelled seconds in λ."""
        for b in self._bins[: accepted + 1]:
            self._observed[b] += 1
        for b in self._bins[:accepted]:
            self._accepted[b] += 1
        self._tokens += accepted + 1
        self._seconds += self._forwards * self._draft + self._verify[drafted + 1]

    def timed(self, drafted: int, seconds: float, verify_seconds: float | None) -> None:
        """Nothing: λ counts modelled seconds, from the timing pass alone."""

    def begin_reply(self) -> None:
        """Nothing to restart: the calibration carries over, λ too."""


class GoodputPolicy(FixedPolicy):
    """Each step's k in 0..settings.draft_tokens with the most expected tokens per second, from the
    measured acceptance and the forward timings scaled by the steps' own seconds; k = 0 is a
    target-only step (module docstring).

    Args:
        timings: The device's draft and verify forward times (scaled by measured step times only
            when `timings.follows_clock`).
        kind: What proposes, a `fsd_chat.decoding.proposal.DraftKind` (named in `pause`; a str
            here: that module imports this one).
        matched: Prompt lookup's matched suffix length whose proposals this policy decides
            (`MatchedGoodput`; named in `pause`).
    """

    def __init__(self, timings: ForwardTimings, kind: str, matched: int | None = None) -> None:
        self._matched = matched
        self._timings = timings
        self._draft = timings.draft
        self._verify = timings.verify_table()
        self._context = MEASURE_CONTEXT  # the context self._verify is priced at
        self._step = timings.step
        self._kind = kind
        self._learns = timings.follows_clock
        # Discounted accepted / observed draft tokens at each position of a block.
        self._hits = torch.zeros(MAX_DRAFT_TOKENS, dtype=torch.float64)
        self._tries = torch.zeros(MAX_DRAFT_TOKENS, dtype=torch.float64)
        # Every position's accepted / observed tokens since the policy began, never discounted.
        self._long_hits = self._long_tries = 0.0
        self._cap = MAX_DRAFT_TOKENS  # settings.draft_tokens at the last step
        self._wait = 0  # target-only steps left before the next probe
        self._interval = PROBE_FIRST
        self._paying = 0  # drafting steps in a row that paid
        # log(measured / modelled seconds), discounted sums and weights: [target-only, drafting].
        self._log_ratio = [0.0, 0.0]
        self._weight = [0.0, 0.0]
        self._caught_up = True  # the last step drafted (or none yet): the draft model is not behind
        # Even with every draft token accepted no k may pay enough: a draft nearly as slow per
        # forward as its target. Then no step drafts, not even a probe, whatever the acceptance.
        _, ceiling = self._best(torch.ones(MAX_DRAFT_TOKENS, dtype=torch.float64), MAX_DRAFT_TOKENS)
        self._hopeless = ceiling < MIN_CEILING
        # Probes of this draft cost more than PROBE_BUDGET however rare: a pause is final.
        self._catch_up = timings.catch_up
        self._final_pause = timings.catch_up > PROBE_BUDGET * self._verify[1]
        if self._hopeless:
            self.pause = f"{self._who()} ≤ {ceiling:.2f}× target"
        elif self.best(self._cap)[1] < 1.0:
            # Not paying at the prior: drafting must show it pays on a probe first (`observe`),
            # and a draft too dear to probe is not run at all.
            self._pause()
            self._hopeless = self._final_pause

    @property
    def long_run(self) -> float:
        """The draft's acceptance over everything the policy observed (Beta(1, 1) prior: ½ before
        any verdict): where `estimate` returns when its discounted counts fade."""
        return (self._long_hits + 1.0) / (self._long_tries + 2.0)

    @property
    def estimate(self) -> float:
        """â: the measured acceptance of a draft position given the ones before it were accepted:
        the discounted counts, with a prior of PRIOR_STRENGTH pseudo-tokens at `long_run`. (A
        prior at ½ made a long pause forget what paused it: on a pair where a verify costs little
        more than a forward, the first probe after it, rejected, still paid at the mean, and
        drafting resumed for nine rejected steps each time; the default chat with a mapped draft
        ran at 0.96× the target alone.)"""
        return float(
            (self._hits.sum() + PRIOR_STRENGTH * self.long_run) / (self._tries.sum() + PRIOR_STRENGTH)
        )

    def acceptance(self, optimism: float = 0.0) -> torch.Tensor:
        """â_i for positions i = 1..MAX_DRAFT_TOKENS ([MAX_DRAFT_TOKENS] float64): each position's
        Beta posterior mean, from its own counts and a prior of PRIOR_STRENGTH pseudo-tokens at the
        pooled `estimate` (a deep position, seldom reached, starts from what the block as a whole
        shows), plus `optimism` standard deviations of the pooled estimate (capped at 1): one shift
        for every position, the draft's quality being what is uncertain. (Each position's own
        deviation would keep the positions past the drafted k, never observed, at the prior's
        width: the best k at such an acceptance reached them and paid whatever the counts said.)"""
        pooled = self.estimate
        mean = (self._hits + PRIOR_STRENGTH * pooled) / (self._tries + PRIOR_STRENGTH)
        if not optimism:
            return mean
        total = float(self._tries.sum()) + PRIOR_STRENGTH
        return (mean + optimism * math.sqrt(pooled * (1 - pooled) / (total + 1))).clamp(max=1.0)

    @property
    def drafting_price(self) -> float:
        """How much dearer a drafting step runs, against its timing-pass price, than a target-only
        step against its own (1: as the timing pass says; > 1: drafting dearer than it measured)."""
        means = [
            total / weight if weight else 0.0
            for total, weight in zip(self._log_ratio, self._weight, strict=True)
        ]
        return math.exp(means[1] - means[0])

    def best(self, cap: int) -> tuple[int, float]:
        """The k in 1..cap with the most expected tokens per second at acceptance â and the
        measured prices, and that rate as a multiple of target-only decoding's (E_k·V(1) / T_k)."""
        k, speedup = self._best(self.acceptance(), cap)
        return k, speedup / self.drafting_price

    def _best(self, acceptance: torch.Tensor, cap: int) -> tuple[int, float]:
        # E_k = 1 + G_1 + … + G_k, G_i = â_1···â_i.
        expected = (1.0 + acceptance[:cap].cumprod(0).cumsum(0)).tolist()
        best_k, best = 1, 0.0
        for k in range(1, cap + 1):
            speedup = expected[k - 1] * self._verify[1] / self._seconds(k)
            if speedup > best:
                best_k, best = k, speedup
        return best_k, best

    def _seconds(self, k: int) -> float:
        """T_k: the seconds of a step drafting k tokens (k = 0: V(1))."""
        return k * self._draft + self._verify[k + 1] + (self._step if k else 0.0)

    def limit(
        self,
        settings: DecodingSettings,
        room: int,
        evidence: int | None = None,
        context: int = MEASURE_CONTEXT,
    ) -> int:
        """0 while paused (a target-only step) except on a probe; else the best k ≤ the cap, with
        the forwards priced over `context` (repriced every CONTEXT_STEP tokens)."""
        self._cap = settings.draft_tokens
        if abs(context - self._context) >= CONTEXT_STEP:
            self._context = context
            self._verify = self._timings.verify_table(context)
        if not room:
            return 0
        if self._hopeless:
            return 0
        if self.pause is not None and self._wait:
            self._wait -= 1
            self._hits *= FORGET
            self._tries *= FORGET
            return 0
        # A probe drafts the best k as if drafting paid: a draft that pays again shows it.
        return min(self.best(self._cap)[0], room)

    def observe(self, drafted: int, accepted: int) -> None:
        """Count the step's observed and accepted positions, then pause or resume."""
        self._hits *= FORGET
        self._tries *= FORGET
        self._hits[:accepted] += 1.0
        self._tries[: min(accepted + 1, drafted)] += 1.0
        self._long_hits += accepted
        self._long_tries += min(accepted + 1, drafted)
        # A pause costs PROBE_FIRST steps or more, a drafting step that does not pay one: drafting
        # that has paid stops only when it would not pay even at an optimistic acceptance. Drafting
        # that has not yet (a probe, a reply's first steps) must pay at the mean: the optimism of a
        # few counts would resume it, a losing step at a time until the optimistic test pauses again.
        optimism = PAUSE_OPTIMISM if self._paying else 0.0
        if self._best(self.acceptance(optimism), self._cap)[1] / self.drafting_price >= 1.0:
            self.pause = None
            self._paying += 1
            if self._paying >= PROBE_FIRST:
                self._interval = PROBE_FIRST
            return
        self._pause()
        # No probe could keep within PROBE_BUDGET: the draft is not run again (see `limit`).
        self._hopeless = self._hopeless or self._final_pause

    def begin_reply(self) -> None:
        """The acceptance and prices measured stay; a pause's backoff restarts. A new prompt
        brings new text (a document pasted to summarise, after a question prompt lookup could not
        copy from): its first probe comes within PROBE_FIRST target-only steps, or the probe
        budget's wait if longer, as after a pause of a fresh policy, where a wait grown to
        PROBE_MOST over the last reply would keep the draft out for most of this one."""
        if self.pause is None or self._hopeless:
            return
        # As `_pause` from a fresh interval, but never a longer wait than the one left.
        self._wait = min(self._wait, max(PROBE_FIRST, self._probe_floor()))
        self._interval = min(2 * PROBE_FIRST, PROBE_MOST)

    def _pause(self) -> None:
        """Wait before the next probe: each pause twice as long as the last (until drafting pays
        for a while again), and long enough that the probe's expected loss, its catch-up forward
        included, spreads to PROBE_BUDGET of a target-only step over the wait."""
        self._paying = 0
        self._wait = max(self._interval, self._probe_floor())
        self._interval = min(2 * self._interval, PROBE_MOST)
        # Short enough for the chat's stats strip: lookup drafts cost nothing, only their acceptance
        # can fail them; a draft model may also be too slow.
        if self._kind == "lookup":
            after = "" if self._matched is None else f" after {self._matched}-token matches"
            self.pause = f"lookup accepts {self.estimate:.0%}{after}"
        else:
            self.pause = f"{self._who()} {self.best(self._cap)[1]:.2f}× target"

    def _probe_floor(self) -> int:
        """The fewest target-only steps over which a probe's expected loss (its block of the best
        k at the mean, less the tokens it is expected to emit, plus a draft model's catch-up: one
        more draft forward, over the tokens the wait emitted) is within PROBE_BUDGET a step."""
        k, _ = self.best(self._cap)
        expected = 1.0 + float(self.acceptance()[:k].cumprod(0).sum())
        catch_up = self._draft if self._catch_up else 0.0
        loss = (self._seconds(k) + catch_up) * self.drafting_price - expected * self._verify[1]
        room = PROBE_BUDGET * self._verify[1] - self._catch_up
        return math.ceil(loss / room) if loss > 0 and room > 0 else 0

    def timed(self, drafted: int, seconds: float, verify_seconds: float | None) -> None:
        """Fold the step's seconds into the time factors: a target-only step's, or a drafting
        step's verify forward, into the target's; a drafting step's whole seconds into drafting's
        (not the catch-up step of a draft model). Nothing when the timings were not measured here."""
        drafting = drafted > 0
        caught_up, self._caught_up = self._caught_up, drafting
        if not self._learns or seconds <= 0:
            return
        if not drafting:
            self._fold(0, seconds / self._verify[1])
            return
        if verify_seconds:
            self._fold(0, verify_seconds / self._verify[drafted + 1])
        if caught_up or self._kind == "lookup":
            self._fold(1, seconds / self._seconds(drafted))

    def _fold(self, kind: int, ratio: float) -> None:
        self._log_ratio[kind] = TIME_FORGET * self._log_ratio[kind] + math.log(ratio)
        self._weight[kind] = TIME_FORGET * self._weight[kind] + 1.0

    def _who(self) -> str:
        return {"lookup": "lookup", "mapped": "mapped draft"}.get(self._kind, "draft")


class MatchedGoodput:
    """`goodput` for prompt lookup: one `GoodputPolicy` per matched suffix length, each with its
    own acceptance counts, pause and probes, chosen by the step's `evidence`.

    How long a suffix matched is what prompt lookup knows of its copy before proposing it, and it
    splits acceptance wide apart. The default chat's greedy replies (SmolLM2-135M-Instruct, 20
    prompts a set, 96 tokens; at every position, whether the copy's first token is the target's):
    after a 1-token match 16% (MT-Bench) and 17% (tinystories-retell), after 2 tokens 41% and 46%,
    after 3 tokens 80% and 89%, copies then running 4.4 and 5.3 tokens on average. One pooled
    acceptance drafts a 3-token match's copy as cautiously as a 1-token match's, and pauses both
    when 1-token matches are most of the proposals. A step where nothing matches drafts nothing and
    asks no policy; `pause` stays that of the last length matched (the chat's strip then changes
    only when a match of another length comes).

    Args:
        timings: As `GoodputPolicy`'s.
        ngram: The longest suffix prompt lookup matches, in tokens.
    """

    def __init__(self, timings: ForwardTimings, ngram: int) -> None:
        self._policies = [GoodputPolicy(timings, "lookup", matched) for matched in range(1, ngram + 1)]
        self._current: GoodputPolicy | None = None  # the step's (None: nothing matched)
        self._shown: GoodputPolicy | None = None  # the last length matched

    @property
    def pause(self) -> str | None:
        """The pause of the policy of the last match length met (None before any)."""
        return None if self._shown is None else self._shown.pause

    def limit(
        self,
        settings: DecodingSettings,
        room: int,
        evidence: int | None = None,
        context: int = MEASURE_CONTEXT,
    ) -> int:
        """The decision of the policy of the matched length `evidence` (0 when nothing matched)."""
        self._current = self._policies[evidence - 1] if evidence else None
        if self._current is None:
            return 0
        self._shown = self._current
        return self._current.limit(settings, room, context=context)

    def extend(self, q: torch.Tensor) -> Next:
        """Always DRAFT (a copy has no confidence to read)."""
        return Next.DRAFT

    def observe(self, drafted: int, accepted: int) -> None:
        """The verdict, to the policy of this step's match length."""
        if self._current is not None:
            self._current.observe(drafted, accepted)

    def timed(self, drafted: int, seconds: float, verify_seconds: float | None) -> None:
        """The step's seconds, to the policy of this step's match length."""
        if self._current is not None:
            self._current.timed(drafted, seconds, verify_seconds)

    def begin_reply(self) -> None:
        """Every match length's policy restarts its backoff (`GoodputPolicy.begin_reply`)."""
        for policy in self._policies:
            policy.begin_reply()


def make_policy(
    name: DraftPolicyName, timings: Callable[[], ForwardTimings], kind: str = "model", ngram: int = 0
) -> DraftPolicy:
    """A fresh policy of that name; `timings` is called only by `latency` and `goodput`
    (measurements may be slow); `kind` is what proposes, and `ngram` prompt lookup's longest
    matched suffix (`goodput` then keeps one policy a match length: `MatchedGoodput`)."""
    if name == "goodput":
        return (
            MatchedGoodput(timings(), ngram) if kind == "lookup" and ngram else GoodputPolicy(timings(), kind)
        )
    if name == "latency":
        return LatencyPolicy(timings())
    return HeuristicPolicy() if name == "heuristic" else FixedPolicy()
