"""One timed generation per method on a loaded pair.

fsd-chat's own decoders run `autoregressive`, `exact`, `fuzzy` and `pure` (with the configuration's
draft-length policy); `hf-assisted` is transformers' assisted generation
(`generate(assistant_model=draft)`) with a constant draft length k and the assistant's confidence
early exit disabled, so both sides draft exactly k tokens per step; `hf-assisted-default` is the
same call with the assistant's generation config left as it is, i.e. transformers' defaults
(transformers 5: `num_assistant_tokens` 20, `num_assistant_tokens_schedule` "constant",
`assistant_confidence_threshold` 0.4, tuned online from a ROC curve only when scikit-learn is
installed).
Wall-clock time covers the whole call, prompt prefill included, for every method alike (transformers
does not separate its prefill from the first verification).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fsd_chat.bench.meter import ForwardMeter
from fsd_chat.bench.records import RULE_OF, Configuration, ForwardTally, Generation
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig
from fsd_chat.decoding.kv_cache import context_length
from fsd_chat.decoding.reply import eos_token_ids
from fsd_chat.decoding.timing import PhaseClock
from fsd_chat.errors import IncompatibleModelsError
from fsd_chat.models import ModelPair


@contextmanager
def assistant_settings(pair: ModelPair, k: int | None) -> Iterator[None]:
    """Set the draft's generation config for assisted generation with exactly k draft tokens per
    step (transformers 5 reads these from the *assistant's* config), and restore it afterwards;
    k None leaves it as it is (transformers' defaults)."""
    if k is None:
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


class PairRunner:
    """Runs any configuration's method on one loaded pair, metering both models' forward passes.

    Args:
        pair: The loaded pair (its setup is the configurations').
    """

    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        # A mapped draft's EOS ids are in its own vocabulary: only the target's end a reply.
        self.eos = eos_token_ids(
            pair.tokenizer, pair.target, *([pair.draft] if pair.vocab_map is None else [])
        )
        self.context = context_length(pair.target)
        self._target_meter = ForwardMeter(pair.target, pair.device)
        self._draft_meter = ForwardMeter(pair.draft, pair.device)

    def run(
        self,
        config: Configuration,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        seed: int,
        stop_strings: tuple[str, ...],
    ) -> Generation:
        """Generate a reply to `prompt_ids` with `config`'s method and time it."""
        sampling = SamplingConfig(temperature=config.temperature, seed=seed)
        target, draft = self._target_meter.start(), self._draft_meter.start()
        try:
            return self._run(config, prompt_ids, sampling, max_new_tokens, stop_strings, target, draft)
        finally:
            self._target_meter.stop()
            self._draft_meter.stop()

    def _run(
        self,
        config: Configuration,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        max_new_tokens: int,
        stop_strings: tuple[str, ...],
        target: ForwardTally,
        draft: ForwardTally,
    ) -> Generation:
        if config.method in ("hf-assisted", "hf-assisted-default"):
            clock = PhaseClock(self.pair.device)
            ids = self._hf_assisted(prompt_ids, config.draft_tokens, sampling, max_new_tokens, stop_strings)
            return Generation(ids, clock.lap(), None, target, draft)
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
        # Exact phase times on CUDA: the report splits draft, target and other seconds.
        decoder = self.pair.decoder(
            controls, autoregressive=config.method == "autoregressive", time_phases=True
        )
        stats = GenerationStats()
        ids = []
        clock = PhaseClock(self.pair.device)
        for step in decoder.generate(
            prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop_strings
        ):
            stats.add(step)
            ids += [t.id for t in step.tokens]
        return Generation(ids, clock.lap(), stats, target, draft)

    def _hf_assisted(
        self,
        prompt_ids: list[int],
        k: int | None,
        sampling: SamplingConfig,
        max_new_tokens: int,
        stop_strings: tuple[str, ...],
    ) -> list[int]:
        pair = self.pair
        if self.context is not None:
            max_new_tokens = min(max_new_tokens, self.context - len(prompt_ids))
        input_ids = torch.tensor([prompt_ids], device=pair.device)
        if sampling.greedy:
            options: dict[str, Any] = {"do_sample": False}
        else:
            # top_k=0 switches off transformers' default top-k of 50: fsd-chat samples the full vocabulary.
            options = {"do_sample": True, "temperature": sampling.temperature, "top_k": 0, "top_p": 1.0}
            torch.manual_seed(sampling.seed or 0)  # transformers draws from torch's global generator
        if stop_strings:
            options |= {"stop_strings": list(stop_strings), "tokenizer": pair.tokenizer}
        if pair.vocab_map is not None:
            if pair.vocab_map.draft_vocab == pair.vocab_size:
                # transformers takes a draft whose vocabulary has the target's size for one that
                # shares its tokenizer, and would feed it the target's ids.
                raise IncompatibleModelsError(
                    "transformers' assisted generation cannot run a draft with another tokenizer of the "
                    "target's vocabulary size: leave hf-assisted out of --baselines"
                )
            # transformers' universal assisted generation: the draft's text re-tokenised for it.
            options |= {"tokenizer": pair.tokenizer, "assistant_tokenizer": pair.draft_tokenizer}
        with assistant_settings(pair, k), torch.inference_mode():
            # Causal LMs mix in GenerationMixin; PreTrainedModel's type does not declare `generate`.
            out = pair.target.generate(  # type: ignore[operator]
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=pair.draft,
                max_new_tokens=max_new_tokens,
                pad_token_id=min(self.eos) if self.eos else None,
                **options,
            )
        ids: list[int] = out[0, len(prompt_ids) :].tolist()
        end = next((i for i, token in enumerate(ids) if token in self.eos), len(ids))
        return ids[:end]

    def close(self) -> None:
        """Remove the forward hooks from the models."""
        self._target_meter.close()
        self._draft_meter.close()
