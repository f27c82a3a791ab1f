"""A loaded target/draft pair (`ModelPair`) and the decoders over it: `ModelPair.decoder` makes the
speculative or target-only choice, with the draft source the pair holds (a draft model, a mapped
draft with another tokenizer, or prompt lookup)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fsd_chat.decoding.autoregressive import AutoregressiveDecoder
from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.lookup import PromptLookup
from fsd_chat.decoding.proposal import DraftKind
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.settings import DEFAULT_LOOKUP_NGRAM
from fsd_chat.decoding.speculative import SpeculativeDecoder
from fsd_chat.decoding.tokenizer import Tokenizer
from fsd_chat.decoding.vocab_map import VocabularyMap
from fsd_chat.engines import llama_calibration
from fsd_chat.engines.llama_cpp import LlamaCppModel
from fsd_chat.engines.torch_engine.binding import autoregressive_decoder, speculative_decoder
from fsd_chat.engines.torch_engine.kv_cache import compile_refusal
from fsd_chat.engines.torch_engine.timings import modelled_timings
from fsd_chat.models.generation import FileGeneration
from fsd_chat.models.gguf_sources import Progress
from fsd_chat.models.options import ModelSpec, quantization_note
from fsd_chat.support.threads import apply_threads, choose_thread_counts

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import GenerationConfig, PreTrainedModel


@dataclass(slots=True)
class ModelPair:
    """A loaded target and draft model sharing one tokenizer, a draft whose vocabulary is mapped
    onto the target's (`vocab_map`), or a target alone whose drafts come from prompt lookup (`draft`
    None, `draft_spec.source` "lookup"). Both models run on one engine: transformers
    (`PreTrainedModel`s) or llama.cpp (`LlamaCppModel`s, already bound to their KV caches).

    Attributes:
        tokenizer: The target's tokenizer (prompts, replies and the draft's proposals use its ids).
        vocab_size: The target's vocabulary size (logits are restricted to it); with one shared
            vocabulary, the draft's too.
        device: The device inputs go to (the draft's; the target's first shard).
        dtype: Compute dtype of the unquantized weights.
        timings: The draft and verify forward times (`forward_timings`), once found.
        vocab_map: The draft's vocabulary mapped onto the target's (None: one shared vocabulary).
        coverage: With a vocab_map, the share of the target's probability mass its paired tokens
            hold (`fsd_chat.decoding.vocab_map.coverage`).
        draft_tokenizer: With a vocab_map, the draft's own tokenizer.
        engine: "transformers" or "llama.cpp".
        generation: On llama.cpp, the target's generation defaults as read from its GGUF file
            (transformers models carry their own); see `generation_config`.
    """

    target: PreTrainedModel | LlamaCppModel
    draft: PreTrainedModel | LlamaCppModel | None
    tokenizer: Tokenizer
    vocab_size: int
    target_spec: ModelSpec
    draft_spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    timings: ForwardTimings | None = None
    vocab_map: VocabularyMap | None = None
    coverage: float | None = None
    draft_tokenizer: Tokenizer | None = None
    engine: str = "transformers"
    generation: FileGeneration | None = None

    @property
    def generation_config(self) -> GenerationConfig | FileGeneration | None:
        """The target's generation config (its sampling defaults and end-of-sequence ids): a
        transformers model's own, or on llama.cpp the GGUF file's (`FileGeneration`, under the same
        field names)."""
        if isinstance(self.target, LlamaCppModel):
            return self.generation
        return self.target.generation_config

    @property
    def draft_kind(self) -> DraftKind:
        """What proposes: "model" (a draft sharing the target's tokenizer), "mapped" (a draft with
        another tokenizer) or "lookup" (prompt lookup, no draft model)."""
        if self.draft is None:
            return "lookup"
        return "model" if self.vocab_map is None else "mapped"

    @property
    def draft_label(self) -> str | None:
        """The kind of draft in words, where the origins' names do not say it (None for a draft
        model sharing the target's tokenizer): "prompt lookup (n ≤ 3)", or "draft vocabulary
        mapped (97% coverage)"."""
        if self.draft is None:
            return f"prompt lookup (n ≤ {DEFAULT_LOOKUP_NGRAM})"
        if self.coverage is not None:
            return f"draft vocabulary mapped ({self.coverage:.0%} coverage)"
        return None

    def describe(self, *, target_only: bool = False) -> str:
        """One line: models (or prompt lookup), quantization, the kind of draft, device, dtype;
        `target_only` (autoregressive decoding, which drafts nothing) names no draft."""
        dtype = str(self.dtype).removeprefix("torch.")
        if target_only:
            draft = "target only (autoregressive), no draft"
        elif self.draft is None:
            draft = f"draft: {self.draft_label}, no draft model"
        else:
            draft = f"draft {self.draft_spec.name}{quantization_note(self.draft_spec.quantization)}"
            if self.coverage is not None:
                draft += f" · mapped vocabulary, {self.coverage:.0%} coverage"
        target = f"target {self.target_spec.name}{quantization_note(self.target_spec.quantization)}"
        if isinstance(self.target, LlamaCppModel):
            threads, batch = self.target.threads, self.target.batch_threads
            where = f"{threads} thread{'s' if threads != 1 else ''}" + (
                f", {batch} a batch" if batch != threads else ""
            )
            return f"{target} · {draft} · llama.cpp {self.device}, {where}"
        return f"{target} · {draft} · {self.device} {dtype}"

    def decoder(
        self,
        controls: Controls,
        *,
        autoregressive: bool = False,
        time_phases: bool = False,
        compiled: bool | None = None,
        whole_step: bool | None = False,
        capture_progress: Callable[[int, int], None] | None = None,
        reuse_prefix: bool = True,
    ) -> Decoder:
        """The decoder a command asked for over this pair, driven by `controls`.

        Args:
            controls: Live settings and stop requests, shared with the caller.
            autoregressive: Target-only decoding (`AutoregressiveDecoder`) instead of speculative
                decoding (`SpeculativeDecoder`).
            time_phases: Synchronise the device at each phase, for exact phase times (benchmarks;
                see `SpeculativeDecoder`).
            compiled: Compile the models' steps over static KV caches (transformers models; see
                `speculative_decoder`): True, False, or None for on a CUDA device only.
            whole_step: Each step as one function over static buffers, captured as CUDA graphs
                on CUDA (transformers models; see `speculative_decoder`): True, False, or None for
                where it is the default (`whole_step`).
            capture_progress: Called with (graphs captured, graphs in all) while they are
                captured (see `speculative_decoder`).
            reuse_prefix: Keep the KV caches (and the draft policy) from reply to reply, as one
                conversation does (see `SpeculativeDecoder`); False: every reply starts afresh.

        Raises:
            UnsupportedCacheError: a model's KV cache cannot be rolled back.
        """
        build = self.autoregressive if autoregressive else self.speculative
        return build(
            controls,
            time_phases=time_phases,
            compiled=compiled,
            whole_step=whole_step,
            capture_progress=capture_progress,
            reuse_prefix=reuse_prefix,
        )

    def whole_step(self, asked: bool | None) -> bool:
        """Whether this pair's decoders run whole steps (`fsd_chat.engines.torch_engine.step_graph`): as
        `asked` (`--whole-step`, `--no-whole-step`), or by default (None) for transformers models
        whose caches a whole step can hold (`compile_refusal` admits them), on every device. On
        the CPU it is measured no slower than the per-forward steps and faster when drafting
        (issue 45, item 5: 0.98-1.00× target-only, 1.00-1.08× speculative on the story pair and
        the default model; docs/benchmarks.md). On CUDA it is compiled, then captured (issue 45,
        item 1: inductor fuses the step, one graph replays it, as gpt-fast's and vLLM's decode
        steps), not yet timed against the per-forward steps there: `make gpu-check` times both and
        the start. Not on llama.cpp, whose runner has its own steps."""
        if asked is not None:
            return asked
        if self.engine != "transformers":
            return False
        models = [m for m in (self.target, self.draft) if m is not None]
        return all(compile_refusal(m, "--whole-step") is None for m in models)  # type: ignore[arg-type]

    def speculative(
        self,
        controls: Controls,
        *,
        time_phases: bool = False,
        compiled: bool | None = None,
        whole_step: bool | None = False,
        capture_progress: Callable[[int, int], None] | None = None,
        reuse_prefix: bool = True,
    ) -> SpeculativeDecoder:
        """A speculative decoder over this pair, driven by `controls` (`time_phases`,
        `reuse_prefix`: see `SpeculativeDecoder`; `compiled`, `whole_step`, `capture_progress`,
        for transformers models: see `speculative_decoder`; `whole_step` None: `whole_step`'s
        default); without a draft model, over prompt lookup."""
        draft = PromptLookup(DEFAULT_LOOKUP_NGRAM) if self.draft is None else self.draft
        if isinstance(self.target, LlamaCppModel):  # bound to their caches as they were loaded
            assert isinstance(draft, LlamaCppModel | PromptLookup)  # one engine a pair
            return SpeculativeDecoder(
                self.target,
                draft,
                self.tokenizer,
                timings=self.forward_timings,
                controls=controls,
                time_phases=time_phases,
                reuse_prefix=reuse_prefix,
                vocab_map=self.vocab_map,
            )
        assert not isinstance(draft, LlamaCppModel)  # one engine a pair
        return speculative_decoder(
            self.target,
            draft,
            self.tokenizer,
            timings=self.forward_timings,
            controls=controls,
            vocab_size=self.vocab_size,
            vocab_map=self.vocab_map,
            time_phases=time_phases,
            reuse_prefix=reuse_prefix,
            compiled=compiled,
            whole_step=self.whole_step(whole_step),
            capture_progress=capture_progress,
        )

    def use_threads(
        self,
        requested: int | None,
        *,
        reserve: int = 0,
        requested_batch: int | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Run on `choose_threads(requested, reserve=reserve)` CPU threads (`--threads`, or the idle
        cores less `reserve`): torch's on the CPU; on llama.cpp, llama.cpp's for one token (target
        and draft), its forwards of several on `choose_thread_counts`' second count
        (`--threads-batch`, else `--threads`, else the idle cores; transformers models take no such
        count), torch keeping one thread (its work there is a few vector operations a step, and its idle
        OpenMP threads spin for the CPU llama.cpp's threads need: two torch threads beside one
        llama.cpp thread halved target-only decoding of the default model, 31 tokens/s against
        llama.cpp's own 56, on a 2-core CPU). Nothing for transformers models on a GPU.

        On llama.cpp the pair's forward prices at these threads are then found
        (`llama_calibration.calibrated_timings`: read from this machine's cache file, or timed:
        0.9 s on the default model at the chat's split, once per file and threads; `progress` is
        told before timing). Here, because every command calls this once after loading and before
        it reads or decodes anything: the timing empties the KV caches, which hold nothing yet, and
        no reply ever waits on it (`forward_timings`). The models' KV caches are empty after.

        Raises:
            SettingsError: `requested` or `requested_batch` < 1.
        """
        if isinstance(self.target, LlamaCppModel):
            threads = choose_thread_counts(requested, requested_batch, reserve=reserve)
            for model in (self.target, self.draft):
                if isinstance(model, LlamaCppModel):
                    model.set_threads(*threads)
            torch.set_num_threads(1)
            assert self.draft is None or isinstance(self.draft, LlamaCppModel)  # one engine a pair
            self.timings = llama_calibration.calibrated_timings(self.target, self.draft, progress)
        elif self.device.type == "cpu":
            apply_threads(requested, reserve=reserve)

    def forward_timings(self) -> ForwardTimings:
        """The pair's draft and verify forward times, kept for every decoder of the pair: no clock
        during a reply, so a seed gives the same reply on every run on the machine. Transformers
        models: modelled from the models (`modelled_timings`) on the first call, a few arithmetic
        operations. llama.cpp: found by `use_threads` at the threads in use (measured on this
        machine and cached per machine, file and threads), before anything is read or decoded.

        Raises:
            RuntimeError: a llama.cpp pair whose command never called `use_threads`. Timing here
                instead would run in a reply (the first priced policy's first step, perhaps
                mid-reply) and empty the KV caches of what was read ahead; a command that sets no
                threads is a bug, found by its first priced reply.
        """
        if self.timings is None:
            if isinstance(self.target, LlamaCppModel):
                raise RuntimeError(
                    "llama.cpp's forward prices are found by ModelPair.use_threads, not called"
                )
            assert not isinstance(self.draft, LlamaCppModel)
            self.timings = modelled_timings(self.target, self.draft)
        return self.timings

    def autoregressive(
        self,
        controls: Controls,
        *,
        time_phases: bool = False,
        compiled: bool | None = None,
        whole_step: bool | None = False,
        capture_progress: Callable[[int, int], None] | None = None,
        reuse_prefix: bool = True,
    ) -> AutoregressiveDecoder:
        """A target-only decoder over this pair's target (`reuse_prefix`: see
        `AutoregressiveDecoder`; `compiled`, `whole_step`, `capture_progress`, for transformers
        models: see `autoregressive_decoder`; `whole_step` None: `whole_step`'s default)."""
        if isinstance(self.target, LlamaCppModel):  # bound to its cache as it was loaded
            return AutoregressiveDecoder(
                self.target,
                self.tokenizer,
                controls=controls,
                time_phases=time_phases,
                reuse_prefix=reuse_prefix,
            )
        return autoregressive_decoder(
            self.target,
            self.tokenizer,
            controls=controls,
            vocab_size=self.vocab_size,
            time_phases=time_phases,
            reuse_prefix=reuse_prefix,
            compiled=compiled,
            whole_step=self.whole_step(whole_step),
            capture_progress=capture_progress,
        )
