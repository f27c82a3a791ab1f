"""One timed generation per method on a loaded pair.

fsd-chat's own decoders run `autoregressive`, `exact`, `fuzzy` and `pure` (with the configuration's
draft-length policy); `hf-assisted` is transformers' assisted generation
(`generate(assistant_model=draft)`) with a constant draft length k and the assistant's confidence
early exit disabled, so both sides draft exactly k tokens per step; `hf-assisted-default` is the
same call with the assistant's generation config left as it is, i.e. transformers' defaults
(transformers 5: `num_assistant_tokens` 20, `num_assistant_tokens_schedule` "constant",
`assistant_confidence_threshold` 0.4, tuned online from a ROC curve only when scikit-learn is
installed). `hf-prompt-lookup` is transformers' prompt lookup decoding
(`generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=n)`, n = fsd-chat's lookup n-gram),
the baseline of a pair loaded with `--draft lookup`; `hf-ensemble` is `hf-assisted` with transformers' own lossy verification,
`assistant_ensemble_weight` w ("static ensemble", transformers ≥ 5.23). `hf-autoregressive` is
transformers' plain `generate` (eager, dynamic cache), and `hf-static` is
`generate(cache_implementation="static")`, which on CUDA compiles the one-token decode step
(CUDA graphs) and runs the prefill eagerly.

**transformers' own models.** transformers' methods run on a pair of their own, loaded apart from
the one fsd-chat's decoders use (`PairRunner`'s `hf`): fsd-chat compiles its models' forward
(`kv_cache.compiled_forward`) and binds them to static caches, and nothing of that may reach the
models `generate` is given, nor may transformers' own compilation (hf-static) reach fsd-chat's.
With the hf-assisted baselines run eagerly at transformers' defaults, they measure what a user of
transformers gets. hf-static runs without the forward meters' hooks (they would be traced into its
compiled step): its forward count is its tokens (one forward a token) and its forward times are not
measured.

**What an hf-ensemble token costs.** transformers' `_speculative_sampling` accepts a draft token x
iff u ≤ 1 − w + w·p(x)/q(x) = v(x)/q(x) with v = w·p + (1 − w)·q, and after a rejection draws from
norm(max(0, p − q)) = norm(max(0, v − q)): exact speculative sampling against v. So every token it
emits at a draft position (accepted, or the correction after a rejection) has law v, and the bonus
token after k acceptances has law p: costs KL(v ‖ p) and 0 — fsd-chat's `mixture` rule with one
fixed λ = 1 − w instead of the largest λ within a per-token budget. `EnsembleTrace` records the very
p and q rows its verification used (a wrapper around `_speculative_sampling` that only keeps
references; the costs are computed after the clock stops), so the cost is exact, not re-derived.
Greedy, transformers accepts x iff x = argmax v and corrects with argmax v (bonus: argmax p); a
greedy token's cost is its regret log p(argmax p) − log p(x), a function of the text and the target
alone, computed from one target forward over the reply after the run.

Wall-clock time covers the whole call, prompt prefill included, for every method alike (transformers
does not separate its prefill from the first verification).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from fsd_chat.bench.llama_baselines import baseline_llama, llama_generate
from fsd_chat.bench.meter import ForwardMeter, RunnerMeter
from fsd_chat.bench.quality import reply_logits
from fsd_chat.bench.records import (
    HF_ASSISTED,
    HF_METHODS,
    LLAMA_CPP_METHODS,
    RULE_OF,
    UNMETERED,
    Configuration,
    ForwardTally,
    Generation,
    Method,
)
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig
from fsd_chat.decoding.divergence import kl
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.decoding.reply import eos_token_ids
from fsd_chat.decoding.runner import ModelRunner
from fsd_chat.decoding.settings import DEFAULT_LOOKUP_NGRAM
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.engines.llama_cpp import LlamaCppModel
from fsd_chat.engines.torch_engine.kv_cache import context_length
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import IncompatibleModelsError

if TYPE_CHECKING:  # the modeling stack (torch._dynamo with it): imported by the torch engine alone
    from transformers import PreTrainedModel


@dataclass(slots=True)
class FirstToken:
    """The time to first token of a reply: wall-clock seconds from this object's making (just
    before the call) to the first `seen` (None until then)."""

    began: float = field(default_factory=time.perf_counter)
    seconds: float | None = None

    def seen(self) -> None:
        """A token has arrived: the first one's time is kept."""
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.began


