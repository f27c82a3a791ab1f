"""Speculative decoding with exact, fuzzy (FSD) and pure acceptance rules.

One step (batch size 1; Leviathan et al. 2023, Algorithm 1, with the acceptance test of Holsman,
Huang, Dhingra, "Fuzzy Speculative Decoding", ACL Findings 2025, §3):

1. Propose: up to k tokens x̃_i with their laws q_i (`fsd_chat.decoding.proposal`): k forward
   passes of a draft model, x̃_i ~ q_i (argmax when greedy), or a prompt lookup, q_i = δ(x̃_i).
   Nothing proposed (no n-gram matched): the step is a plain target step.
2. Verify: one target forward pass over [last token, x̃_1..x̃_k] gives p_1..p_{k+1}.
3. Accept the prefix of positions the rule accepts (see `acceptance.verify`).
4. Correct: a resampled target token after a rejection, or a bonus token after k acceptances.
5. Roll both KV caches back to the accepted prefix (no accepted token is re-encoded).

The settings (rule, divergence, threshold T, draft length k, draft policy) are read from
`Controls` at the start of every step, so another thread can retune them mid-reply. The draft
policy (`fsd_chat.decoding.draft_policy`: goodput, fixed, heuristic or latency) decides each step's
k; a policy chosen mid-reply starts afresh, and with reuse_prefix one policy lives from reply to
reply (what it measured carries over). k = 0 (`goodput` when drafting does not pay) is a
target-only step: no draft forward, no verify width; a draft model's cache catches up on the
tokens it skipped in one forward when drafting resumes (`CachedModel.forward` feeds every unseen
token), a mapped draft spells them first (`MappedProposer.propose`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from fsd_chat.decoding.acceptance import (
    CompiledDecision,
    Decide,
    Verdict,
    decide,
    read_verdict,
    verdict_flags,
    verify,
)
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.draft_policy import DraftPolicy, make_policy
from fsd_chat.decoding.events import Step, StepStats
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.lookup import PromptLookup, repeat_run
from fsd_chat.decoding.mapped_draft import MappedDraft, MappedProposer
from fsd_chat.decoding.memory import frees_memory, frees_memory_on_oom
from fsd_chat.decoding.proposal import ModelDraft, Proposer
from fsd_chat.decoding.reply import Reply, begin, eos_token_ids, read_ahead, target_step
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.sampling import probabilities
from fsd_chat.decoding.settings import (
    MAX_DRAFT_TOKENS,
    DecodingSettings,
    DraftPolicyName,
    Rule,
    SamplingConfig,
)
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.decoding.tokenizer import Tokenizer
from fsd_chat.decoding.vocab_map import VocabularyMap
from fsd_chat.decoding.whole_step import Launched, WholeStep, reply_tokens, room_ahead, whole_target_step
from fsd_chat.support.errors import NonFiniteError

REPEAT_GUARD = 8
"""Tokens of repetition from which a prompt lookup copy of the reply's own text is verified by the
exact test (`SpeculativeDecoder._verify_rule`): the repeat it extends, plus the copy, reaching this
length. Shorter self-copies (a name, a phrase said again) keep the dial; a longer repeat goes on
only where the target itself chooses it."""


class SpeculativeDecoder:
    """Draft-then-verify decoding of a target model with a smaller draft model or another proposer.

    A draft model shares the tokenizer's vocabulary (see `fsd_chat.models.loading.check_compatible`), or a
    `VocabularyMap` maps the draft's onto it (`MappedProposer`: the draft reads the target's text in
    its own tokens and proposes over the paired tokens).

    The models come bound to their KV caches by their engine (`ModelRunner`s: the transformers
    engine's `fsd_chat.engines.torch_engine.binding.speculative_decoder` binds them and builds
    this decoder; llama.cpp's runners are bound as they are loaded).

    Args:
        target: The target model's runner (the distribution to follow).
        draft: The draft model's runner (cheap proposals), or any `Proposer` (e.g. `PromptLookup`).
        tokenizer: The shared tokenizer.
        controls: Live settings and stop requests.
        time_phases: Exact draft / target / other seconds on CUDA, at the price of a device
            synchronisation per phase (benchmarks); off, a step synchronises once, when its
            verdict comes back (see `PhaseClock`).
        reuse_prefix: Keep the KV caches between replies and prefill only what a prompt does not
            share with the last sequence (see `begin`; a mapped draft compares its own spelling,
            see `MappedDraft.begin`).
        timings: The draft and verify forward times, asked for when the `latency` or `goodput`
            policy is first used: the engine's, fixed before the reply (modelled from the models,
            or on llama.cpp timed once on the machine and cached) so that no clock decides a draft
            length (`ModelPair.forward_timings`; a proposer without a draft model taking no time
            per position).
        vocab_map: The draft's vocabulary mapped onto the target's, for a draft with another
            tokenizer (`MappedProposer`; None: one shared vocabulary).
        context_cap: The most tokens of context the models' static KV caches hold (None: the
            models' own contexts bound it alone).
        draft_context: A mapped draft's context in its own tokens (None: its runner's `context`).
        steps: Run each step, speculative or target-only, as one function over static buffers
            (a `WholeStep`, the transformers engine's `fsd_chat.engines.torch_engine.step_graph`;
            None: the per-forward steps): captured as CUDA graphs on CUDA (one per draft length
            in `step_graph.GRAPH_DRAFT_LENGTHS`, to which the policy's k is rounded down), eager
            elsewhere. For a draft model of the target's
            vocabulary, or prompt lookup. The draft policy chooses k before the step
            (`DraftPolicy.limit`); its per-position `extend` is not asked. On CUDA a step is
            launched before the last one is read (`step_graph`, "One step in flight": but with
            prompt lookup), so the dial, the rule and the draft policy act from the next launched
            step, and a step launched past the reply's end is discarded.
        compiled_rule: Run the acceptance rule compiled (`CompiledDecision`), as the target's
            forward passes are, on its device.

    Raises:
        UnsupportedCacheError: a model's cache cannot be rolled back.
    """

    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner | Proposer,
        tokenizer: Tokenizer,
        *,
        timings: Callable[[], ForwardTimings],
        controls: Controls | None = None,
        time_phases: bool = False,
        reuse_prefix: bool = True,
        vocab_map: VocabularyMap | None = None,
        context_cap: int | None = None,
        draft_context: int | None = None,
        steps: WholeStep | None = None,
        compiled_rule: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.time_phases = time_phases
        self.reuse_prefix = reuse_prefix
        self.controls = controls or Controls()
        draft_model = draft if isinstance(draft, ModelRunner) else None
        # Models that read the target's ids: a mapped draft counts its context (and its EOS ids)
        # in its own tokens, which bound its drafting, not the reply.
        shared = [m for m in (target, draft_model) if m is not None and (m is target or vocab_map is None)]
        contexts = [c for c in (m.context for m in shared) if c is not None]
        self.context = min(contexts) if contexts else None
        if context_cap is not None:  # a static cache is allocated whole: its capacity caps the context
            self.context = min(self.context or context_cap, context_cap)
        # Prompt lookup's copies are found on the host, before a whole step.
        self._lookup = draft if isinstance(draft, PromptLookup) else None
        self.target = target
        self.proposer: Proposer
        if draft_model is None:
            assert not isinstance(draft, ModelRunner)  # narrowed for mypy
            self.proposer = draft
        elif vocab_map is None:
            self.proposer = ModelDraft(draft_model)
        else:
            context = draft_model.context if draft_context is None else draft_context
            self.proposer = MappedProposer(MappedDraft(draft_model, vocab_map, context))
        self._steps = steps
        # The acceptance rule is compiled with the target: on the same switch, for the same device.
        self._decision: Decide | CompiledDecision = (
            CompiledDecision(self.target.device) if compiled_rule else decide
        )
        self.eos_token_ids = eos_token_ids(tokenizer, *shared)
        self.timings = timings
        self._kept_policy: tuple[DraftPolicyName, DraftPolicy] | None = None

    def _policy(self, name: DraftPolicyName) -> DraftPolicy:
        """The draft policy of that name. With reuse_prefix (one conversation, reply after reply:
        the chat, the server) it is the one the last reply ended with, so what it measured (the
        acceptance, the prices, a pause) carries over and a draft that did not pay is not tried
        afresh at every reply's start; only a pause's backoff restarts (`begin_reply`: a new
        prompt may bring text to copy). A policy chosen anew starts afresh."""
        kept = self._kept_policy
        if not (self.reuse_prefix and kept is not None and kept[0] == name):
            ngram = 0 if self._lookup is None else self._lookup.ngram
            kept = self._kept_policy = (name, make_policy(name, self.timings, self.proposer.kind, ngram))
        else:
            # Only a reply's start finds the kept policy (mid-reply, a policy of another name
            # is asked for): the conversation's next reply begins.
            kept[1].begin_reply()
        return kept[1]

    @property
    def compile_error(self) -> str | None:
        """Why a model asked to run compiled runs eagerly: refused (`compile_refusal`) or fallen
        back after a failed compilation; None when neither happened, or none was asked for."""
        rule_error = self._decision.compile_error if isinstance(self._decision, CompiledDecision) else None
        step_error = None if self._steps is None else self._steps.compile_error
        return self.target.compile_error or self.proposer.compile_error or rule_error or step_error

    @property
    def cached_models(self) -> tuple[ModelRunner, ...]:
        """The models that read the target's ids, whose KV caches `begin` prefills."""
        return (self.target, *self.proposer.cached_models)

    @property
    def owned_models(self) -> tuple[ModelRunner, ...]:
        """Every model whose KV cache this decoder holds (freed on out-of-memory)."""
        return (self.target, *self.proposer.owned_models)

    def read_ahead(self, prompt_ids: list[int]) -> None:
        """See `Decoder.read_ahead`: the models `begin` feeds, but a draft whose policy is paused
        (its first probe reads what it lacks)."""
        if self.reuse_prefix:
            kept = self._kept_policy
            paused = kept is not None and kept[1].pause is not None
            deferred = self.proposer.cached_models if paused else ()
            if self._steps is not None:
                self._steps.prepare(len(prompt_ids) + 1)
            with frees_memory(self, "reading the conversation ahead"):
                read_ahead(self.cached_models, prompt_ids, self.controls, self.context, deferred)

    @frees_memory_on_oom
    def generate(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop_strings: tuple[str, ...] = (),
    ) -> Iterator[Step]:
        """Yield one `Step` per target forward pass; the last has `stop_reason` set.

        Args:
            prompt_ids: Prompt token ids.
            max_new_tokens: Exact cap on generated tokens (a block is cut short to respect it).
            sampling: Temperature / top-k / top-p / min-p / seed, applied to both models alike.
            stop_strings: Texts that end the reply.

        Raises:
            ContextLengthError: the prompt does not fit the context window.
            SettingsError: max_new_tokens < 1 or an empty prompt.
            UnsupportedCacheError: a model's KV cache cannot be rolled back.
            DeviceMemoryError: the device ran out of memory (the KV caches are freed).
        """
        sampling = sampling or SamplingConfig()
        policy_name = self.controls.snapshot().draft_policy
        policy = self._policy(policy_name)  # before the clock starts (its prices are found already)
        # A paused policy drafts nothing for a while (a draft that cannot pay: never), so a draft
        # model's cache is not fed the prompt now; its first forward, on a probe, reads it at once.
        defer = policy.pause is not None
        deferred = self.proposer.cached_models if defer else ()
        steps = self._steps
        buffer = None
        if steps is not None:
            tokens = reply_tokens(len(prompt_ids), max_new_tokens, self.context, MAX_DRAFT_TOKENS)
            buffer = steps.prepare(tokens)
        start = begin(
            self.cached_models,
            prompt_ids,
            tokenizer=self.tokenizer,
            controls=self.controls,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            context=self.context,
            headroom=MAX_DRAFT_TOKENS,
            eos_token_ids=self.eos_token_ids,
            stop_strings=stop_strings,
            time_phases=self.time_phases,
            reuse_prefix=self.reuse_prefix,
            deferred=deferred,
            buffer=buffer,
        )
        reply, generator, clock = start.reply, start.generator, start.clock
        if steps is not None:
            generator = steps.start(reply, sampling, generator)
        self.proposer.prefill(reply, self.reuse_prefix, defer)
        prefill_seconds = start.prefill_seconds + clock.lap()

        def choose(room: int, length: int) -> tuple[DecodingSettings, int]:
            """The settings and the draft policy's k of the next step to launch."""
            nonlocal policy, policy_name
            settings = self.controls.snapshot()
            if settings.draft_policy != policy_name:
                policy, policy_name = self._policy(settings.draft_policy), settings.draft_policy
                clock.lap()  # a first measurement of the forward times is no step's time
            # What prompt lookup will copy is known before the policy decides: how long a suffix
            # matched says how likely its copy is accepted.
            evidence = None if self._lookup is None else self._lookup.match(reply).matched
            return settings, policy.limit(settings, room, evidence, length)

        # A whole step launched before the last one was read (`WholeStep.ahead`).
        ahead: _Launch | None = None
        while True:
            if ahead is not None or (steps is not None and not reply.unread):
                assert steps is not None
                if ahead is None:
                    settings, k = choose(reply.room(), reply.length)
                    launch = self._launch(steps, reply, k, settings, sampling, generator, reply.length)
                else:
                    launch, ahead = ahead, None
                room = room_ahead(steps, reply, launch.k)
                if room is not None:
                    # Launched before `launch` is read: its start is known after a target-only
                    # step (one token), and only then can the draft be behind.
                    length = reply.length + launch.k + 1
                    settings, k = choose(room, length)
                    known = reply.length + 1 if launch.k == 0 else None
                    ahead = self._launch(steps, reply, k, settings, sampling, generator, known)
                step = self._read(steps, launch, reply, sampling, clock, prefill_seconds)
            else:
                settings, k = choose(reply.room(), reply.length)
                step = self._step(reply, k, policy, settings, sampling, generator, clock, prefill_seconds)
            if step.stats.drafted:
                policy.observe(step.stats.drafted, step.stats.accepted)
            # A whole step times its draft and verify passes together.
            exact = clock.exact and steps is None
            verify_seconds = step.stats.target_seconds if step.stats.drafted and exact else None
            policy.timed(step.stats.drafted, step.stats.seconds, verify_seconds)
            if policy.pause is not None:
                step = replace(step, stats=replace(step.stats, paused=policy.pause))
            prefill_seconds = 0.0
            yield step
            if step.stop_reason is not None:
                return

    def _step(
        self,
        reply: Reply,
        limit: int,
        policy: DraftPolicy,
        settings: DecodingSettings,
        sampling: SamplingConfig,
        generator: torch.Generator,
        clock: PhaseClock,
        prefill_seconds: float,
    ) -> Step:
        """One step: propose up to `limit` tokens, verify them, emit the accepted prefix and the
        target's token; a plain target step when nothing is proposed (or `limit` is 0)."""
        start = reply.length
        seq = reply.seq
        proposal = self.proposer.propose(reply, limit, policy, sampling, generator) if limit else None
        if proposal is None or proposal.drafted == 0:
            return target_step(
                self.target,
                reply,
                sampling=sampling,
                generator=generator,
                clock=clock,
                settings=settings,
                rule=settings.rule,
                prefill_seconds=prefill_seconds,
            )
        k = proposal.drafted
        draft_seconds = clock.lap()

        logits = self.target.forward(seq, start + k, keep=k + 1)
        p = probabilities(logits, sampling).to(device=seq.device)
        # Under truncation the divergences compare the untruncated laws (see `acceptance`).
        p_full = (
            probabilities(logits[:k], sampling.untruncated()).to(device=seq.device)
            if sampling.truncates
            else None
        )
        target_seconds = clock.lap()

        verdict = verify(
            p,
            proposal.q,
            seq[0, start : start + k],
            rule=self._verify_rule(reply, settings, k),
            divergence_name=settings.divergence,
            threshold=settings.threshold,
            sampling=sampling,
            generator=generator,
            p_full=p_full,
            q_full=proposal.q_full,
            decision=self._decision,
        )
        # From the device tensor: a Python int written into a CUDA tensor is a host-to-device copy
        # that waits for the queue.
        seq[0, start + verdict.accepted : start + verdict.accepted + 1].copy_(verdict.next_token)
        return self._emit(
            reply,
            k,
            verdict,
            settings,
            clock,
            draft_forwards=proposal.forwards,
            draft_seconds=draft_seconds,
            target_seconds=target_seconds,
            prefill_seconds=prefill_seconds,
            lookup=proposal.lookup,
            greedy=sampling.greedy,
        )

    def _verify_rule(self, reply: Reply, settings: DecodingSettings, k: int) -> Rule:
        """The rule this step's proposal of `k` tokens is verified by: the dial's, except for a
        prompt lookup copy of the reply's own text that would make the reply repeat itself for
        `REPEAT_GUARD` tokens or more, which the exact test verifies. Relaxing those lets a
        repetition the target would have left feed itself: on the default chat at T 0.5 regret,
        with every self-copy relaxed, 2 of 20 `tinystories-retell` replies and at 0.25 one looped
        on a sentence the target said once ("I'm so glad you're enjoying your dream." to the token
        cap). A copy of the prompt (the text being retold, quoted or edited, earlier turns
        included) keeps the dial."""
        if self._lookup is None:
            return settings.rule
        start = self._lookup.match(reply).start
        if start < reply.prompt_length:
            return settings.rule
        distance = reply.length - start
        if repeat_run(reply.host[: reply.length], distance) + k >= REPEAT_GUARD:
            return "exact"
        return settings.rule

    def _launch(
        self,
        steps: WholeStep,
        reply: Reply,
        limit: int,
        settings: DecodingSettings,
        sampling: SamplingConfig,
        generator: torch.Generator,
        start: int | None,
    ) -> _Launch:
        """Launch a whole step (`step_graph`): a speculative step of the largest available draft
        length ≤ `limit` (with prompt lookup: ≤ the copy the host found), or a target-only step.
        `start`: the index of the step's first token, when known (None: launched before the last
        step, a speculative one, is read, which left the draft at most the token it lacks after a
        fully accepted block behind: what the step's first pass re-feeds)."""
        source = 0
        if self._lookup is not None and limit:
            source, limit, _ = self._lookup.match(reply, limit)
        lengths = steps.lengths
        k = limit if lengths is None else max((n for n in lengths if n <= limit), default=0)
        if k == 0:
            return _Launch(steps.target_only(sampling.greedy, generator), 0, 0, settings)
        draft = steps.draft
        forwards = 0 if draft is None else k
        if draft is not None and start is not None and draft.seen < start - 2:
            # Behind by more than the step's first pass re-feeds (target-only steps while the
            # policy paused it): caught up eagerly, outside the step.
            draft.forward(reply.seq, start - 1, keep=1)
            forwards += 1
        steps.write(settings, self._verify_rule(reply, settings, k), source)
        return _Launch(steps.speculative(k, sampling.greedy, generator), k, forwards, settings)

    def _read(
        self,
        steps: WholeStep,
        launch: _Launch,
        reply: Reply,
        sampling: SamplingConfig,
        clock: PhaseClock,
        prefill_seconds: float,
    ) -> Step:
        """`_step` of a launched whole step: one read of its block."""
        k, settings = launch.k, launch.settings
        if k == 0:
            return whole_target_step(
                steps,
                launch.launched,
                reply,
                clock=clock,
                settings=settings,
                rule=settings.rule,
                greedy=sampling.greedy,
                prefill_seconds=prefill_seconds,
            )
        start = reply.length
        lookup = self._lookup is not None
        target, draft = steps.target, steps.draft
        block = launch.launched.read().tolist()
        # What the caches surely hold, should the verdict end the reply (a non-finite law)...
        target.seen = start
        if draft is not None:
            draft.seen = start
        n = int(block[verdict_flags(k, lookup)])
        try:
            verdict = read_verdict(
                block, k, point_masses=lookup, next_token=reply.seq[0, start + n : start + n + 1]
            )
        except NonFiniteError:
            steps.clear()
            raise
        # ...and what the step fed (`speculative_step`), which `_emit` rolls back to the accepted prefix.
        target.seen = start + k
        if draft is not None:
            draft.seen = start + k - 1
        return self._emit(
            reply,
            k,
            verdict,
            settings,
            clock,
            draft_forwards=launch.forwards,
            draft_seconds=0.0,
            target_seconds=clock.lap(),
            prefill_seconds=prefill_seconds,
            lookup=lookup,
            greedy=sampling.greedy,
        )

    def _emit(
        self,
        reply: Reply,
        k: int,
        verdict: Verdict,
        settings: DecodingSettings,
        clock: PhaseClock,
        *,
        draft_forwards: int,
        draft_seconds: float,
        target_seconds: float,
        prefill_seconds: float,
        lookup: bool,
        greedy: bool,
    ) -> Step:
        """The `Step` of a verified block whose tokens are in the reply's buffer: recorded, the
        caches rolled back to the accepted prefix, the stats."""
        start = reply.length
        n = verdict.accepted
        reply.record(verdict.token_ids)
        # Both caches must hold exactly the tokens before the last emitted one.
        self.target.rollback(start + n)
        self.proposer.rollback(start + n)
        accepted_exact = sum(verdict.exact[:n])
        divergences: list[float | None] = [*verdict.divergences[:n]]
        divergences.append(verdict.divergences[n] if n < k else None)
        stats = StepStats(
            drafted=k,
            accepted_exact=accepted_exact,
            accepted_fuzzy=n - accepted_exact,
            emitted=n + 1,
            target_forwards=1,
            draft_forwards=draft_forwards,
            draft_seconds=draft_seconds,
            target_seconds=target_seconds,
            other_seconds=clock.lap(),
            threshold=settings.threshold,
            divergence=settings.tested(greedy),
            rule=settings.rule,
            prefill_seconds=prefill_seconds,
            lookup_hits=int(lookup),
        )
        return reply.commit(verdict.token_ids, verdict.origins(), divergences, verdict.costs, stats, clock)


@dataclass(frozen=True, slots=True)
class _Launch:
    """A whole step launched and not yet read: its block on its way (`Launched`), its
    draft length (0: target-only), its draft forward passes (a catch-up included) and the settings
    it was launched with (its stats report them)."""

    launched: Launched
    k: int
    forwards: int
    settings: DecodingSettings
