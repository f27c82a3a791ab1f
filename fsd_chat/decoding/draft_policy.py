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

  c_d and V(w) are modelled once per loaded pair (`modelled_timings`; `ModelPair` keeps them, a
  decoder given none models its own) and can be injected (tests pass synthetic `ForwardTimings`). Sampling, verification and rollback are left out of the timings.

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

  The prices c_d and V(w) are modelled from the models' shapes and sizes (`modelled_timings`),
  never read from a clock: under a lossy rule an undrafted position is a target token, so a k
  that followed the machine's load would change the text from run to run. The policy's every
  decision is then a function of the acceptance counts alone, and a seed gives the same reply on
  any run. Only timings measured on the machine and handed in as such (`ForwardTimings.measured`,
  from `time_forwards`: an experiment, not the app) follow the steps' own seconds: two running factors scale them to what steps actually take: the target's
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

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from fsd_chat.decoding.kv_cache import CachedModel
from fsd_chat.decoding.packed_linear import PackedLinear, packed_bytes
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS, DecodingSettings, DraftPolicyName
from fsd_chat.decoding.timing import PhaseClock

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel

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

MEASURED_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 17, MAX_DRAFT_TOKENS + 1)
"""Verify widths (tokens) `time_forwards` times; other widths are linearly interpolated."""

MEASURE_CONTEXT = 64
"""Tokens of context the timed forwards attend to."""

MEASURE_REPEATS = 3
"""Timed passes over the widths (after one untimed pass); each time is their minimum (timing noise only adds)."""


@dataclass(frozen=True, slots=True)
class ForwardTimings:
    """How long drafting and verifying take on a device.

    Attributes:
        draft: Seconds of one draft position (a 1-token draft forward and its softmax).
        widths: Verify widths in tokens, increasing, from 1 to at least MAX_DRAFT_TOKENS + 1.
        verify: Seconds of a target forward over each of `widths` tokens.
        measured: Measured on this machine (`time_forwards`): `goodput` then scales these by the
            seconds its steps take. False for timings modelled (`modelled_timings`) or written by
            hand (tests), which are taken as they are.
        step: Seconds a drafting step spends beyond its forwards, against a target-only step's
            (the acceptance rule, the draft's draws, the rollback): what makes a small pair's
            speculation dearer than its forwards say.
        catch_up: Seconds a draft model's cache takes per token it missed while paused (the
            marginal token of a wide draft forward; 0 for prompt lookup, which keeps no cache).
        attention: Seconds a 1-token target forward adds per token of context beyond
            MEASURE_CONTEXT (the context `verify` was timed over).
        attention_width: Seconds each further token of a forward's width adds per token of
            context beyond MEASURE_CONTEXT: a verify reads the keys and values once per query.
        batch_attention: What the first token of a forward of several tokens adds per token of
            context beyond MEASURE_CONTEXT (None: `attention`): llama.cpp runs such forwards on
            threads of their own (`fsd_chat.support.threads`).
    """

    draft: float
    widths: tuple[int, ...]
    verify: tuple[float, ...]
    measured: bool = False
    step: float = 0.0
    catch_up: float = 0.0
    attention: float = 0.0
    attention_width: float = 0.0
    batch_attention: float | None = None

    def verify_table(self, context: int = MEASURE_CONTEXT) -> list[float]:
        """V(w) for w = 0..MAX_DRAFT_TOKENS + 1 in seconds, indexed by width (w = 0 unused: V(1)),
        over `context` tokens of context."""
        extra = max(context - MEASURE_CONTEXT, 0)
        batch = self.attention if self.batch_attention is None else self.batch_attention
        return [self.verify_seconds(1) + extra * self.attention] * 2 + [
            self.verify_seconds(w) + extra * (batch + (w - 1) * self.attention_width)
            for w in range(2, MAX_DRAFT_TOKENS + 2)
        ]

    def verify_seconds(self, width: int) -> float:
        """Seconds of a target forward over `width` tokens (linear between measured widths)."""
        i = bisect.bisect_left(self.widths, width)
        if i < len(self.widths) and self.widths[i] == width:
            return self.verify[i]
        i = min(max(i, 1), len(self.widths) - 1)
        (w0, w1), (v0, v1) = self.widths[i - 1 : i + 1], self.verify[i - 1 : i + 1]
        return v0 + (v1 - v0) * (width - w0) / (w1 - w0)


