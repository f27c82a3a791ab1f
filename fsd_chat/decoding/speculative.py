"""Speculative decoding with exact, fuzzy (FSD) and pure acceptance rules.

One step (batch size 1; Leviathan et al. 2023, Algorithm 1, with the acceptance test of Holsman,
Huang, Dhingra, "Fuzzy Speculative Decoding", ACL Findings 2025, §3):

1. Draft: k forward passes of the draft model, x̃_i ~ q_i (argmax when greedy).
2. Verify: one target forward pass over [last token, x̃_1..x̃_k] gives p_1..p_{k+1}.
3. Accept the prefix of positions the rule accepts (see `acceptance.verify`).
4. Correct: a resampled target token after a rejection, or a bonus token after k acceptances.
5. Roll both KV caches back to the accepted prefix (no accepted token is re-encoded).

The settings (rule, divergence, threshold T, draft length k, draft policy) are read from
`Controls` at the start of every step, so another thread can retune them mid-reply. The draft
policy (`fsd_chat.decoding.draft_policy`: fixed, adaptive or cost) decides each step's k; a policy
chosen mid-reply starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fsd_chat.decoding.acceptance import verify
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.draft_policy import CostCurve, DraftPolicy, Next, make_policy, measure_costs
from fsd_chat.decoding.events import Step, StepStats
from fsd_chat.decoding.kv_cache import CachedModel, CompiledModel, context_length
from fsd_chat.decoding.mapped_draft import MappedDraft
from fsd_chat.decoding.memory import frees_memory_on_oom
from fsd_chat.decoding.reply import Reply, begin, eos_token_ids, target_step
from fsd_chat.decoding.sampling import draw, probabilities
from fsd_chat.decoding.settings import MAX_DRAFT_TOKENS, DecodingSettings, SamplingConfig
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.decoding.vocab_map import VocabularyMap

COMPILED_CONTEXT = 8192
"""Most tokens a compiled draft's static KV cache holds (it is allocated whole, up front)."""


