"""A whole decoding step as tensor operations over static buffers: what a CUDA graph captures.

A speculative step (a draft model sharing the target's vocabulary) is k draft forward passes, the
target's verify over k + 1 tokens, the acceptance rule (`acceptance.decide`: every rule and
divergence, greedy or sampled, top-k, top-p and min-p), the correction or bonus token, and the
position moving on; a target-only step is one forward pass and one draw. Here each is one function
of device tensors that reads nothing back to the host and writes no Python value into a tensor, so
that on CUDA it is captured once as a `torch.cuda.CUDAGraph` and replayed (`CapturedSteps`), and on
the CPU the same function runs eagerly (`EagerSteps`).

**Buffers** (`StepInputs`), written in place, their addresses fixed:

- `seq` [1, capacity] int64: the reply's tokens; a step writes its draft tokens and the target's
  token at device indices.
- `position` [1] int64: the index of the last emitted token, which no cache holds yet (the
  target's cache holds `position` tokens). A step feeds it and moves it on by n + 1.
- `rule`, `divergence` (0-dim int64, indices in `settings.RULES` and
  `divergence.DIVERGENCE_NAMES`), `threshold` (0-dim float32) and `sampling` (`SamplingTensors`):
  moving the dial or changing the rule writes them, and never captures again.
- The draws (`Draws`): every random number a step uses, drawn at its start from one generator, so
  that the rest of the step is a pure function of its inputs (which torch.compile can take).

**Output**: `decide`'s float64 block (flags of non-finite laws, n, the target's token, then per
draft position its token, draft-exact flag, divergence and cost; `acceptance.read_verdict` reads
it), or for a target-only step [check, token] (`target_step`). The host copies it once per step; on CUDA
the graph's output memory is overwritten by the next replay, so the copy happens first.

**One step in flight** (CUDA: `CapturedSteps.ahead`). A step reads its inputs from device buffers
that the step before wrote (the tokens in `seq`, the position, the caches' slots), so
step t + 1 can be launched before the host has read step t: launching a step is a graph replay,
then an asynchronous copy of its block into one of two pinned host buffers, taken in turn, and an
event recorded after it (`Launched`); reading it waits on that event. The decoders launch step
t + 1, then read step t, so that the replay's launch and the host's work on step t (the verdict,
detokenisation, the UI) overlap the GPU's step t + 1, as vLLM's async scheduling
(`AsyncGPUModelRunnerOutput`: a non-blocking copy to pinned memory and an event) and SGLang's
overlap scheduler (the next batch's input ids resolved on the device from the last batch's
"future" tokens) do. The buffer a block arrives in is written again two launches later, and the
host reads step t before it launches step t + 2. What follows from it
(`fsd_chat.decoding.whole_step.room_ahead`):

- The settings (the dial, the rule) and the draft policy's k act from the next launched step: the
  step after a changed setting was launched already, with the old one, and the policy chooses k
  for step t + 1 before it observes step t.
- A step is launched ahead only where the room it is given cannot bind (the room left whatever
  step t emits is at least the longest draft length, so k is what the synchronous path would
  choose): the token limit and the context window are never overshot, and the last steps of a
  reply run one at a time.
- End of text (EOS, a stop string), a stop request and non-finite logits end the reply at step t:
  step t + 1, already launched, is discarded. It wrote only past what the caches and the token
  buffer are known to hold (`CachedModel.seen`, the reply's length), which the next reply
  overwrites, so the text is the synchronous path's.
- Prompt lookup is not launched ahead: its copy is found on the host, in the tokens step t emits.

On the CPU there is no queue to overlap: a step runs when it is called (`EagerSteps.ahead` is
False), and the decoders read each step before they launch the next, as before.

**Caches.** Both models run over static caches (`kv_cache.StaticModel`) whose layers write a
pass's keys and values at the positions it is given (`kv_cache.PositionedLayer`), so rolling back
is nothing: the next pass writes over the rejected slots. A step computes its positions once
and one attention mask over them for all its passes (`StaticModel.attention_mask`). The
draft's first pass of a step is two tokens wide (positions position − 1 and position, re-feeding
a slot whose keys it may already hold): after a fully accepted block the draft lacks the last
draft token, after a rejection it does not, and a fixed width serves both without a host branch
(vLLM's and SGLang's draft graphs handle the same case by padding). A draft that fell further
behind (target-only steps while the policy paused it) is caught up eagerly before the step.

**Prefill** runs eagerly (`reply.read_prompt` over the same caches), outside any graph: a new
prompt length never compiles or captures anything.

Sources: gpt-fast (`generate.py`: static KV cache, compiled decode step, `multinomial_sample_one_no_sync`),
vLLM (`vllm/v1/worker/gpu/cudagraph_utils.py`, `vllm/compilation/cuda_graph.py`: warm-up, capture
into a shared memory pool, replay with inputs written into static buffers), SGLang
(`eagle_draft_cuda_graph_runner.py`: the whole k-step draft loop in one graph), and PyTorch's CUDA
graph notes (graph-safe RNG: `CUDAGraph.register_generator_state`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from fsd_chat.decoding.acceptance import compile_failure, decide, verdict_flags
from fsd_chat.decoding.divergence import DIVERGENCE_NAMES, DivergenceName
from fsd_chat.decoding.reply import Reply
from fsd_chat.decoding.sampling import (
    SamplingTensors,
    argmax,
    draw,
    exponential_noise,
    probabilities,
)
from fsd_chat.decoding.settings import (
    RULES,
    DecodingSettings,
    Rule,
    SamplingConfig,
)
from fsd_chat.engines.torch_engine import compile_cache
from fsd_chat.engines.torch_engine.kv_cache import RECOMPILE_LIMIT, CachedModel, StaticModel
from fsd_chat.engines.torch_engine.regions import mark_layer_regions

GRAPH_DRAFT_LENGTHS = (1, 2, 4, 6)
"""Draft lengths captured on CUDA, one graph each (greedy and sampled): the draft policy's k is
rounded down to one of them. A graph a k, rather than one of the longest k with the unused
positions masked, because a step costs its k draft passes and its k + 1 verify width whatever
the mask; four covers the lengths the goodput policy picks on the story and SmolLM2 pairs."""
MIN_CAPACITY = 64
"""Smallest static cache of the eager path, in tokens: it grows by doubling to what a reply needs
(`EagerSteps.fit`); an eager pass attends over the slots the reply reaches (`EagerSteps._eager`)."""
WARMUP_CALLS = 2
"""Eager calls of a step before its capture, on the capture stream (gpt-fast, vLLM): lazy
initialisations (cuBLAS workspaces, autotuning) must not happen inside a capture."""


@dataclass(slots=True)
class StepInputs:
    """The input buffers of a step (module docstring), on the models' device.

    The settings are device values (`on_device`: what a captured graph reads, written in place
    between replays) or Python values, which the eager path passes as they are: `judge` then
    computes the chosen rule alone, not every rule to select one on the device, and skips the
    truncations that `SamplingConfig` does not ask for. One step function serves both.

    Attributes:
        seq: [1, capacity] int64, the token buffer.
        position: [1] int64, the index of the last emitted token, not yet fed.
        source: [1] int64, where prompt lookup's copy starts (written by the host before a step).
        rule: The acceptance rule, or its index in RULES (0-dim int64).
        divergence: The divergence, or its index in DIVERGENCE_NAMES (0-dim int64).
        threshold: T, or T as a 0-dim float32.
        sampling: Temperature, top-k, top-p and min-p: the config, or its values (`SamplingTensors`).
        truncating: Whether the reply's sampling truncates (top-k, top-p or min-p), on the host:
            which greedy graph a step replays (`for_step`).
    """

    seq: torch.Tensor
    position: torch.Tensor
    source: torch.Tensor
    rule: Rule | torch.Tensor
    divergence: DivergenceName | torch.Tensor
    threshold: float | torch.Tensor
    sampling: SamplingConfig | SamplingTensors
    truncating: bool = False

    @classmethod
    def allocate(cls, capacity: int, device: torch.device, *, on_device: bool) -> StepInputs:
        """Buffers for sequences of up to `capacity` tokens, the settings on the device or not."""
        if not on_device:
            position = torch.zeros(1, dtype=torch.long, device=device)
            seq, source = position.new_zeros((1, capacity)), position.clone()
            return cls(seq, position, source, "exact", "kl", 0.0, SamplingConfig())
        zero = torch.zeros((), dtype=torch.long, device=device)
        return cls(
            seq=torch.zeros((1, capacity), dtype=torch.long, device=device),
            position=torch.zeros(1, dtype=torch.long, device=device),
            source=torch.zeros(1, dtype=torch.long, device=device),
            rule=zero.clone(),
            divergence=zero.clone(),
            threshold=torch.zeros((), device=device),
            sampling=SamplingTensors.allocate(device),
        )

    def write(self, settings: DecodingSettings, rule: Rule | None = None) -> None:
        """The dial and the rule (`rule`, else settings.rule), before a step: in place on the
        device (a kernel each on a GPU, with the values as its arguments: no host-to-device copy,
        no synchronisation)."""
        rule = rule or settings.rule
        if isinstance(self.rule, torch.Tensor):
            assert isinstance(self.divergence, torch.Tensor) and isinstance(self.threshold, torch.Tensor)
            self.rule.fill_(RULES.index(rule))
            self.divergence.fill_(DIVERGENCE_NAMES.index(settings.divergence))
            self.threshold.fill_(settings.threshold)
        else:
            self.rule, self.divergence, self.threshold = rule, settings.divergence, settings.threshold

    def write_sampling(self, config: SamplingConfig) -> None:
        """A reply's sampling settings."""
        self.truncating = config.truncates
        if isinstance(self.sampling, SamplingTensors):
            self.sampling.write(config)
        else:
            self.sampling = config

    def for_step(self, greedy: bool, truncating: bool) -> StepInputs:
        """The inputs a step of this kind reads. A greedy step of a reply that does not truncate
        takes its laws at temperature 1 and untruncated, as Python values, whatever the device
        values hold: no sort (top-k's rank, top-p's cumulative sums), no noise; it needs no more
        (the argmax, the regret and the divergences of untruncated laws). Any other step reads the
        inputs as they are: greedy with a truncation (which can remove a draft token a relaxed rule
        would accept) sorts as a sampled step does."""
        if greedy and not truncating and isinstance(self.sampling, SamplingTensors):
            return replace(self, sampling=_GREEDY)
        return self

    @property
    def truncates(self) -> bool:
        """Whether the laws the divergences compare differ from the sampled ones: always for
        device values (any may truncate), else as the config says."""
        return isinstance(self.sampling, SamplingTensors) or self.sampling.truncates