def time_forwards(target: PreTrainedModel, draft: PreTrainedModel | None, vocab_size: int) -> ForwardTimings:
    """Time the draft's 1-token forward and the target's forward at `MEASURED_WIDTHS` on their
    devices, over a `MEASURE_CONTEXT`-token context, with caches of their own (a decoder's caches
    are not touched). Takes (1 + MEASURE_REPEATS) × (len(MEASURED_WIDTHS) + 1) forward passes,
    all eager (a compiled draft's forward is faster than measured: `latency` then drafts less than
    it could). Without a draft model (prompt lookup) a draft position takes 0 seconds."""
    t_model = CachedModel(target, vocab_size)
    d_model = CachedModel(draft, vocab_size) if draft is not None else None
    longest = MEASURE_CONTEXT + MEASURED_WIDTHS[-1]
    t_seq = torch.arange(longest, device=t_model.device).remainder(vocab_size)[None]
    t_model.forward(t_seq, MEASURE_CONTEXT, keep=1)
    if d_model is not None:
        d_model.forward(t_seq.to(d_model.device), MEASURE_CONTEXT, keep=1)
    clock = PhaseClock(t_model.device)

    def verify(width: int) -> float:
        clock.lap()
        t_model.forward(t_seq, MEASURE_CONTEXT + width, keep=width)
        seconds = clock.lap()
        t_model.rollback(MEASURE_CONTEXT)
        return seconds

    def draft_position() -> float:
        if d_model is None:
            return 0.0
        clock.lap()
        d_model.forward(t_seq.to(d_model.device), MEASURE_CONTEXT + 1, keep=1).softmax(-1).max().item()
        seconds = clock.lap()
        d_model.rollback(MEASURE_CONTEXT)
        return seconds

    samples: list[list[float]] = [[] for _ in range(len(MEASURED_WIDTHS) + 1)]
    for repeat in range(1 + MEASURE_REPEATS):
        times = [verify(width) for width in MEASURED_WIDTHS] + [draft_position()]
        if repeat:  # pass 0 is untimed: first-call allocations and kernel selection
            for sample, seconds in zip(samples, times, strict=True):
                sample.append(seconds)
    fastest = [min(s) for s in samples]
    return ForwardTimings(
        draft=fastest[-1], widths=MEASURED_WIDTHS, verify=tuple(fastest[:-1]), measured=True
    )


FORWARD_SECONDS = 1.4e-4
"""`modelled_timings`: a forward's fixed host cost (seconds): Python, dispatch, the cache's
bookkeeping, the softmax and the read of its result. Fitted, with the six below, to the forwards
and steps of fixed-k decoding on this project's CPU (one thread, float32): SmolLM2-135M (30 layers,
134.5M parameters; before its weights were prepacked, whose rates `PACKED_BYTE_SECONDS` and the two
after it price: V(1) 36 ms, V(33) 140 ms) and the story pair (5 and 2 layers of width 64; its
layers are too small to pack).
Refit 2026-11-27 on the story pair (`time_forwards`, best of 5; one torch thread): target V(1)
0.74 ms, V(2) 0.87, V(6) 0.93, V(33) 1.30; draft (as a target) V(1) 0.38, V(2) 0.43, V(33) 0.62 ms:
0.12 ms a layer and 0.14 ms a forward (the model gives 0.77, 0.89, 0.94, 1.33 and 0.40, 0.45,
0.64 ms). The earlier 4e-4 priced a small model's forwards 1.4× too dear against its steps' own
work and its width too cheap: the story pair's V(6) at 1.14 V(1), measured 1.26. SmolLM2 barely
moves (V(1) 39.3 → 39.0 ms modelled)."""

LAYER_SECONDS = 1.1e-4
"""`modelled_timings`: seconds of one decoder layer's fixed cost per forward (its dozen operators'
dispatch, which dominates a small model)."""

TOKEN_LAYER_SECONDS = 1.6e-6
"""`modelled_timings`: seconds of one decoder layer's work per token beyond its weights (attention,
norms, activations): with the weights' multiply-adds, the slope of a narrow model's V(w) past w = 2
(story pair, 2026-11-27: 14 µs a token over 5 layers, 6 µs over 2)."""

BYTE_SECONDS = 6e-11
"""`modelled_timings`: seconds to read one byte of weights (about 16 GB/s): a forward over a few
tokens is bound by its weight read."""