class SpeculativeDecoder:
    """Draft-then-verify decoding of a target model with a smaller draft model.

    The models share the tokenizer's vocabulary (see `fsd_chat.models.check_compatible`), or a
    `VocabularyMap` maps the draft's onto it (`MappedDraft`: the draft reads the target's text in
    its own tokens and proposes over the paired tokens).

    Args:
        target: The target model (the distribution to follow).
        draft: The draft model (cheap proposals).
        tokenizer: The shared tokenizer.
        controls: Live settings and stop requests.
        vocab_size: Shared vocabulary size; logits beyond it are dropped (default: len(tokenizer)).
        time_phases: Exact draft / target / other seconds on CUDA, at the price of a device
            synchronisation per phase (benchmarks); off, a step synchronises once, when its
            verdict comes back (see `PhaseClock`).
        compile_draft: Run the draft's one-token forward passes compiled over a static KV cache
            (`CompiledModel`); the context is then capped at COMPILED_CONTEXT tokens.
        costs: The device's draft and verify costs, asked for when the `cost` policy is first
            used (default: measured on these models then, once; `ModelPair` keeps its own).
        vocab_map: The draft's vocabulary mapped onto the target's, for a draft with another
            tokenizer (None: one shared vocabulary).

    Raises:
        UnsupportedCacheError: a model's cache cannot be rolled back (or, with compile_draft, the
            draft has other than full-attention layers).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        controls: Controls | None = None,
        vocab_size: int | None = None,
        time_phases: bool = False,
        compile_draft: bool = False,
        costs: Callable[[], CostCurve] | None = None,
        vocab_map: VocabularyMap | None = None,
    ) -> None:
        vocab_size = vocab_size or len(tokenizer)
        draft_vocab = vocab_size if vocab_map is None else vocab_map.draft_vocab
        self.tokenizer = tokenizer
        self.time_phases = time_phases
        self.controls = controls or Controls()
        self.target = CachedModel(target, vocab_size)
        # A mapped draft counts its context in its own tokens: it bounds drafting, not the reply.
        draft_context = context_length(draft)
        contexts = [c for c in (context_length(target), draft_context if vocab_map is None else None) if c]
        self.context = min(contexts) if contexts else None
        if compile_draft:
            # The static cache is allocated whole: cap it, and the context with it.
            self.context = min(self.context or COMPILED_CONTEXT, COMPILED_CONTEXT)
            draft_context = self.context + MAX_DRAFT_TOKENS + 1
            self.draft: CachedModel = CompiledModel(draft, draft_vocab, draft_context)
        else:
            self.draft = CachedModel(draft, draft_vocab)
        self.mapped = None if vocab_map is None else MappedDraft(self.draft, vocab_map, draft_context)
        # A mapped draft's EOS ids are its own: the target's say when the reply ends.
        self.eos_token_ids = eos_token_ids(tokenizer, target, *([draft] if vocab_map is None else []))
        common = min(vocab_size, draft_vocab)
        self.costs = costs or cache(lambda: measure_costs(target, draft, common))

    @property
    def compile_error(self) -> str | None:
        """Why the compiled draft fell back to eager forward passes (None: it did not, or no
        compilation was asked for)."""
        return self.draft.compile_error

    @property
    def cached_models(self) -> tuple[CachedModel, ...]:
        """The models whose KV caches this decoder fills."""
        return (self.target, self.draft)

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
            sampling: Temperature / top-k / top-p / seed, applied to both models alike.
            stop_strings: Texts that end the reply.

        Raises:
            ContextLengthError: the prompt does not fit the context window.
            SettingsError: max_new_tokens < 1 or an empty prompt.
            UnsupportedCacheError: a model's KV cache cannot be rolled back.
            DeviceMemoryError: the device ran out of memory (the KV caches are freed).
        """
        sampling = sampling or SamplingConfig()
        policy_name = self.controls.snapshot().draft_policy
        policy = make_policy(policy_name, self.costs)  # before the clock starts: it may measure
        start = begin(
            [self.target] if self.mapped else [self.target, self.draft],
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
        )
        reply, generator, clock = start.reply, start.generator, start.clock
        if self.mapped:
            self.mapped.begin(prompt_ids)
        prefill_seconds = start.prefill_seconds + clock.lap()
        while True:
            settings = self.controls.snapshot()
            if settings.draft_policy != policy_name:
                policy, policy_name = make_policy(settings.draft_policy, self.costs), settings.draft_policy
                clock.lap()  # a first measurement of the costs is no step's time
            k = policy.limit(settings, min(reply.room(), self.mapped.room()) if self.mapped else reply.room())
            if k == 0:
                step = target_step(
                    self.target,
                    reply,
                    sampling=sampling,
                    generator=generator,
                    clock=clock,
                    settings=settings,
                    rule=settings.rule,
                    prefill_seconds=prefill_seconds,
                )
            else:
                step = self._speculative_step(
                    reply, k, policy, settings, sampling, generator, clock, prefill_seconds
                )
                policy.observe(step.stats.drafted, step.stats.accepted)
            prefill_seconds = 0.0
            if self.mapped and step.stop_reason is None:
                self.mapped.settle([t.id for t in step.tokens], step.stats.accepted)
            yield step
            if step.stop_reason is not None:
                return

    def _speculative_step(
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
        start = reply.length
        seq = reply.seq
        q_rows: list[torch.Tensor] = []
        for draft_forwards in range(1, limit + 1):
            if self.mapped:
                q = self.mapped.distribution(seq, start, len(q_rows), sampling)
            else:
                q = probabilities(self.draft.forward(seq, start + draft_forwards - 1, keep=1)[-1], sampling)
            # The policy sees q before the draw: a kept position's token is still a draw from q.
            then = policy.extend(q)
            if then is Next.DROP:
                break
            seq[0, start + len(q_rows)] = draw(q, sampling, generator)
            q_rows.append(q)
            if then is Next.STOP:
                break
        k = len(q_rows)
        draft_seconds = clock.lap()

        logits = self.target.forward(seq, start + k, keep=k + 1)
        p = probabilities(logits, sampling).to(device=seq.device)
        target_seconds = clock.lap()

        verdict = verify(
            p,
            torch.stack(q_rows),
            seq[0, start : start + k],
            rule=settings.rule,
            divergence_name=settings.divergence,
            threshold=settings.threshold,
            sampling=sampling,
            generator=generator,
        )
        n = verdict.accepted
        seq[0, start + n] = verdict.token_ids[-1]
        # Both caches must hold exactly the tokens before the last emitted one.
        self.target.rollback(start + n)
        if not self.mapped:  # a mapped draft follows after the step (`MappedDraft.settle`)
            self.draft.rollback(start + n)
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
            divergence=settings.divergence,
            rule=settings.rule,
            draft_tokens=k,
            prefill_seconds=prefill_seconds,
        )
        return reply.commit(verdict.token_ids, verdict.origins(), divergences, verdict.costs, stats, clock)