@dataclass(frozen=True, slots=True)
class Deadline:
    """The time (`time.monotonic`) by which a reply must stop, checked between its steps: fsd-chat's
    decoders stop at the next step, transformers' `generate` at its next stopping check."""

    at: float

    @classmethod
    def after(cls, seconds: float | None) -> Deadline | None:
        """The deadline `seconds` from now (None: none)."""
        return None if seconds is None else cls(time.monotonic() + seconds)

    def passed(self) -> bool:
        """Whether the time is up."""
        return time.monotonic() >= self.at


def _deadline_criteria(deadline: Deadline) -> Any:
    """transformers' stopping criteria for a `Deadline`: every sequence is done once it passed
    (transformers imported here: the bench on llama.cpp runs without it)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class DeadlineCriteria(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return torch.full(
                (input_ids.shape[0],), deadline.passed(), dtype=torch.bool, device=input_ids.device
            )

    return StoppingCriteriaList([DeadlineCriteria()])


@contextmanager
def assistant_settings(pair: ModelPair, k: int | None) -> Iterator[None]:
    """Set the draft's generation config for assisted generation with exactly k draft tokens per
    step (transformers 5 reads these from the *assistant's* config), and restore it afterwards;
    k None leaves it as it is (transformers' defaults)."""
    if k is None or pair.draft is None or isinstance(pair.draft, LlamaCppModel):
        yield
        return
    config = pair.draft.generation_config
    wanted = {
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        # 0 disables the confidence-based early exit (a threshold of 0 is falsy in transformers).
        "assistant_confidence_threshold": 0.0,
    }
    saved = {key: getattr(config, key, None) for key in wanted}
    for key, value in wanted.items():
        setattr(config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


@dataclass
class EnsembleTrace:
    """What transformers' speculative sampling saw at each step (while `recording`): the draft's
    processed logits [1, γ, vocab], the target's [1, γ + 1, vocab] and the accepted count n."""

    steps: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Wrap `transformers.generation.utils._speculative_sampling` (looked up by name at each
        step of assisted generation) for the duration."""
        # Imported here: transformers' generation stack, which only its own baselines run.
        from transformers.generation import utils as generation_utils

        original = generation_utils._speculative_sampling

        def traced(
            candidate_input_ids: torch.Tensor,
            candidate_logits: torch.Tensor,
            candidate_length: int,
            new_logits: torch.Tensor,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            tokens, n = original(
                candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs
            )
            # n is already on the host: transformers branches on it.
            self.steps.append((candidate_logits, new_logits, int(n)))
            return tokens, n

        with mock.patch.object(generation_utils, "_speculative_sampling", traced):
            yield

    def costs(self, weight: float) -> list[float]:
        """Each emitted token's cost in nats, in order: KL(v ‖ p) at the n accepted positions and at
        the correction (v = w·p + (1 − w)·q), 0 for a bonus token (see the module docstring)."""
        emitted: list[float] = []
        for candidate_logits, new_logits, n in self.steps:
            q = candidate_logits[0].float().softmax(-1)
            p = new_logits[0, : q.shape[0]].float().softmax(-1)
            position = kl(weight * p + (1 - weight) * q, p).tolist()
            emitted += position[: n + 1] if n < len(position) else [*position, 0.0]
        return emitted


@torch.inference_mode()
def greedy_regrets(
    target: PreTrainedModel | ModelRunner, vocab_size: int, prompt_ids: list[int], reply_ids: list[int]
) -> list[float]:
    """Each reply token's regret log p(argmax p) − log p(x) under the target (temperature 1), nats,
    teacher-forced over prompt + reply (`reply_logits`)."""
    log_p = reply_logits(target, vocab_size, prompt_ids, reply_ids).log_softmax(-1)
    chosen = log_p.gather(-1, torch.tensor(reply_ids, device=log_p.device).unsqueeze(-1)).squeeze(-1)
    regrets: list[float] = (log_p.max(-1).values - chosen).clamp_min(0.0).tolist()
    return regrets


class PairRunner:
    """Runs any configuration's method on one loaded pair, metering both models' forward passes.

    Args:
        pair: The loaded pair (its setup is the configurations'), for fsd-chat's decoders.
        hf: The same pair loaded apart, for transformers' methods (see the module docstring); None:
            `pair` itself (when no compiled decoder has touched it, as in a timing pass).
        whole_step: fsd-chat's decoders run each step as one function over static buffers
            (`--whole-step`: a captured graph a step on CUDA), target-only decoding included.
    """

    def __init__(self, pair: ModelPair, hf: ModelPair | None = None, *, whole_step: bool = False) -> None:
        self.pair = pair
        self.whole_step = whole_step
        self.hf = hf or pair
        # Prompt lookup has no draft model; a mapped draft's EOS ids are in its own vocabulary:
        # only the target's end a reply then.
        shared = [pair.draft] if pair.draft is not None and pair.draft_kind == "model" else []
        self.eos = eos_token_ids(pair.tokenizer, pair.target, *shared)
        self.context = context_length(pair.target)
        self._meters = {id(pair): self._pair_meters(pair)}
        self._llamas: dict[tuple[Method, int | None], Any] = {}
        """llama.cpp's baselines' own `Llama`s, opened at their first run (`llama_baselines`)."""
        # Under --whole-step, one decoder a configuration: its graphs (about ten on CUDA, each with
        # its static buffers) are captured once, as the chat captures them once at load, rather
        # than at every reply.
        self._whole_step_decoders: dict[Configuration, Decoder] = {}
        if self.hf is not pair:
            self._meters[id(self.hf)] = self._pair_meters(self.hf)

    @staticmethod
    def _pair_meters(
        pair: ModelPair,
    ) -> tuple[ForwardMeter | RunnerMeter, ForwardMeter | RunnerMeter | None]:
        def meter(model: PreTrainedModel | LlamaCppModel) -> ForwardMeter | RunnerMeter:
            return (
                RunnerMeter(model) if isinstance(model, LlamaCppModel) else ForwardMeter(model, pair.device)
            )

        # Prompt lookup runs no draft model: its tally stays empty.
        return meter(pair.target), None if pair.draft is None else meter(pair.draft)

    def run(
        self,
        config: Configuration,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        seed: int,
        stop_strings: tuple[str, ...],
        deadline: Deadline | None = None,
    ) -> Generation:
        """Generate a reply to `prompt_ids` with `config`'s method and time it; past `deadline`, the
        reply stops at its next step."""
        sampling = SamplingConfig(
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            min_p=config.min_p,
            seed=seed,
        )
        # Built before the meters start: a decoder's KV caches run a probe forward pass when they
        # are made (`CachedModel`), which is no part of the reply (the chat builds its decoder once).
        decoder = self._decoder(config)
        self._empty_llama_caches(config)
        target_meter, draft_meter = self._meters[id(self.hf if config.method in HF_METHODS else self.pair)]
        static = config.method in UNMETERED
        # llama.cpp's baselines run on `Llama`s of their own, which meter their own passes.
        own = static or config.method in LLAMA_CPP_METHODS
        target = ForwardTally() if own else target_meter.start()
        draft = draft_meter.start() if draft_meter is not None else ForwardTally()
        try:
            with target_meter.detached() if own else nullcontext():
                generation = self._run(
                    config,
                    decoder,
                    prompt_ids,
                    sampling,
                    max_new_tokens,
                    stop_strings,
                    target,
                    draft,
                    deadline,
                )
        finally:
            target_meter.stop()
            if draft_meter is not None:
                draft_meter.stop()
        if static:
            # One forward a token, the prefill's included (unmetered: see the module docstring).
            target.calls = len(generation.token_ids)
        if config.method == "hf-ensemble" and sampling.greedy and generation.token_ids:
            # After the meters stop: this forward pass is no part of the run.
            costs = greedy_regrets(self.hf.target, self.hf.vocab_size, prompt_ids, generation.token_ids)
            generation = replace(generation, costs=costs)
        return generation

    def _decoder(self, config: Configuration) -> Decoder | None:
        """fsd-chat's decoder for `config` (None for transformers' and llama.cpp's methods, which decode
        alone; a llama.cpp baseline's `Llama` is opened here, before any clock starts)."""
        if config.method in LLAMA_CPP_METHODS:
            self._llama(config)  # opened here, before the clock starts: no part of the reply
            return None
        if config.method in HF_METHODS:
            return None
        defaults = DecodingSettings()
        controls = Controls(
            DecodingSettings(
                rule=RULE_OF.get(config.method, "exact"),  # the autoregressive decoder has none
                divergence=config.divergence or defaults.divergence,
                threshold=config.threshold or 0.0,
                draft_tokens=config.draft_tokens or defaults.draft_tokens,
                draft_policy=config.draft_policy,
            )
        )
        if config.draft_policy in ("latency", "goodput"):
            self.pair.forward_timings()  # modelled once per pair, before any meter starts
        # No synchronisation per phase (time_phases): on CUDA it would stall every phase, a cost
        # transformers' rows do not pay; `bench --profile` says where a step's time goes instead.
        # A decoder a reply, but under --whole-step one a configuration, kept from reply to reply:
        # its graphs are captured once, here, before the meters start (untimed, as the chat
        # captures them at load). Every reply starts afresh all the same (`reuse_prefix` off: empty
        # KV caches, a new draft policy), as llama.cpp's baselines do (`_empty_llama_caches`): the
        # prompts are separate conversations, and a kept cache would prefill only what a prompt
        # did not share with the last one (a chat template's opening), timing less than the reply.
        kept = self._whole_step_decoders.get(config) if self.whole_step else None
        if kept is not None:
            return kept
        decoder = self.pair.decoder(
            controls,
            autoregressive=config.method == "autoregressive",
            time_phases=False,
            whole_step=self.whole_step,
            reuse_prefix=False,
        )
        if self.whole_step:
            self._whole_step_decoders[config] = decoder
        return decoder

    def _run(
        self,
        config: Configuration,
        decoder: Decoder | None,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        max_new_tokens: int,
        stop_strings: tuple[str, ...],
        target: ForwardTally,
        draft: ForwardTally,
        deadline: Deadline | None,
    ) -> Generation:
        if config.method in HF_ASSISTED:
            weight = config.threshold if config.method == "hf-ensemble" else None
            trace = EnsembleTrace()
            clock = PhaseClock(self.pair.device)
            with (
                assistant_settings(self.hf, config.draft_tokens),
                trace.recording() if weight is not None else nullcontext(),
            ):
                ids = self._hf_generate(
                    prompt_ids,
                    {"assistant_model": self.hf.draft},
                    sampling,
                    max_new_tokens,
                    stop_strings,
                    weight,
                    deadline,
                )
            seconds = clock.lap()
            costs = None
            if weight is not None and not sampling.greedy:
                # A last token drawn with no room left to draft comes from p (cost 0), unrecorded.
                costs = (trace.costs(weight) + [0.0] * len(ids))[: len(ids)]
            return Generation(ids, seconds, None, target, draft, costs)
        if config.method in LLAMA_CPP_METHODS:
            clock = PhaseClock(self.pair.device)
            first = FirstToken()
            ids = []
            for token in llama_generate(
                self._llama(config),
                prompt_ids,
                sampling,
                max_new_tokens=max_new_tokens,
                eos=self.eos,
                stop_strings=stop_strings,
                tally=target,
                stop=(lambda: False) if deadline is None else deadline.passed,
            ):
                first.seen()
                ids.append(token)
            return Generation(ids, clock.lap(), None, target, draft, first_token_seconds=first.seconds)
        if config.method in HF_METHODS:  # transformers' decoding without a draft model
            clock = PhaseClock(self.hf.device)
            ids = self._hf_generate(
                prompt_ids,
                HF_DECODING[config.method](config),
                sampling,
                max_new_tokens,
                stop_strings,
                None,
                deadline,
            )
            return Generation(ids, clock.lap(), None, target, draft)
        assert decoder is not None  # every method but transformers' has one (`_decoder`)
        stats = GenerationStats()
        ids = []
        clock = PhaseClock(self.pair.device)
        first = FirstToken()
        for step in decoder.generate(
            prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings
        ):
            stats.add(step)
            if step.tokens:
                first.seen()
            ids += [t.id for t in step.tokens]
            if deadline is not None and deadline.passed():
                break
        return Generation(ids, clock.lap(), stats, target, draft, first_token_seconds=first.seconds)

    def _empty_llama_caches(self, config: Configuration) -> None:
        """Every reply reads its whole prompt, as fsd-chat's decoders do (`reuse_prefix` off): a
        llama.cpp baseline's `Llama` keeps its own KV cache, so a reply would otherwise find its
        prompt read by the run before it, and one method of a prompt's would pay for the others'
        prefill."""
        if config.method in LLAMA_CPP_METHODS:
            self._llama(config).reset()

    def _llama(self, config: Configuration) -> Any:
        """The `Llama` of a llama.cpp baseline, opened at its first run (one a k for
        llama.cpp-lookup, whose k is set when it is made)."""
        if not isinstance(self.pair.target, LlamaCppModel):
            raise IncompatibleModelsError(
                f"the {config.method} baseline runs a GGUF file on llama.cpp: bench a GGUF target with "
                "--engine llama.cpp (or auto), or leave it out of --baselines"
            )
        lookup = config.draft_tokens if config.method == "llama.cpp-lookup" else None
        llama = self._llamas.get((config.method, lookup))
        if llama is None:
            llama = self._llamas[config.method, lookup] = baseline_llama(self.pair.target, lookup)
        return llama

    def _hf_generate(
        self,
        prompt_ids: list[int],
        drafting: dict[str, Any],
        sampling: SamplingConfig,
        max_new_tokens: int,
        stop_strings: tuple[str, ...],
        ensemble_weight: float | None,
        deadline: Deadline | None,
    ) -> list[int]:
        pair = self.hf
        if self.context is not None:
            max_new_tokens = min(max_new_tokens, self.context - len(prompt_ids))
        input_ids = torch.tensor([prompt_ids], device=pair.device)
        if sampling.greedy:
            options: dict[str, Any] = {"do_sample": False}
        else:
            # The same truncation as fsd-chat's (top_k=0 switches off an older default top-k of 50).
            options = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "min_p": sampling.min_p or None,
            }
            torch.manual_seed(sampling.seed or 0)  # transformers draws from torch's global generator
        if stop_strings:
            options |= {"stop_strings": list(stop_strings), "tokenizer": pair.tokenizer}
        if deadline is not None:
            options["stopping_criteria"] = _deadline_criteria(deadline)
        if pair.vocab_map is not None and "assistant_model" in drafting:
            if pair.vocab_map.draft_vocab == pair.vocab_size:
                # transformers takes a draft whose vocabulary has the target's size for one that
                # shares its tokenizer, and would feed it the target's ids.
                raise IncompatibleModelsError(
                    "transformers' assisted generation cannot run a draft with another tokenizer of the "
                    "target's vocabulary size: leave hf-assisted out of --baselines"
                )
            if not sampling.greedy and len(pair.vocab_map.draft_ids) == pair.vocab_map.draft_vocab:
                # transformers 5.24's sampling path (UniversalSpeculativeDecodingGenerator) prunes
                # the draft's LM head only when some draft token is missing from the target's
                # vocabulary, then reads the pruned ids anyway: AttributeError
                # ('AssistantToTargetTranslator' ... 'assistant_overlap_token_ids').
                raise IncompatibleModelsError(
                    "transformers' universal assisted generation cannot sample with a draft whose every "
                    "token is in the target's vocabulary (transformers fails): leave hf-assisted out of "
                    "--baselines, or use --temperature 0"
                )
            # transformers' universal assisted generation: the draft's text re-tokenised for it.
            options |= {"tokenizer": pair.tokenizer, "assistant_tokenizer": pair.draft_tokenizer}
        if isinstance(pair.target, LlamaCppModel):
            raise IncompatibleModelsError(
                "transformers' baselines run transformers models: leave the hf-* methods out of --baselines "
                "with --engine llama.cpp"
            )
        with torch.inference_mode():
            # Causal LMs mix in GenerationMixin; PreTrainedModel's type does not declare `generate`.
            out = pair.target.generate(  # type: ignore[operator]
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **drafting,
                max_new_tokens=max_new_tokens,
                pad_token_id=min(self.eos) if self.eos else None,
                assistant_ensemble_weight=ensemble_weight,
                **options,
            )
        ids: list[int] = out[0, len(prompt_ids) :].tolist()
        end = next((i for i, token in enumerate(ids) if token in self.eos), len(ids))
        return ids[:end]

    def close(self) -> None:
        """Remove the forward hooks from the models."""
        for meters in self._meters.values():
            for meter in meters:
                if meter is not None:
                    meter.close()
        for llama in self._llamas.values():
            llama.close()
        self._llamas.clear()


HF_DECODING: dict[str, Callable[[Configuration], dict[str, Any]]] = {
    "hf-prompt-lookup": lambda config: {
        "prompt_lookup_num_tokens": config.draft_tokens,
        "max_matching_ngram_size": DEFAULT_LOOKUP_NGRAM,
    },
    "hf-autoregressive": lambda _config: {},
    "hf-static": lambda _config: {"cache_implementation": "static"},
}
"""`generate`'s options of transformers' methods without a draft model."""
