"""The sweep: every configuration on every prompt, interleaved.

For each prompt (and repeat), all configurations run back to back, in an order rotated by one from
one prompt to the next, so that drift of the machine (other processes, thermal state) falls on
every configuration alike and no configuration always runs first. Every configuration runs once,
untimed, on a short reply before measuring starts (first-call allocations, lazy initialisation and
compilation), whose seconds are recorded; so are the graphs torch.compile compiles during a
configuration's measured replies (torch._dynamo's counters: 0 when compilation stayed in the
warm-up). Under a time budget (`cut_after`), a configuration whose warm-up, or whose measured
replies together, run past it is cut: the reply is stopped at its next step (`Deadline`), dropped,
and the configuration runs no more, so one that stalls (compiling at every new shape) cannot hold
up the sweep. A KeyboardInterrupt (Ctrl-C, or SIGTERM within `support.interrupts.interrupts`) ends the sweep early
and keeps what was measured.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsd_chat.bench.methods import Deadline, PairRunner
from fsd_chat.bench.profile import profile_reply
from fsd_chat.bench.prompts import PromptSet
from fsd_chat.bench.quality import target_nll
from fsd_chat.bench.records import (
    HF_METHODS,
    Configuration,
    ConfigurationRecord,
    Measurement,
    Setup,
    SweepResult,
)
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.interrupts import exit_status

WARMUP_TOKENS = 8
TIMED_TOKENS = 40
"""Tokens of the longer of the two target-only replies that `time_target_only` times."""


@dataclass(frozen=True, slots=True)
class Timing:
    """Greedy target-only decoding's wall clock on a pair: a run's fixed seconds (building the
    decoder, the prefill, the call, scoring the reply) and the seconds a generated token adds."""

    per_run: float
    per_token: float

    def estimate(self, configs: int, prompts: int, repeats: int, max_new_tokens: int) -> float:
        """The sweep's seconds if every configuration decoded every reply to its cap at this speed,
        warm-ups included: speculative methods are usually faster than target-only decoding and
        replies that end early are shorter, so it errs long (quality scoring aside)."""
        runs = prompts * repeats
        return configs * (
            (runs + 1) * self.per_run + (runs * max_new_tokens + WARMUP_TOKENS) * self.per_token
        )


OnRun = Callable[[Configuration, str], None]
"""Called after every generation with its configuration and "warm-up" or "measure", with "cut" when
a configuration is cut, and "skip" for each of its replies not run after that."""


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (torch._dynamo's counter): none in
    a process that never imported torch._dynamo (a llama.cpp one), which is not imported for it."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def time_target_only(pair: ModelPair, setup: Setup, prompt: list[int], *, whole_step: bool = False) -> Timing:
    """Time greedy target-only decoding of `prompt` (shape [prompt tokens]) on `pair`: after an
    untimed warm-up, a `WARMUP_TOKENS` and a `TIMED_TOKENS` reply, whose difference is the tokens'
    cost and the rest each run's (a reply that ends early at EOS counts what it generated), to which
    the scoring of a run's reply (`target_nll`) is added. `whole_step`: time whole steps (captured
    graphs on CUDA, seconds to make) rather than compiled steps (torch.compile, which can take
    minutes on CUDA and leaves its state in the process)."""
    runner = PairRunner(pair, whole_step=whole_step)
    config = Configuration(setup, 0.0, "autoregressive")
    try:
        runner.run(config, prompt, max_new_tokens=WARMUP_TOKENS, seed=0, stop_strings=())
        short, long = (
            runner.run(config, prompt, max_new_tokens=n, seed=0, stop_strings=())
            for n in (WARMUP_TOKENS, TIMED_TOKENS)
        )
    finally:
        runner.close()
    extra_tokens = len(long.token_ids) - len(short.token_ids)
    # Timing noise can make the longer run no slower: then charge it all to its tokens.
    per_token = (long.seconds - short.seconds) / extra_tokens if extra_tokens > 0 else 0.0
    if per_token <= 0:
        per_token = long.seconds / max(len(long.token_ids), 1)
    start = time.perf_counter()
    target_nll(pair.target, pair.vocab_size, prompt, long.token_ids)
    scoring = time.perf_counter() - start
    return Timing(max(short.seconds - per_token * len(short.token_ids), 0.0) + scoring, per_token)


def run_sweep(
    pairs: dict[Setup, ModelPair],
    configs: list[Configuration],
    prompt_set: PromptSet,
    *,
    max_new_tokens: int,
    seed: int,
    repeats: int,
    on_run: OnRun | None = None,
    hf_pairs: dict[Setup, ModelPair] | None = None,
    cut_after: float | None = None,
    warmup_cut_after: float | None = None,
    whole_step: bool | None = False,
    profile: bool = False,
    bandwidth: float | None = None,
) -> SweepResult:
    """Run every configuration on every prompt `repeats` times; quality is scored by the target
    of the first setup (so that quantized or low-precision setups are judged by one reference).

    Prompt i is decoded with seed `seed + i` by every configuration (common random numbers: the
    configurations start from the same random stream, so paired comparisons are less noisy; exact SD
    and transformers' assisted generation, which draw in the same order, then emit the same samples).

    Args:
        hf_pairs: The models transformers' methods run on, loaded apart from `pairs` (see
            `PairRunner`); None: the same models.
        cut_after: Each configuration's time budget in seconds for its measured replies together
            (None: none; see the module docstring).
        warmup_cut_after: The same for its warm-up reply, which compiles (None: `cut_after`).
        whole_step: fsd-chat's decoders run whole steps (see `PairRunner`; None: each pair's
            default, `ModelPair.whole_step`).
        profile: After the measured replies, one more reply of each fsd-chat configuration not cut
            (the first prompt) under torch.profiler (`bench.profile`), into its record.
        bandwidth: The device's copy bandwidth, bytes/s, for the profiles' bandwidth use.
    """
    notify = on_run or (lambda _config, _phase: None)
    scorer = next(iter(pairs.values()))
    hf = hf_pairs or {}
    runners = {
        setup: PairRunner(pair, hf=hf.get(setup), whole_step=pair.whole_step(whole_step))
        for setup, pair in pairs.items()
    }
    ids = [prompt_ids(scorer.tokenizer, [Message("user", item.text)]) for item in prompt_set.items]
    runs: list[Measurement] = []
    records = {config: ConfigurationRecord() for config in configs}

    warmup_budget = cut_after if warmup_cut_after is None else warmup_cut_after

    def over(seconds: float, budget: float | None) -> bool:
        return budget is not None and seconds > budget

    try:
        for config in configs:
            record = records[config]
            start = time.perf_counter()
            # transformers sizes hf-static's cache to the longest reply asked for so far and compiles
            # its step for that size: warmed up on the longest prompt to the token cap, its measured
            # replies compile nothing.
            static = config.method == "hf-static"
            runners[config.setup].run(
                config,
                max(ids, key=len) if static else ids[0],
                max_new_tokens=max_new_tokens if static else WARMUP_TOKENS,
                seed=seed,
                stop_strings=prompt_set.stop_strings,
                deadline=Deadline.after(warmup_budget),
            )
            record.warmup_seconds = time.perf_counter() - start
            record.cut = over(record.warmup_seconds, warmup_budget)
            notify(config, "cut" if record.cut else "warm-up")
        trial = 0
        for index, item in enumerate(prompt_set.items):
            for repeat in range(repeats):
                shift = trial % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    record = records[config]
                    if record.cut:
                        notify(config, "skip")
                        continue
                    graphs = compiled_graphs()
                    start = time.perf_counter()
                    generation = runners[config.setup].run(
                        config,
                        ids[index],
                        max_new_tokens=max_new_tokens,
                        seed=seed + index,
                        stop_strings=prompt_set.stop_strings,
                        deadline=Deadline.after(
                            None if cut_after is None else cut_after - record.measured_seconds
                        ),
                    )
                    record.measured_seconds += time.perf_counter() - start
                    record.compiled_graphs += compiled_graphs() - graphs
                    if over(record.measured_seconds, cut_after):
                        # A reply stopped midway is no measurement of the configuration's replies.
                        record.cut = True
                        notify(config, "cut")
                        continue
                    correct = None
                    if prompt_set.checker is not None and item.answer is not None:
                        text = scorer.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
                        assert isinstance(text, str)  # a list only for batched input
                        correct = prompt_set.checker(text, item.answer)
                    nll = target_nll(scorer.target, scorer.vocab_size, ids[index], generation.token_ids)
                    runs.append(Measurement(config, index, repeat, ids[index], generation, nll, correct))
                    notify(config, "measure")
                trial += 1
        if profile:
            for config in configs:
                record = records[config]
                if record.cut or config.method in HF_METHODS:
                    continue
                pair = pairs[config.setup]
                runner = runners[config.setup]
                draft = pair.draft if pair.draft_kind == "model" else None
                # torch.profiler sees no kernel inside llama.cpp: its rows go unprofiled.
                if not isinstance(pair.target, torch.nn.Module) or not isinstance(
                    draft, torch.nn.Module | None
                ):
                    continue
                record.profile = profile_reply(
                    functools.partial(
                        runner.run,
                        config,
                        ids[0],
                        max_new_tokens=max_new_tokens,
                        seed=seed,
                        stop_strings=prompt_set.stop_strings,
                    ),
                    pair.device,
                    pair.target,
                    draft,
                    bandwidth,
                )
    except KeyboardInterrupt as interrupt:
        return SweepResult(runs, exit_status(interrupt), records, cut_after)
    finally:
        for runner in runners.values():
            runner.close()
    return SweepResult(runs, records=records, cut_after=cut_after)