@dataclass(frozen=True, slots=True)
class Draws:
    """Every random number of a sampled step, drawn at its start (greedy steps draw none).

    Attributes:
        draft: The draft positions' exponential races, [k, vocab] (`sampling.draw`).
        uniforms: The exact test's u_i, [k].
        noise: The correction's (or the bonus token's) races, [k + 1, vocab].
    """

    draft: torch.Tensor
    uniforms: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def make(
        cls, k: int, vocab: int, generator: torch.Generator, device: torch.device, drafted: bool = True
    ) -> Draws:
        """Draws for a step of draft length k (k = 0: a target-only step, one race) over `vocab`;
        `drafted` False: a copy, no draft draws."""
        draft = exponential_noise(torch.empty((k if drafted else 0, vocab), device=device), generator)
        uniforms = torch.rand(k, generator=generator, device=device)
        noise = exponential_noise(torch.empty((k + 1, vocab), device=device), generator)
        return cls(draft, uniforms, noise)


def static_forward(
    model: StaticModel, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """One forward pass over `ids` at device `positions` (`StaticModel.run`: its keys and values
    written there, which is the rollback), its logits cut to the vocabulary.

    Args:
        model: The model over its static cache.
        ids: [1, w] int64.
        positions: [w] int64 (`StaticModel.run`).
        mask: Its attention mask ([1, 1, w, capacity]), when the step built it for all its passes.

    Returns:
        Logits [w, vocab_size] float32.
    """
    return model.run(ids, positions, mask)[:, : model.vocab_size].float()


def speculative_step(
    target: StaticModel,
    draft: StaticModel | None,
    inputs: StepInputs,
    k: int,
    greedy: bool,
    draws: Draws | None,
    parts: StepParts | None = None,
) -> torch.Tensor:
    """One speculative step on the device (module docstring): a draft model of the target's
    vocabulary proposes, or, with no draft, prompt lookup's copy of seq[0, source : source + k]
    (`StepInputs.source`, found on the host: `lookup.find_continuation`), whose laws are point
    masses.

    Precondition: the target's cache holds seq[0, :position], the draft's at least
    seq[0, :position − 1]; a copy's source ends at or before position + 1. Afterwards position has
    moved on by n + 1, seq holds the n accepted draft tokens and the target's token after the old
    position, the target's cache holds seq[0, :position], the draft's seq[0, :old position + 1 +
    min(n, k − 1)].

    Args:
        target, draft: The models over their static caches (draft None: a copy).
        inputs: The buffers.
        k: Draft length, ≥ 1 (one graph each).
        greedy: Argmax draws and tests (one graph each); else `draws` are used.
        draws: The step's random numbers (None when greedy).
        parts: The functions the step is made of, compiled (`compiled_step_functions`) or not
            (None: `EAGER_PARTS`).

    Returns:
        `acceptance.decide`'s block, shape [6k + 3] float64 ([5k + 3] for a copy).
    """
    parts = parts or EAGER_PARTS
    seq = inputs.seq[0]
    # The laws the divergences compare, made once a step for every position's.
    untruncated = inputs.sampling.untruncated() if inputs.truncates else None
    span, mask = parts.start(target, inputs, k, draft is None)
    q_rows: list[torch.Tensor] = []
    q_full_rows: list[torch.Tensor] = []
    if draft is not None:
        shared = parts.share_mask and draft.capacity == target.capacity and draft.dtype == target.dtype
        _draft_positions(
            draft, inputs, k, draws, untruncated, span, mask if shared else None, q_rows, q_full_rows, parts
        )
        mask = mask[:, :, 1:]
    verified = span[1 : k + 2]
    fed = seq.index_select(0, verified)
    logits = parts.forward(target, fed.view(1, k + 1), verified, mask)
    return parts.verdict(
        logits,
        torch.cat(q_rows) if q_rows else None,
        torch.cat(q_full_rows) if q_full_rows else None,
        fed,
        span,
        inputs,
        untruncated,
        k,
        greedy,
        draws,
    )


def _start(target: StaticModel, inputs: StepInputs, k: int, copy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position a speculative step feeds or writes, computed once, and one attention mask
    for all its passes: (span [k + 3] int64, mask [1, 1, rows, capacity]). The draft's first pass
    is at span[0:2] (position − 1 and position; at position 0, position twice: the same token
    written twice at one slot), its i-th at span[i + 1], the target's verify at span[1 : k + 2],
    and the target's token at span[2:][n] (position + 1 + n). A copy (`copy`) feeds no position
    before `position`: its mask's rows are the verify's, and its tokens, seq[source : source + k]
    (a row of seq's windows of k tokens), are written after position here."""
    seq, position = inputs.seq[0], inputs.position
    span = position + torch.arange(-1, k + 2, device=position.device)
    if copy:
        verified = span[1 : k + 2]
        seq.index_copy_(0, verified[1:], seq.unfold(0, k, 1).index_select(0, inputs.source).view(k))
        return span, target.attention_mask(verified)
    span = span.clamp_min(0)
    return span, target.attention_mask(span[: k + 2])


def _verdict(
    logits: torch.Tensor,
    q: torch.Tensor | None,
    q_full: torch.Tensor | None,
    fed: torch.Tensor,
    span: torch.Tensor,
    inputs: StepInputs,
    untruncated: SamplingConfig | SamplingTensors | None,
    k: int,
    greedy: bool,
    draws: Draws | None,
) -> torch.Tensor:
    """The verify's laws, the rule (`acceptance.decide`) and its outcome written: the target's
    token after the n accepted draft tokens, the position moved on by n + 1. `logits`: the
    target's over the k + 1 tokens `fed` ([k + 1] int64: the last emitted token and the k draft
    tokens), [k + 1, vocab]; `q`, `q_full`: the draft's laws, [k, vocab] (None for a copy);
    `untruncated`: the sampling of the laws the divergences compare, when the step truncates;
    returns `decide`'s block."""
    seq, position = inputs.seq[0], inputs.position
    block, next_token = decide(
        probabilities(logits, inputs.sampling),
        q,
        fed[1:],
        None if draws is None else draws.uniforms,
        None if draws is None else draws.noise,
        rule=inputs.rule,
        divergence_name=inputs.divergence,
        threshold=inputs.threshold,
        greedy=greedy,
        p_full=None if untruncated is None else probabilities(logits[:k], untruncated),
        q_full=q_full,
    )
    # n follows the flags: of p's k + 1 rows, and of q's k rows for a draft model.
    after = span[2:].index_select(0, block.narrow(0, verdict_flags(k, q is None), 1).long())
    seq.index_copy_(0, after, next_token)
    position.copy_(after)
    return block


def _draft_positions(
    draft: StaticModel,
    inputs: StepInputs,
    k: int,
    draws: Draws | None,
    untruncated: SamplingConfig | SamplingTensors | None,
    span: torch.Tensor,
    mask: torch.Tensor | None,
    q_rows: list[torch.Tensor],
    q_full_rows: list[torch.Tensor],
    parts: StepParts,
) -> None:
    """The draft model's k positions: x̃_i ~ q_i written at seq[span[i + 2]] (position + 1 + i),
    q_i (and the untruncated law, when the step truncates) appended to the lists. `mask`: the
    step's mask over `span`, when the draft's cache has the target's shape (else each pass builds
    its own)."""
    seq = inputs.seq[0]
    # The draft's first pass: two tokens, so that its width does not depend on the last step's n;
    # its second row is the position's (`span`).
    first = span[:2]
    ids = seq.index_select(0, first).view(1, 2)
    row = parts.forward(draft, ids, first, None if mask is None else mask[:, :, :2])[1:]
    for i in range(k):
        if i:
            at = span[i + 1 : i + 2]
            row = parts.forward(draft, ids, at, None if mask is None else mask[:, :, i + 1 : i + 2])
        q, q_full, token = parts.draft_token(
            row, inputs, untruncated, None if draws is None else draws.draft[i]
        )
        q_rows.append(q)
        if q_full is not None:
            q_full_rows.append(q_full)
        seq.index_copy_(0, span[i + 2 : i + 3], token)
        ids = token.view(1, 1)


def _draft_token(
    row: torch.Tensor,
    inputs: StepInputs,
    untruncated: SamplingConfig | SamplingTensors | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A draft position's law q ([1, vocab]), its law under `untruncated` when the step truncates
    (else None), and its token, [1] int64: q's argmax, or the race against `noise` ([vocab] Exp(1)
    draws) when sampled."""
    q = probabilities(row, inputs.sampling)
    q_full = None if untruncated is None else probabilities(row, untruncated)
    token = q.argmax(-1) if noise is None else (q / noise).argmax(-1)
    return q, q_full, token


def target_step(target: StaticModel, inputs: StepInputs, greedy: bool, draws: Draws | None) -> torch.Tensor:
    """One target-only step on the device: feed seq[position], write the drawn token after it,
    move position on by one.

    A greedy step reads the token off the logits and computes no law (issue 45 item 3: no
    softmax, sort or noise): the softmax and every truncation (top-k, top-p, min-p) keep the
    largest logit, so its argmax is the law's, bar logits so close that the softmax rounds their
    probabilities equal (`sampling.GREEDY_MARGIN`), where the law's argmax would take the first.

    Returns:
        [check, token], float64. The check is not finite exactly when the law would not be (the
        host tests it, `whole_step.whole_target_step`): a greedy step's largest logit (NaN with a NaN, +inf
        with a +inf, -inf when all are -inf: the rows `sampling.non_finite` flags), a sampled
        step's total probability (NaN or finite).
    """
    seq, position = inputs.seq[0], inputs.position
    logits = static_forward(target, seq.index_select(0, position).view(1, 1), position)
    if greedy:
        token = argmax(logits)
        check = logits.gather(-1, token.view(1, 1)).view(1)
    else:
        probs = probabilities(logits, inputs.sampling)
        check, token = probs.sum(-1), draw(probs, _SAMPLED, None, None if draws is None else draws.noise)
    seq[1:].index_copy_(0, position, token)  # at position + 1
    position.add_(1)
    return torch.cat([check.double(), token])


_GREEDY, _SAMPLED = SamplingConfig(), SamplingConfig(temperature=1.0)
"""A greedy untruncated step's laws (`StepInputs.for_step`), and what `draw` is told of a sampled
step (the temperature is already applied)."""


@dataclass(frozen=True, slots=True)
class StepParts:
    """The functions a speculative step is made of (`speculative_step`), each compiled on its own
    (`compiled_step_functions`) or not (`EAGER_PARTS`).

    Attributes:
        start: The step's positions and mask, and a copy's tokens (`_start`).
        forward: One forward pass of either model (`static_forward`).
        draft_token: A draft position's laws and token (`_draft_token`).
        verdict: The verify's laws, the rule and its outcome (`_verdict`).
        share_mask: Whether the draft's passes take their rows of the step's mask (eager: two
            operators a pass fewer) rather than build their own in their forward (compiled: a
            row of the step's mask has strides that follow k, and the draft's forward would be
            compiled again for every k).
    """

    start: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    forward: Callable[..., torch.Tensor]
    draft_token: Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]
    verdict: Callable[..., torch.Tensor]
    share_mask: bool


EAGER_PARTS = StepParts(_start, static_forward, _draft_token, _verdict, share_mask=True)

StepFunctions = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]
"""(speculative_step, target_step), or their compiled forms."""

EAGER_FUNCTIONS: StepFunctions = (speculative_step, target_step)


def compiled_step_functions(target: StaticModel, draft: StaticModel | None) -> StepFunctions:
    """`speculative_step` and `target_step` compiled by inductor, static shapes (a captured graph
    fixes the shapes anyway), no CUDA graphs of their own (`CapturedSteps` captures the step), and
    each decoder layer of both models one nested compile region (`regions`): a layer is compiled
    once whatever the depth.

    A target-only step is compiled whole (`fullgraph`). A speculative step is compiled in its parts
    (`StepParts`), each whole, joined by a few eager operators (the verify's and each draft
    position's gathers and writes) that a CUDA graph captures with the rest: a model's forward pass
    is compiled once a width (the draft's 1 and 2 tokens, the target's verify of k + 1) and serves
    every draft length and every kind of step (greedy, sampled), where a whole step compiled
    per (k, kind) traced its k draft passes and its verify again in each of those graphs. On this
    CPU the story pair's greedy and sampled graphs (target-only and k 1, 2, 4, 6) compile in 286
    CPU seconds from an empty cache instead of 492, in 34 instead of 85 over a filled one, and a
    k costs about the same as the next (docs/benchmarks.md, "Compile seconds against k").

    Compiled lazily: the first call of each shape compiles."""
    for model in (target, draft):
        if model is not None:
            mark_layer_regions(model.model)
    # One graph per model and width, per (k, kind): more than dynamo's default limit of 8 a function.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    def whole(function: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(function, fullgraph=True, dynamic=False)

    parts = StepParts(
        whole(_start), whole(static_forward), whole(_draft_token), whole(_verdict), share_mask=False
    )
    return functools.partial(speculative_step, parts=parts), whole(target_step)


@dataclass(frozen=True, slots=True)
class Launched:
    """A launched step (module docstring, "One step in flight"): its block on its way to the host.

    Attributes:
        block: The host tensor the block arrives in, 1-D float64; valid from `read` until the
            launch after next writes into it again.
        done: The event recorded after the copy into `block` (None: the block is there already,
            the eager path).
    """

    block: torch.Tensor
    done: torch.cuda.Event | None = None

    def read(self) -> torch.Tensor:
        """The block, once its copy has arrived (the one wait of a step on CUDA)."""
        if self.done is not None:
            self.done.synchronize()
        return self.block


def copy_to_host(out: torch.Tensor, host: torch.Tensor, done: torch.cuda.Event) -> None:
    """Queue the copy of a replay's output into a pinned host buffer, and record `done` after it:
    asynchronous, so that the host may launch the next step before it waits on `done`."""
    host.copy_(out, non_blocking=True)
    done.record()


class EagerSteps:
    """The step functions run eagerly, each call's output read at once (the CPU's path).

    Args:
        target: The target over its static cache.
        draft: The draft over its static cache (None: target-only decoding).
        emulate_replay: Hand each output back in a buffer that the next call overwrites with NaN,
            as a CUDA graph's next replay does (a test's check that nothing keeps an output).
        device_inputs: The settings as device values, as the captured graphs read them (the
            CPU tests' way to run that path; `StepInputs`).
        lookup: With no draft, speculative steps verify prompt lookup's copies.
        compile: Run the step functions compiled (`compiled_step_functions`; a compilation that
            fails runs them eagerly from then on, and `compile_error` says why).
    """

    captured = False
    ahead = False
    """Whether a decoder launches the next step before it reads this one (module docstring, "One
    step in flight"): only where steps queue on a device (`CapturedSteps`)."""
    lengths: tuple[int, ...] | None = None
    """Draft lengths available (None: any)."""
    compile_error: str | None = None
    """Why the step functions run uncompiled although compiling was asked for (`CapturedSteps`)."""

    def __init__(
        self,
        target: StaticModel,
        draft: StaticModel | None,
        *,
        emulate_replay: bool = False,
        device_inputs: bool = False,
        lookup: bool = False,
        compile: bool = False,
    ) -> None:
        self.target = target
        self.draft = draft
        self.lookup = lookup
        self.inputs = StepInputs.allocate(1, target.device, on_device=device_inputs)
        self._emulate = emulate_replay
        self._last: torch.Tensor | None = None
        self._reply: Reply | None = None
        self._functions = compiled_step_functions(target, draft) if compile else EAGER_FUNCTIONS

    def prepare(self, tokens: int) -> torch.Tensor | None:
        """See `WholeStep.prepare`: the caches fitted to `tokens` (`fit`), and a captured step's
        buffer returned for the reply to decode in (None: the reply has its own). That buffer is
        about to be overwritten by the new prompt, so the models' record of what they were fed
        (`CachedModel.fed`, which prefix reuse compares) becomes a copy of it (one device copy a
        reply)."""
        self.fit(tokens)
        if not self.captured:
            return None
        seq = self.inputs.seq
        kept = seq.clone()
        for model in (self.target, self.draft):
            if model is not None and model.fed is seq:
                model.fed = kept
        return seq

    def start(self, reply: Reply, sampling: SamplingConfig, generator: torch.Generator) -> torch.Generator:
        """See `WholeStep.start`: the buffer bound, the position at the reply's last prompt token,
        the sampling values written; the generator of its draws (`reseed`)."""
        self.bind(reply)
        self.inputs.position.fill_(reply.length - 1)
        self.inputs.write_sampling(sampling)
        return self.reseed(sampling, generator)

    def write(self, settings: DecodingSettings, rule: Rule, source: int) -> None:
        """See `WholeStep.write`: into the step's inputs (`StepInputs.write`; `source` only with
        prompt lookup, a kernel with the value as its argument: no copy)."""
        self.inputs.write(settings, rule)
        if self.lookup:
            self.inputs.source.fill_(source)

    def clear(self) -> None:
        """Empty and zero the caches (`StaticModel.clear`), after a step gave non-finite logits."""
        for model in (self.target, self.draft):
            if model is not None:
                model.clear()

    def bind(self, reply: Reply) -> None:
        """Run the steps over `reply`'s buffer (eagerly, any tensor will do); its length bounds
        the slots an eager step attends over (`_call`)."""
        self.inputs.seq = reply.seq
        self._reply = reply

    def fit(self, tokens: int) -> None:
        """Grow the caches to hold `tokens` (doubling from MIN_CAPACITY; never shrinking, which
        would drop what prefix reuse keeps)."""
        for model in (self.target, self.draft):
            if model is not None and model.capacity < tokens:
                capacity = max(MIN_CAPACITY, model.capacity)
                while capacity < tokens:
                    capacity *= 2
                model.resize(capacity)

    def reseed(self, sampling: SamplingConfig, generator: torch.Generator) -> torch.Generator:
        """The generator of a reply's draws: the reply's own (`reply.begin` seeded it)."""
        return generator

    @torch.inference_mode()
    def speculative(self, k: int, greedy: bool, generator: torch.Generator) -> Launched:
        """One speculative step; its block (`speculative_step`)."""
        assert self.draft is not None or self.lookup
        draws = (
            None
            if greedy
            else Draws.make(k, self.target.vocab_size, generator, self.target.device, self.draft is not None)
        )
        inputs = self.inputs.for_step(greedy, self.inputs.truncating)
        return Launched(self._out(self._call(0, k, self.target, self.draft, inputs, k, greedy, draws)))

    @torch.inference_mode()
    def target_only(self, greedy: bool, generator: torch.Generator) -> Launched:
        """One target-only step; its block (`target_step`)."""
        draws = None if greedy else Draws.make(0, self.target.vocab_size, generator, self.target.device)
        inputs = self.inputs.for_step(greedy, self.inputs.truncating)
        return Launched(self._out(self._call(1, 0, self.target, inputs, greedy, draws)))

    def _call(self, which: int, k: int, *args: Any) -> torch.Tensor:
        """Step function `which` (0 speculative, 1 target-only) of draft length k (0:
        target-only); eagerly from the first failed compilation on."""
        try:
            if self._functions is EAGER_FUNCTIONS:
                return self._eager(which, k, *args)
            return self._functions[which](*args)
        except Exception as exc:  # compilation failures come in many types; fall back to eager
            if self._functions is EAGER_FUNCTIONS:
                raise
            self.compile_error = compile_failure(exc)
            self._functions = EAGER_FUNCTIONS
            return self._eager(which, k, *args)

    def _eager(self, which: int, k: int, *args: Any) -> torch.Tensor:
        """Step function `which` run eagerly, its passes attending over the slots the step can
        reach only (`StaticModel.attending`): the reply's length + k (the step feeds positions
        up to length − 1 + k; its mask and its caches' writes lie below), where the whole
        capacity would be up to twice the reply and more early in it. A compiled or captured
        step attends over the whole capacity (its shapes are fixed)."""
        window = None if self._reply is None else self._reply.length + k
        # A target-only step feeds position length − 1 alone: no mask to apply.
        with self.target.attending(window, last=which == 1):
            if self.draft is None:  # no ExitStack a step where one model attends (~10 µs)
                return EAGER_FUNCTIONS[which](*args)
            with self.draft.attending(window, last=which == 1):
                return EAGER_FUNCTIONS[which](*args)

    def _out(self, block: torch.Tensor) -> torch.Tensor:
        if not self._emulate:
            return block
        if self._last is not None:
            self._last.fill_(float("nan"))
        self._last = block.clone()
        return self._last


class CapturedSteps(EagerSteps):
    """The step functions captured as CUDA graphs at load time and replayed (module docstring).

    One graph per (k, kind) for k in `lengths` and k = 0 (target-only), the kinds being sampled,
    greedy, and greedy with a truncation (`StepInputs.for_step`: only that greedy graph sorts; a
    greedy target-only step reads its token off the logits whatever the truncation, so it has one
    graph, `_key`), in one memory pool (`torch.cuda.graph_pool_handle`): the graphs never run at once, so they share their
    intermediates, as vLLM's and SGLang's do. Each is warmed up (WARMUP_CALLS eager calls on the
    capture stream) and captured on that stream. Replay is `CUDAGraph.replay`, with no guards:
    inputs are written into `StepInputs` between replays. The draws come from one CUDA generator
    registered with every graph (`CUDAGraph.register_generator_state`: each replay advances its
    Philox offset, and `reseed` seeds it for a reply). The output goes to one of two pinned host
    buffers, in turn, by one asynchronous copy with an event recorded after it (`Launched`), and
    the host waits once, on that event, when it reads the step: a decoder launches the next step
    first (`ahead`; module docstring, "One step in flight"), except with prompt lookup.

    With `compile` the step functions are compiled first (`compiled_step_functions`: inductor,
    static shapes, a target-only step whole and a speculative step in its parts, each decoder
    layer a nested compile region compiled once; no CUDA graphs of their own: the capture here is
    the graph), fusing each layer's elementwise work and the rule's small operators; a failed
    compilation captures the eager functions and `compile_error` says why.
    torch's compile artifacts are loaded from the user's cache before and kept there after
    (`compile_cache`, keyed by the models, the versions and the device), so that a second start
    of the same pair compiles as little as torch allows.

    Args:
        target, draft: The models, over static caches whose addresses stay fixed from now on (no
            `fit`: `capacity` is theirs).
        lengths: The draft lengths to capture (each ≤ MAX_DRAFT_TOKENS).
        compile: Compile the step functions before capturing them.
        progress: Called with (graphs captured, graphs in all) while capturing (the loading screen).
        greedy: Which kinds of steps to capture: greedy (True), sampled (False), or both (a
            reply of the other kind then fails; tests that time one kind's compilation).
        lookup: With no draft, capture the verification of prompt lookup's copies (one graph
            per copy length in `lengths`).

    Raises:
        RuntimeError: CUDA is not available, or a capture failed.
    """

    captured = True

    def __init__(
        self,
        target: StaticModel,
        draft: StaticModel | None,
        *,
        lengths: tuple[int, ...] = GRAPH_DRAFT_LENGTHS,
        compile: bool = False,
        progress: Callable[[int, int], None] | None = None,
        greedy: tuple[bool, ...] = (True, False),
        lookup: bool = False,
    ) -> None:
        super().__init__(target, draft, lookup=lookup)
        device = target.device
        # Prompt lookup's copy is found on the host in the tokens the last step emitted.
        self.ahead = not lookup
        self.inputs = StepInputs.allocate(target.capacity, device, on_device=True)
        self.lengths = lengths if draft is not None or lookup else ()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0)
        self._graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._done = (torch.cuda.Event(), torch.cuda.Event())
        self._turn = 0
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=device)
        speculative, target_only = EAGER_FUNCTIONS
        # torch's compile artifacts of this pair, versions and device, kept from an earlier start.
        models = [m.model for m in (target, draft) if m is not None]
        artifacts = compile_cache.artifact_path(models, device, "whole-step") if compile else None
        if artifacts is not None:
            compile_cache.load(artifacts)
            speculative, target_only = compiled_step_functions(target, draft)
        kinds = [(mode, truncating) for mode in greedy for truncating in ((False, True) if mode else (True,))]
        keys = list(dict.fromkeys(self._key(k, *kind) for k in (0, *self.lengths) for kind in kinds))
        for done, key in enumerate(keys):
            if progress is not None:
                progress(done, len(keys))
            try:
                self._capture(key, speculative, target_only)
            except Exception as exc:  # a compiled function that fails is captured eagerly instead
                if not compile:
                    raise
                self.compile_error = compile_failure(exc)
                speculative, target_only, compile = speculative_step, target_step, False
                torch.cuda.synchronize()
                self._capture(key, speculative, target_only)
        if progress is not None:
            progress(len(keys), len(keys))
        self._host = self._host_buffers(max(out.numel() for _, out in self._graphs.values()))
        if compile and artifacts is not None:  # still compiled: nothing failed
            compile_cache.save(artifacts)
        # The warm-up calls wrote into the caches and moved the position: nothing is cached now.
        for model in (target, draft):
            if model is not None:
                model.seen = 0

    @staticmethod
    def _key(k: int, greedy: bool, truncating: bool) -> tuple[int, bool, bool]:
        """The graph a step of draft length k (0: target-only) and this kind replays: (k, greedy,
        truncating), where a sampled step always truncates (its inputs are read as they are) and a
        greedy target-only step never does (`target_step` reads no law)."""
        return k, greedy, not greedy or (truncating and k > 0)

    @torch.inference_mode()
    def _capture(
        self,
        key: tuple[int, bool, bool],
        speculative: Callable[..., torch.Tensor],
        target_only: Callable[..., torch.Tensor],
    ) -> None:
        device = self.target.device
        k, greedy, truncating = key
        inputs = self.inputs.for_step(greedy, truncating)

        def step() -> torch.Tensor:
            draws = (
                None
                if greedy
                else Draws.make(k, self.target.vocab_size, self.generator, device, self.draft is not None)
            )
            if k == 0:
                return target_only(self.target, inputs, greedy, draws)
            return speculative(self.target, self.draft, inputs, k, greedy, draws)

        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_CALLS):
                self.inputs.position.fill_(1)  # in range whatever k: the calls write garbage only
                step()
        torch.cuda.current_stream(device).wait_stream(self._stream)
        torch.cuda.synchronize(device)
        self.inputs.position.fill_(1)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            out = step()
        self._graphs[key] = (graph, out)

    @torch.inference_mode()  # written by `copy_to_host` in inference mode
    def _host_buffers(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two host buffers of `size` float64, taken in turn by the launches. Pinned: the copy from
        the device is then asynchronous (and there is nothing to pin for a CPU tensor: the CPU
        tests' emulated graphs, tests/test_step_graph.py)."""
        pinned = self.target.device.type == "cuda"
        return (
            torch.empty(size, dtype=torch.float64, pin_memory=pinned),
            torch.empty(size, dtype=torch.float64, pin_memory=pinned),
        )

    def bind(self, reply: Reply) -> None:
        """Nothing: a reply decodes in `inputs.seq` itself (`reply.begin`'s `buffer`)."""
        assert reply.seq is self.inputs.seq, "a captured step runs over its own buffer"

    def fit(self, tokens: int) -> None:
        """Nothing: the graphs hold the caches' addresses (`capacity` bounds the context)."""

    def reseed(self, sampling: SamplingConfig, generator: torch.Generator) -> torch.Generator:
        """The registered generator, seeded for a reply as `sampling.seeded_generator` would."""
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(sampling.seed)
        return self.generator

    def speculative(self, k: int, greedy: bool, generator: torch.Generator) -> Launched:
        """Replay the graph of k and the reply's kind; its block on its way to the host."""
        return self._replay(k, greedy)

    def target_only(self, greedy: bool, generator: torch.Generator) -> Launched:
        """Replay a target-only graph; its block on its way to the host."""
        return self._replay(0, greedy)

    @torch.inference_mode()  # the graphs' outputs are inference tensors
    def _replay(self, k: int, greedy: bool) -> Launched:
        graph, out = self._graphs[self._key(k, greedy, self.inputs.truncating)]
        graph.replay()
        # The one transfer of the step, queued right after the replay: the next replay (of any
        # graph: they share a pool) may overwrite `out`. Into the buffer the launch before last
        # used, which the host has read (it reads a step before it launches the one after next),
        # while the last launch's block may still be on its way into the other.
        turn, self._turn = self._turn, 1 - self._turn
        host = self._host[turn][: out.numel()]
        copy_to_host(out, host, self._done[turn])
        return Launched(host, self._done[turn])


Steps = EagerSteps
"""The step runner a decoder holds: `EagerSteps` or its captured form, `CapturedSteps`."""


def make_steps(
    target: CachedModel,
    draft: CachedModel | None,
    *,
    compile: bool | None = None,
    lookup: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> EagerSteps | None:
    """The step runner of a decoder whose models are bound to static caches (`bind(static=True)`):
    captured on CUDA (`CapturedSteps`, `progress` as there), compiled first unless `compile` is
    False (inductor fuses the step's elementwise work: the default, as gpt-fast's and vLLM's steps
    are compiled, then captured); eager elsewhere unless `compile` is True (nothing to capture:
    `progress` is not called); None when a model is not a `StaticModel`
    (`compile_refusal` refused it: the decoder keeps its usual steps). `lookup`: the speculative
    steps verify prompt lookup's copies (no draft)."""
    models = (target,) if draft is None else (target, draft)
    if not all(isinstance(m, StaticModel) for m in models):
        return None
    assert isinstance(target, StaticModel) and (draft is None or isinstance(draft, StaticModel))  # for mypy
    if target.device.type == "cuda":
        return CapturedSteps(
            target, draft, compile=captured_compiled(compile), lookup=lookup, progress=progress
        )
    return EagerSteps(target, draft, lookup=lookup, compile=compile is True)


def captured_compiled(compile: bool | None) -> bool:
    """Whether captured steps compile their functions first, `compile` being the command's
    `--compile` (None: its default, which compiles them, as gpt-fast's and vLLM's steps are)."""
    return compile is not False


def capture_text(done: int, total: int, *, compile: bool | None) -> str:
    """Where a capture stands, in a few words (the loading screen's progress line); `compile`: as
    `make_steps`' (compiling first takes minutes on a first start, where a later start loads what
    it kept: `compile_cache`)."""
    if captured_compiled(compile):
        return f"compiling, then capturing the step graphs (--whole-step; minutes on a first start): {done}/{total}"
    return f"capturing the step graphs (--whole-step): {done}/{total}"


def capture_announcer(write: Callable[[str], object], *, compile: bool | None) -> Callable[[int, int], None]:
    """A capture `progress` for a command without a loading screen (generate, serve): one line
    through `write` when capturing starts, so that the seconds it takes are explained
    (`compile`: as `make_steps`')."""

    def progress(done: int, total: int) -> None:
        if done == 0:
            write(f"fsd-chat: {capture_text(done, total, compile=compile)}\n")

    return progress
