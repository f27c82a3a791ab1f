"""What both decoders share: the state of one reply (the token buffer, detokenisation, and the rules
that end a reply: EOS, max_new_tokens, stop strings, a full context window, a stop request), its
start (`begin`: the prompt's prefill), the tokens that end it (`eos_token_ids`), and the step that
emits one token from the target alone (`target_step`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.detokenize import IncrementalDetokenizer
from fsd_chat.decoding.events import Origin, Step, StepStats, StopReason, Token
from fsd_chat.decoding.runner import ModelRunner, id_set
from fsd_chat.decoding.sampling import (
    draw,
    greedy_on_host,
    non_finite,
    non_finite_error,
    probabilities,
    seeded_generator,
)
from fsd_chat.decoding.settings import DecodingSettings, SamplingConfig, StepRule
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.decoding.tokenizer import Tokenizer
from fsd_chat.support.errors import ContextLengthError, SettingsError

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel


class Reply:
    """The growing sequence (prompt + generated tokens) and its end conditions.

    Args:
        prompt_ids: Prompt token ids (non-empty).
        tokenizer: For incremental detokenisation.
        device: Where the token buffer lives (the models' input device).
        max_new_tokens: Exact cap on generated tokens.
        context: Context window in tokens (the smaller of the two models'), or None.
        headroom: Extra buffer slots a step may write beyond the cap (the draft length bound).
        eos_token_ids: Tokens that end the reply (not emitted).
        stop_strings: Texts that end the reply once generated (the token completing one is emitted).
        controls: Source of stop requests.
        buffer: The token buffer to decode in, [1, ≥ context + headroom + 1] int64 (default: one
            of its own, sized to the reply).

    Raises:
        ContextLengthError: the prompt leaves no room for a new token.
        SettingsError: max_new_tokens < 1 or an empty prompt.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        *,
        tokenizer: Tokenizer,
        device: torch.device,
        max_new_tokens: int,
        context: int | None,
        headroom: int,
        eos_token_ids: frozenset[int],
        stop_strings: tuple[str, ...],
        controls: Controls,
        buffer: torch.Tensor | None = None,
    ) -> None:
        if not prompt_ids:
            raise SettingsError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise SettingsError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if context is not None and len(prompt_ids) + 1 > context:
            raise ContextLengthError(
                f"the prompt is {len(prompt_ids)} tokens but the context window is {context} tokens: "
                "shorten it to leave room for the reply"
            )
        self.prompt_length = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.context = context
        # A reply never outgrows the context window, whatever max_new_tokens says: size by both.
        budget = max_new_tokens if context is None else min(max_new_tokens, context)
        capacity = len(prompt_ids) + budget + headroom + 1
        # A captured step's buffer has a fixed address (`step_graph.CapturedSteps`); it holds a
        # reply that fills the context window, beyond which no step writes.
        self.seq = torch.empty((1, capacity), dtype=torch.long, device=device) if buffer is None else buffer
        self.seq[0, : len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long)
        # The host's copy of the tokens decided so far (`record`): prompt lookup searches it and a
        # mapped draft spells it, so neither reads the device in a step.
        self.host = np.zeros(capacity, dtype=np.int64)
        self.host[: len(prompt_ids)] = prompt_ids
        self.length = len(prompt_ids)
        self._eos = eos_token_ids
        self._stop_strings = stop_strings
        # The last characters of the reply, enough for a stop string to end in the next delta:
        # checking a bounded tail keeps the per-token work constant however long the reply grows.
        self._tail = ""
        self._tail_length = max((len(s) for s in stop_strings), default=1) - 1
        self._controls = controls
        self._detok = IncrementalDetokenizer(tokenizer)
        self.unread = False
        """`begin` stopped reading the prompt (a stop request between two of its chunks): the
        reply ends at its first step, which reads nothing more and emits nothing."""

    @property
    def produced(self) -> int:
        """Tokens generated so far."""
        return self.length - self.prompt_length

    def room(self) -> int:
        """Most draft tokens the next step may propose: each step emits at most k + 1 tokens, and
        the last emitted token must still fit in the context window and under max_new_tokens."""
        if self.unread:
            return 0  # no draft: the first step ends the reply (`target_step`)
        room = self.max_new_tokens - self.produced - 1
        if self.context is not None:
            room = min(room, self.context - 1 - self.length)
        return max(room, 0)

    def record(self, ids: list[int]) -> None:
        """Copy to the host buffer the ids a step emits (already on the device at
        seq[length : length + len(ids)]), before the proposer's rollback and `commit` read them."""
        self.host[self.length : self.length + len(ids)] = ids

    def commit(
        self,
        ids: list[int],
        origins: list[Origin],
        divergences: list[float | None],
        costs: list[float],
        stats: StepStats,
        clock: PhaseClock,
    ) -> Step:
        """Emit the tokens `ids`, already written at seq[length:length + len(ids)], as one `Step`.

        Tokens after an EOS are dropped (the EOS too, though its cost counts); the reply ends at the
        first end condition. Text the detokeniser still holds back when the reply ends goes to the
        last emitted token, or to `Step.flushed` when the step emits none (its first token was EOS).
        `stats.emitted`, `stats.cost` and the accepted draft tokens become those of the tokens
        actually decided, and the time spent here (detokenisation) is added to
        `stats.other_seconds`.
        """
        reason: StopReason | None = None
        tokens: list[Token] = []
        cost = 0.0
        for token_id, origin, div, token_cost in zip(ids, origins, divergences, costs, strict=True):
            cost += token_cost
            if token_id in self._eos:
                reason = StopReason.EOS
                break
            text = self._detok.push(token_id)
            tokens.append(Token(token_id, text, origin, div, token_cost))
            if text and self._completes_stop_string(text):
                reason = StopReason.STOP_STRING
                break
        self.length += len(tokens)
        tail = ""
        if reason is None:
            if self.produced >= self.max_new_tokens:
                reason = StopReason.MAX_NEW_TOKENS
            elif self.context is not None and self.length >= self.context:
                reason = StopReason.CONTEXT
            elif self._controls.stop_requested or self.unread:
                reason = StopReason.STOPPED
        tail = ""
        if reason is not None:
            # A stop request is consumed by the reply it ends (one that arrives before the reply's
            # first step still ends it: `begin` does not clear it).
            self._controls.clear_stop()
            tail = self._detok.flush()
            if tail and tokens:
                tokens[-1] = replace(tokens[-1], text=tokens[-1].text + tail)
                tail = ""
        stats = replace(
            stats, emitted=len(tokens), cost=cost, other_seconds=stats.other_seconds + clock.lap()
        )
        decided = len(tokens) + (reason == StopReason.EOS)
        if decided < len(ids):
            # Accepted draft tokens after the end were never emitted: not counted either (a reply
            # whose last block ran past its EOS showed "fuzzy 14% · cost 0 (lossless)").
            kept = origins[:decided]
            stats = replace(
                stats,
                accepted_exact=kept.count(Origin.DRAFT_EXACT),
                accepted_fuzzy=kept.count(Origin.DRAFT_FUZZY),
            )
        return Step(tuple(tokens), stats, reason, flushed=tail)

    def _completes_stop_string(self, delta: str) -> bool:
        if not self._stop_strings:
            return False
        window = self._tail + delta
        self._tail = window[-self._tail_length :] if self._tail_length else ""
        return any(s in window for s in self._stop_strings)

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids so far."""
        return self.host[self.prompt_length : self.length].tolist()


@dataclass(slots=True)
class Start:
    """A reply whose prompt is prefilled, with the generator and clock of its decoding loop."""

    reply: Reply
    generator: torch.Generator
    clock: PhaseClock
    prefill_seconds: float


PREFILL_CHUNK = 512
"""Prompt tokens fed a forward pass while prefilling a long prompt: between two, the decoder
reports its progress (`Controls.report_prefill`), so that a long paste shows it is being read."""


def begin(
    models: Sequence[ModelRunner],
    prompt_ids: list[int],
    *,
    tokenizer: Tokenizer,
    controls: Controls,
    sampling: SamplingConfig,
    max_new_tokens: int,
    context: int | None,
    headroom: int,
    eos_token_ids: frozenset[int],
    stop_strings: tuple[str, ...],
    time_phases: bool,
    reuse_prefix: bool,
    deferred: Sequence[ModelRunner] = (),
    buffer: torch.Tensor | None = None,
) -> Start:
    """Start a reply: prefill the models' caches (the target's first) with all prompt tokens but the
    last (each step feeds the last token itself) through `read_prompt`; a stop requested while a
    long prompt is read marks the reply unread. The caches of `deferred` models (some of `models`: a
    draft a paused draft policy will not run for a while) are kept or emptied but not fed: their
    first forward pass reads the tokens they lack at once. `time_phases`: synchronise the device at
    each phase so that draft, target and other seconds are exact (see `PhaseClock`). `buffer`: the
    token buffer of a captured step (see `Reply`).

    Raises:
        ContextLengthError, SettingsError: see `Reply`.
    """
    device = models[0].device
    reply = Reply(
        prompt_ids,
        tokenizer=tokenizer,
        device=device,
        max_new_tokens=max_new_tokens,
        context=context,
        headroom=headroom,
        eos_token_ids=eos_token_ids,
        stop_strings=stop_strings,
        controls=controls,
        buffer=buffer,
    )
    clock = PhaseClock(device, synchronize=time_phases)
    prefix = reply.length - 1
    reply.unread = not read_prompt(
        models, reply.seq, prefix, controls, reuse_prefix=reuse_prefix, deferred=deferred
    )
    return Start(reply, seeded_generator(sampling, device), clock, clock.lap())


def read_prompt(
    models: Sequence[ModelRunner],
    seq: torch.Tensor,
    prefix: int,
    controls: Controls,
    *,
    reuse_prefix: bool,
    deferred: Sequence[ModelRunner] = (),
) -> bool:
    """Bring each model's KV cache to the tokens seq[0, :prefix]: keep the cached tokens they start
    with (`ModelRunner.keep_prefix`; none without `reuse_prefix`) and feed the rest, `PREFILL_CHUNK`
    tokens a forward pass, the models in step, reporting the progress between chunks
    (`Controls.report_prefill`) when there is more than one. `deferred` models are kept or emptied
    likewise but not fed. The target's kept tokens go to `Controls.cached_prompt_tokens`.

    Args:
        models: The models, the target's first.
        seq: Token buffer, shape [1, ≥ prefix] int64 on the models' device.
        prefix: Tokens to bring the caches to.
        controls: Progress listener and stop requests.

    Returns:
        Whether every chunk was read: False when a stop was requested (esc, a client gone) between
        two chunks; the caches then keep what they read, for the next prompt.
    """
    for model in models:
        if reuse_prefix:
            model.keep_prefix(seq, prefix)
        else:
            model.reset()
    controls.cached_prompt_tokens = models[0].seen
    # A long prompt is fed PREFILL_CHUNK tokens a forward pass, the models in step, its progress
    # reported between them (the causal mask makes the chunks' logits and cache those of one pass).
    fed = [model for model in models if model not in deferred]
    start = min(model.seen for model in fed)
    ends = [*range(start + PREFILL_CHUNK, prefix, PREFILL_CHUNK), prefix]
    chunked = len(ends) > 1
    if chunked:
        controls.report_prefill(start, prefix)  # at once: the first chunk takes a while too
    read = True
    for upto in ends:
        if chunked and controls.stop_requested:
            read = False
            break
        for model in fed:
            if model.seen < upto:
                model.prefill(seq, upto)
        if chunked:
            controls.report_prefill(upto, prefix)
    if chunked:
        for model in fed:
            # Sliding-window layers record their past from the first forward pass on: cut it back
            # to the window, as one pass would have left it (`CachedModel.forward`).
            model.rollback(model.seen)
    return read


def read_ahead(
    models: Sequence[ModelRunner],
    prompt_ids: list[int],
    controls: Controls,
    context: int | None,
    deferred: Sequence[ModelRunner] = (),
) -> None:
    """Bring the models' KV caches to `prompt_ids` now (`read_prompt`, reusing what they hold), so
    that a later prompt that starts with them prefills only the rest (`Decoder.read_ahead`). Ids
    that would leave the context window no room for a reply are not read.

    Args:
        models: The models, the target's first.
        prompt_ids: The tokens a later prompt will start with.
        controls: Stop requests (a long read ends between two chunks when one comes).
        context: The context window in tokens, or None.
        deferred: Models kept as far as they agree, but not fed (see `begin`).
    """
    if not prompt_ids or (context is not None and len(prompt_ids) >= context):
        return
    seq = torch.tensor([prompt_ids], dtype=torch.long, device=models[0].device)
    read_prompt(models, seq, len(prompt_ids), controls, reuse_prefix=True, deferred=deferred)


def eos_token_ids(tokenizer: Tokenizer, *models: PreTrainedModel | ModelRunner) -> frozenset[int]:
    """Token ids that end a reply: the tokenizer's EOS and each model's own (a transformers model's
    generation-config EOS, a runner's `ModelRunner.eos_token_ids`)."""
    ids = set(id_set(tokenizer.eos_token_id))
    for model in models:
        if isinstance(model, ModelRunner):
            ids |= model.eos_token_ids
        else:
            ids |= id_set(getattr(model.generation_config, "eos_token_id", None))
    return frozenset(ids)


def target_step(
    target: ModelRunner,
    reply: Reply,
    *,
    sampling: SamplingConfig,
    generator: torch.Generator,
    clock: PhaseClock,
    settings: DecodingSettings,
    rule: StepRule,
    prefill_seconds: float,
) -> Step:
    """One target forward pass over the last token, emitting one token of origin `target`: every
    step of `AutoregressiveDecoder`, and a speculative step whose draft policy drafts nothing. A
    reply whose prompt was not all read (`Reply.unread`) ends here instead, with no forward pass
    and no token.

    The token is written into the buffer on the device; the host reads it once, with the flag of
    a non-finite law (one synchronisation, no host-to-device copy).

    Raises:
        NonFiniteError: the target's logits are not finite (the reply ends before this token).
    """
    ids: list[int] = []
    if not reply.unread:
        logits = target.forward(reply.seq, reply.length, keep=1)[-1]
        # Greedy on the CPU, the token is read off the logits (the law's own argmax, and no law).
        token_id = greedy_on_host(logits) if sampling.greedy else None
        if token_id is not None:
            reply.seq[0, reply.length] = token_id
        else:
            probs = probabilities(logits, sampling)
            token = draw(probs, sampling, generator)
            reply.seq[0, reply.length : reply.length + 1].copy_(token.view(1))
            bad, token_id = torch.stack([non_finite(probs).long(), token]).tolist()
            if bad:
                raise non_finite_error("target")
        ids = [token_id]
        reply.record(ids)
    return commit_target(
        reply,
        ids,
        clock=clock,
        settings=settings,
        rule=rule,
        greedy=sampling.greedy,
        prefill_seconds=prefill_seconds,
    )


def commit_target(
    reply: Reply,
    ids: list[int],
    *,
    clock: PhaseClock,
    settings: DecodingSettings,
    rule: StepRule,
    greedy: bool,
    prefill_seconds: float,
) -> Step:
    """The `Step` of a target-only step that emitted `ids` (one token, none for an unread reply),
    already recorded (`Reply.record`); the time since the clock's last lap is the target's."""
    target_seconds = clock.lap()
    stats = StepStats(
        drafted=0,
        accepted_exact=0,
        accepted_fuzzy=0,
        emitted=len(ids),
        target_forwards=len(ids),
        draft_forwards=0,
        draft_seconds=0.0,
        target_seconds=target_seconds,
        other_seconds=0.0,
        threshold=settings.threshold,
        divergence=settings.tested(greedy),
        rule=rule,
        prefill_seconds=prefill_seconds,
    )
    return reply.commit(ids, [Origin.TARGET] * len(ids), [None] * len(ids), [0.0] * len(ids), stats, clock)