WIDE_READ = 1.5
"""`modelled_timings`: how much dearer the weight read of a forward over 2 or more tokens is than a
1-token forward's: torch's CPU matrix-vector kernels read the weights faster than its
matrix-matrix ones. Measured with SmolLM2-135M in float32: V(1) 36–37 ms, V(4) 54–63 ms, V(6)
62–67 ms, so a lookup block of k must be accepted about half the time to pay."""

WIDE_LAYER_SECONDS = 1.5e-5
"""`modelled_timings`: seconds one decoder layer adds to a forward over 2 or more tokens (its causal
mask and multi-query attention path): a narrow model's V(2) is 17% dearer than its V(1), where its
per-token work and wider read make 6% (story pair, 2026-11-27: V(1) 0.74 ms, V(2) 0.87 ms; its
2-layer draft 0.38 and 0.43 ms: about 26 µs a layer either way, 15 µs at the fit's fixed cost)."""

TOKEN_SECONDS = 2.4e-11
"""`modelled_timings`: seconds of one weight's multiply-adds for one token (about 80 GFLOP/s): what
each more token of a verify width costs."""


STEP_SECONDS = 5.5e-4
"""`modelled_timings`: seconds a drafting step spends beyond its forwards (`ForwardTimings.step`),
against a target-only step. Fitted (2026-11-27, with the forwards above) to the story pair's
fixed-k steps in the bench, k = 1..5: 1.93, 2.34, 2.77, 3.21, 3.73 ms against a target-only step's
0.82 ms, i.e. T_k / V(1) 2.35, 2.85, 3.37, 3.92, 4.55; the model gives 2.39, 2.93, 3.46, 4.00, 4.53
(3.5e-4 gave 2.03 at k = 1: a k = 1 block looked 15% cheaper than it is)."""


PACKED_BYTE_SECONDS = 3.5e-11
"""`modelled_timings`: `BYTE_SECONDS` for a weight prepacked for oneDNN
(`fsd_chat.decoding.packed_linear`; about 28 GB/s). Fitted with the two below to SmolLM2-135M in
float32, packed, one thread (2026-11-27, `CachedModel`, best of 4): V(1) 23.3 ms, V(2) 25.2, V(3)
26.2, V(4) 26.5, V(6) 29.1 (the model gives 23.3, 25.2, 26.2, 27.2, 29.1)."""

PACKED_WIDE_READ = 1.02
"""`modelled_timings`: `WIDE_READ` for packed weights: oneDNN's layout for 2 rows reads the weights
as fast for 2 to 6 rows as for 1."""

PACKED_TOKEN_SECONDS = 6.9e-12
"""`modelled_timings`: `TOKEN_SECONDS` for packed weights: each more token of a verify width adds
about 1 ms to SmolLM2's forward (its multiply-adds overlap the weight read)."""


STEP_VOCAB_SECONDS = 1.0e-8
"""`modelled_timings`: seconds a drafting step spends beyond its forwards per entry of the target's
vocabulary (the laws, the rule and the verdict over it), on top of `STEP_SECONDS`. SmolLM2-135M
packed, prompt lookup, one thread, 2026-11-27 (median step against the same prompts' target-only
steps): k = 1 1.11–1.13 V(1), k = 2 1.17, k = 5 1.35 (at about 450 tokens of context), where the
forwards alone account for 1.08, 1.12 and 1.30: about 0.5 ms more a step over 49,152 entries."""

ATTENTION_SECONDS = 4.3e-10
"""`modelled_timings`: seconds a 1-token forward adds per token of context, per layer and per unit
of hidden width (`ForwardTimings.attention`). SmolLM2-135M (30 layers, 576 wide), packed, one
thread, `CachedModel` best of 5: V(1) 23.9 ms over 64 tokens of context, 26.8 over 400, 30.9 over
1,000 (8.8 and 7.5 µs a token)."""

ATTENTION_WIDTH_SECONDS = 8.7e-11
"""`modelled_timings`: what each further token of a forward's width adds to `ATTENTION_SECONDS`
(`ForwardTimings.attention_width`). Same measurement: over 1,000 tokens against 64, V(2) +11.4 ms,
V(4) +13.3, V(6) +17.0 (7.5 µs a token of context at width 1, 12–18 at widths 2–6), so the
verify of a long conversation is dearer against V(1) than over a short one: V(6)/V(1) 1.20 over
64 tokens, 1.48 over 1,000."""


def model_forward_seconds(model: PreTrainedModel, width: int) -> float:
    """The modelled seconds of `model`'s forward over `width` new tokens (`modelled_timings`): a
    fixed cost, per layer, per byte of weights read (`WIDE_READ` times dearer over 2 or more tokens),
    and per token (per weight and per layer), weights prepacked for oneDNN
    (`fsd_chat.decoding.packed_linear`) at their own prices (`PACKED_BYTE_SECONDS`...). The weights
    count every parameter but an input embedding that no output head reads (a gather reads `width`
    rows of it, not the whole table): the head is untied, or holds a packed copy of its own."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    head_weight = head.tied if isinstance(head, PackedLinear) else getattr(head, "weight", None)
    gathered = (
        embedding.weight
        if embedding is not None and (head_weight is not embedding.weight or isinstance(head, PackedLinear))
        else None
    )
    weights = [p for p in model.parameters() if p is not gathered]
    read = sum(p.numel() * p.element_size() for p in weights)
    count = sum(p.numel() for p in weights)
    packed = packed_bytes(model)
    layers = model.config.get_text_config().num_hidden_layers
    wide = width > 1
    per_token = count * TOKEN_SECONDS + packed / 4 * PACKED_TOKEN_SECONDS + layers * TOKEN_LAYER_SECONDS
    read_seconds = read * BYTE_SECONDS * (WIDE_READ if wide else 1.0) + packed * PACKED_BYTE_SECONDS * (
        PACKED_WIDE_READ if wide else 1.0
    )
    layer_seconds = layers * (LAYER_SECONDS + (WIDE_LAYER_SECONDS if wide else 0.0))
    return FORWARD_SECONDS + layer_seconds + read_seconds + width * per_token


def modelled_timings(target: PreTrainedModel, draft: PreTrainedModel | None) -> ForwardTimings:
    """The draft and verify forward times from the models alone (`model_forward_seconds`): the
    same on every run and under any load, so that the draft lengths `goodput` and `latency` choose,
    and with them the text a lossy rule writes, do not depend on a clock (an undrafted position is
    the target's token). Only ratios matter to the policies (they compare E_k / T_k with
    1 / V(1)), and those follow the models' shapes and sizes on any device; a draft position also
    pays its softmax over the vocabulary, included in its forward's head. Prompt lookup: 0 s."""
    config = target.config.get_text_config()
    attended = config.num_hidden_layers * config.hidden_size
    return timings_of(
        model_forward_seconds,
        target,
        draft,
        vocab=config.vocab_size,
        attention=attended * ATTENTION_SECONDS,
        attention_width=attended * ATTENTION_WIDTH_SECONDS,
    )


M = TypeVar("M")


def timings_of(
    forward_seconds: Callable[[M, int], float],
    target: M,
    draft: M | None,
    *,
    vocab: int,
    attention: float,
    attention_width: float,
    batch_attention: float | None = None,
) -> ForwardTimings:
    """Modelled `ForwardTimings` of an engine's models from its `forward_seconds(model, width)`
    (`modelled_timings` for transformers models; `fsd_chat.engines.llama_cpp.modelled_timings`):
    the verify widths, a draft position (0 s without a draft model: prompt lookup), the marginal
    token of a draft's catch-up, a step's work over a vocabulary of `vocab` ids, and the attention
    terms (seconds per token of context, see `ForwardTimings`)."""
    verify = tuple(forward_seconds(target, width) for width in MEASURED_WIDTHS)
    draft_seconds = 0.0 if draft is None else forward_seconds(draft, 1)
    # The marginal token of a wide forward (past the 1-token forward's cheaper read).
    catch_up = 0.0 if draft is None else forward_seconds(draft, 3) - forward_seconds(draft, 2)
    return ForwardTimings(
        draft=draft_seconds,
        widths=MEASURED_WIDTHS,
        verify=verify,
        measured=False,
        step=STEP_SECONDS + vocab * STEP_VOCAB_SECONDS,
        catch_up=catch_up,
        attention=attention,
        attention_width=attention_width,
        batch_attention=batch_attention,
    )


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


class GoodputPolicy(FixedPolicy):
    """Each step's k in 0..settings.draft_tokens with the most expected tokens per second, from the
    measured acceptance and the forward timings scaled by the steps' own seconds; k = 0 is a
    target-only step (module docstring).

    Args:
        timings: The device's draft and verify forward times (scaled by measured step times only
            when `timings.measured`).
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
        self._learns = timings.measured
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
