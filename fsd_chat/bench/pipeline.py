"""One `fsd-chat bench` run: check the inputs, load the setups, sweep with a progress bar, write
report.json, report.md and tradeoff.png, and show the table and plots on the terminal."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.status import Status
from rich.text import Text

from fsd_chat.bench import plot, report, terminal
from fsd_chat.bench.advice import advise
from fsd_chat.bench.curves import compare_curves
from fsd_chat.bench.environment import environment
from fsd_chat.bench.metrics import summarize
from fsd_chat.bench.profile import copy_bandwidth, profile_table
from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.records import (
    HF_ASSISTED,
    HF_METHODS,
    Configuration,
    ConfigurationRecord,
    Measurement,
    Setup,
)
from fsd_chat.bench.runner import WARMUP_TOKENS, OnRun, Timing, run_sweep, time_target_only
from fsd_chat.bench.sweep import SweepSpec, build_sweep
from fsd_chat.decoding.settings import LOOKUP, SamplingConfig, SamplingRequest, check_max_new_tokens
from fsd_chat.engines.llama_cpp import LlamaCppModel
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.devices import resolve_device, resolve_dtype
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import Engine, LoadOptions, ModelSpec, pair_specs
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.errors import FsdChatError
from fsd_chat.support.interrupts import interrupts
from fsd_chat.support.text import visible
from fsd_chat.support.threads import apply_threads

PROGRESS_COLUMNS = (
    TextColumn("{task.description}"),
    BarColumn(),
    MofNCompleteColumn(),
    TimeElapsedColumn(),
    TimeRemainingColumn(),
)


def _sweep_record(
    spec: SweepSpec, prompts: str, count: int, max_new_tokens: int, seed: int, repeats: int
) -> dict[str, object]:
    """What was asked for, as report.json's `sweep`."""
    return {
        "prompts": prompts,
        "prompt_count": count,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "repeats": repeats,
        **asdict(spec),
    }


@dataclass(frozen=True, slots=True)
class TimeBudget:
    """A time promise (`--quick`'s): the sweep's seconds, and which counts the preset chose (and so
    may be cut to keep it; counts given on the command line are kept)."""

    seconds: float
    prompts: bool
    tokens: bool


QUICK_BUDGET_SECONDS = 480.0
"""--quick's sweep: 10 minutes less one for loading and writing the reports, and one for a machine
that slows as the sweep runs (on a 2-core CPU shared with other work, target-only decoding was
measured 50% slower mid-sweep than when timed before it)."""
MIN_PROMPTS = 6
"""The fewest prompts a cut leaves: a speed-up's interval needs 6 (`stats.median_with_ci95`)."""
MIN_TOKENS = 32
"""The shortest token cap a cut leaves."""


def fit(
    budget: TimeBudget, timing: Timing, configs: int, prompts: int, repeats: int, max_new_tokens: int
) -> tuple[int, int]:
    """The prompt count and token cap that keep `timing.estimate` within the budget: the cap cut
    first (down to `MIN_TOKENS`), then the prompts (down to `MIN_PROMPTS`), each only where the
    preset chose it and never up; it may still run over."""
    each = budget.seconds / configs  # a configuration's share, its warm-up's run and tokens aside
    afford = each - timing.per_run - WARMUP_TOKENS * timing.per_token
    if budget.tokens and timing.estimate(configs, prompts, repeats, max_new_tokens) > budget.seconds:
        tokens = (afford / (prompts * repeats) - timing.per_run) / timing.per_token
        max_new_tokens = max(min(max_new_tokens, int(tokens)), min(MIN_TOKENS, max_new_tokens))
    if budget.prompts and timing.estimate(configs, prompts, repeats, max_new_tokens) > budget.seconds:
        runs = afford / (timing.per_run + max_new_tokens * timing.per_token)
        prompts = max(min(prompts, int(runs / repeats)), min(MIN_PROMPTS, prompts))
    return prompts, max_new_tokens


CUT_FACTOR = 4.0
"""A configuration is cut once its measured replies take this many times what target-only decoding
would take for them at its timed speed (`Timing.estimate` of one configuration)..."""
MIN_CUT_SECONDS = 30.0
"""...but never before this many seconds (timing noise, a slow first prompt)."""
WARMUP_CUT_SECONDS = 180.0
"""A configuration's warm-up reply is cut past this (or past its replies' budget, if longer): it
compiles, which takes tens of seconds on a GPU (the first compiled width of a pair, 50 s on an
H200), and none of it is measured."""
WIDTH = 160
"""The widest line the results print: a table's columns that do not fit are left out (report.md
has them all)."""


def cut_budget(timing: Timing, prompts: int, repeats: int, max_new_tokens: int) -> float:
    """A configuration's time budget for its measured replies (`CUT_FACTOR`, `MIN_CUT_SECONDS`)."""
    return max(MIN_CUT_SECONDS, CUT_FACTOR * timing.estimate(1, prompts, repeats, max_new_tokens))


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} minutes" if seconds >= 90 else f"{seconds:.0f} s"


def run_as(setup: Setup, pair: ModelPair) -> Setup:
    """`setup` as `pair`, loaded from it, runs it: on llama.cpp, named by the engine and the GGUF
    file's type (`LlamaCppModel.file_type`), which the dtype asked for does not describe."""
    if not isinstance(pair.target, LlamaCppModel):
        return setup
    return replace(setup, engine=pair.engine, file_type=pair.target.file_type)


def run_bench(
    *,
    target: str,
    draft: str,
    prompts: str,
    data_dir: Path,
    limit: int,
    max_new_tokens: int,
    spec: SweepSpec,
    seed: int,
    repeats: int,
    output: Path,
    device: str,
    threads: int | None,
    trust_remote_code: bool,
    threads_batch: int | None = None,
    budget: TimeBudget | None = None,
    cut_after: float | None = None,
    whole_step: bool | None = None,
    profile: bool = False,
    engine: Engine = "auto",
) -> int:
    """Run the benchmark; returns the exit status: 0, or 130 (Ctrl-C) or 143 (SIGTERM) when a signal
    cut the sweep short (what was measured is reported all the same). `cut_after`: each
    configuration's time budget for its measured replies (None: `cut_budget`'s). `whole_step`:
    every fsd-chat row decodes whole steps (`--whole-step`; None: `ModelPair.whole_step`'s default;
    transformers' rows are unchanged),
    said in the report's title and its sweep record. `profile`: one more reply of each fsd-chat row
    under torch.profiler, against the device's copy bandwidth measured here (`bench.profile`).
    `engine`: what runs fsd-chat's rows (`--engine`); transformers' rows run on transformers
    whatever it is. `threads_batch`: llama.cpp's threads for forwards of several tokens, its own
    baselines' alike (None: the threads of one token's).

    Raises:
        FsdChatError: bad lists, prompt set, counts, or models that fail to load.
    """
    auto_dtype = str(resolve_dtype("auto", resolve_device(device))).removeprefix("torch.")
    from_model = spec.unset_sampling()
    # Every list is checked before a model loads (the sampling lists not given, at their defaults);
    # the sampling itself is resolved once the target is loaded, from its generation_config.
    setups, configs = build_sweep(spec.with_sampling(SamplingConfig()), auto_dtype=auto_dtype)
    if draft == LOOKUP and any(c.method in HF_ASSISTED for c in configs):
        raise FsdChatError(
            "hf-assisted baselines need a draft model; with prompt lookup compare with hf-prompt-lookup "
            "(--baselines autoregressive,exact,hf-prompt-lookup)"
        )
    prompt_set = load_prompt_set(prompts, data_dir=data_dir, limit=limit)
    check_max_new_tokens(max_new_tokens)
    if repeats < 1:
        raise FsdChatError(f"--repeats must be ≥ 1, got {repeats}")
    # Prompt i runs with seed + i: the last one must still be a valid seed.
    for prompt_seed in (seed, seed + len(prompt_set.items) - 1):
        SamplingConfig(seed=prompt_seed)
    if resolve_device(device).type == "cpu":
        threads = apply_threads(threads)
    check_writable(output)
    # Lines unbroken (a terminal wraps them itself): a log keeps each note on one line.
    console = Console(stderr=True, soft_wrap=True)
    if console.is_terminal:  # the progress bar spans the terminal: at most WIDTH columns
        console = Console(stderr=True, soft_wrap=True, width=min(console.width, WIDTH))
    pairs: dict[str, ModelPair] = {}
    by_setup: dict[Setup, ModelPair] = {}

    def specs_of(setup: Setup, engine: Engine) -> tuple[ModelSpec, ModelSpec, LoadOptions]:
        return pair_specs(
            target,
            draft,
            setup.quantize_target,
            setup.quantize_draft,
            device,
            setup.dtype,
            trust_remote_code,
            engine,
        )

    ran_as: dict[Setup, Setup] = {}  # a setup as its loaded pair runs it (`run_as`)
    for setup in setups:
        # `load_pair` says each phase, the engine it chose (and why) first; the setup is named
        # once it has loaded, as it runs (on llama.cpp: not the dtype asked for, and the file's
        # type, known only then).
        with console.status("loading") as status:
            phases = _phases(console, status)
            pair = load_pair(*specs_of(setup, engine), progress=phases)
            # On llama.cpp: the forward prices too (timed on a new file or split, said as a phase).
            pair.use_threads(threads, requested_batch=threads_batch, progress=phases)
        ran = ran_as[setup] = run_as(setup, pair)
        console.print(Text(f"loaded {ran.label}"))
        pairs[ran.label] = by_setup[ran] = pair
    setups = [ran_as[setup] for setup in setups]
    # transformers' baselines run on models of their own, which fsd-chat's compiled decoders never
    # touch (`bench.methods`): loaded again, as transformers' user would load them.
    hf_setups = {ran_as[c.setup] for c in configs if c.method in HF_METHODS}
    hf_pairs: dict[Setup, ModelPair] = {}
    for setup in setups:
        if setup in hf_setups:
            target_spec, draft_spec, options = specs_of(setup, "transformers")
            with console.status(f"loading {setup.label} for transformers' baselines"):
                hf_pairs[setup] = load_pair(target_spec, draft_spec, replace(options, prepack=False))
    # Sampling lists not given start from the target's own sampling, as chat and generate do.
    model_sampling = SamplingRequest().resolve(by_setup[setups[0]].generation_config, Path(target).name)
    spec = spec.with_sampling(model_sampling.config)
    configs = [replace(c, setup=ran_as[c.setup]) for c in build_sweep(spec, auto_dtype=auto_dtype)[1]]
    if from_model:
        console.print(Text(f"{', '.join(from_model)} from {model_sampling.source}", style="dim"))
    if model_sampling.not_applied:
        console.print(
            Text(f"not applied (p and q alike): {', '.join(model_sampling.not_applied)}", style="dim")
        )

    # Up front, what the sweep will take; under a budget, cut to keep it.
    scorer = by_setup[setups[0]]
    # As asked, else each pair's own default (`ModelPair.whole_step`, in `run_sweep`): the scorer's
    # decides the timing below and what the report's title and record say.
    scored_whole_step = scorer.whole_step(whole_step)
    # Timed as whole steps unless a row decodes compiled steps (which then reuse the compilation):
    # compiling steps no row decodes could take longer than the sweep (target-only's compiled steps
    # warmed up in 27 s on the 1.5B real-cost pair, H200), and a bench of transformers' rows alone
    # then leaves none of fsd-chat's compilation in the process.
    compiled_rows = not scored_whole_step and any(c.method not in HF_METHODS for c in configs)
    timing = time_target_only(
        scorer,
        setups[0],
        prompt_ids(scorer.tokenizer, [Message("user", prompt_set.items[0].text)]),
        whole_step=not compiled_rows,
    )
    asked = (len(prompt_set.items), max_new_tokens)
    if budget is not None:
        count, max_new_tokens = fit(budget, timing, len(configs), asked[0], repeats, max_new_tokens)
        prompt_set = replace(prompt_set, items=prompt_set.items[:count])
    estimate = timing.estimate(len(configs), len(prompt_set.items), repeats, max_new_tokens)
    cut_after = cut_after or cut_budget(timing, len(prompt_set.items), repeats, max_new_tokens)
    warmup_cut_after = max(cut_after, WARMUP_CUT_SECONDS)
    console.print(
        Text(
            f"estimate: about {_minutes(estimate)}, {len(configs)} configurations × {len(prompt_set.items)} "
            f"prompts × ≤{max_new_tokens} tokens at {1000 * timing.per_token:.1f} ms a token and "
            f"{1000 * timing.per_run:.0f} ms a run (target-only, timed; compilation not included)",
            style="dim",
        )
    )
    console.print(
        Text(
            f"a configuration is cut past {_minutes(cut_after)} of replies, or {_minutes(warmup_cut_after)} "
            "of warm-up (it compiles), and the sweep goes on",
            style="dim",
        )
    )
    if budget is not None and (len(prompt_set.items), max_new_tokens) != asked:
        console.print(
            Text(
                f"cut from {asked[0]} prompts × ≤{asked[1]} tokens to stay within {_minutes(budget.seconds)}",
                style="dim",
            )
        )
    if budget is not None and estimate > budget.seconds:
        console.print(
            Text(
                f"over the {_minutes(budget.seconds)} asked for: fewer --thresholds, --divergences, --limit or "
                "--max-new-tokens make it shorter",
                style="yellow",
            )
        )

    bandwidth = copy_bandwidth(scorer.device) if profile else None
    runs_total = len(configs) * (1 + len(prompt_set.items) * repeats)
    with interrupts(), _progress(console, runs_total) as advance:
        result = run_sweep(
            by_setup,
            configs,
            prompt_set,
            max_new_tokens=max_new_tokens,
            seed=seed,
            repeats=repeats,
            on_run=advance,
            hf_pairs=hf_pairs,
            cut_after=cut_after,
            warmup_cut_after=warmup_cut_after,
            whole_step=whole_step,
            profile=profile,
            bandwidth=bandwidth,
        )
    write_outputs(
        output,
        runs=result.runs,
        configs=configs,
        pairs=pairs,
        sweep={
            **_sweep_record(spec, prompt_set.name, len(prompt_set.items), max_new_tokens, seed, repeats),
            "model_sampling": model_sampling.source,
            "not_applied": list(model_sampling.not_applied),
            "cut_after_seconds": cut_after,
            "warmup_cut_after_seconds": warmup_cut_after,
            "whole_step": scored_whole_step,
            "copy_bandwidth_bytes_per_second": bandwidth,
        },
        records=result.records,
        cut_after=cut_after,
        interrupted=result.interrupted,
        title=f"fsd-chat bench · {Path(target).name} / {Path(draft).name} · {prompt_set.name} "
        f"({len(prompt_set.items)} prompts, ≤{max_new_tokens} tokens)"
        + (" · whole step" if scored_whole_step else ""),
    )
    return result.exit_status


def _phases(console: Console, status: Status) -> Callable[[str], None]:
    """A load's phases (`load_pair`'s `progress`): the status line's text on a terminal; else one
    line each (a log file, a pipe: a spinner shows only on a terminal)."""
    if console.is_terminal:
        return status.update
    return lambda phase: console.print(Text(phase))


@contextmanager
def _progress(console: Console, total: int) -> Iterator[OnRun]:
    """The sweep's progress, told after each of its `total` generations: a bar on a terminal; else
    (a log file, a pipe) one line each, with the count and the seconds so far, since a redirected
    stream cannot redraw a bar."""

    def describe(config: Configuration, phase: str) -> str:
        return f"{phase} · {config.setup_label} · {config.sampling} · {config.label}"

    if console.is_terminal:
        with Progress(*PROGRESS_COLUMNS, console=console, transient=False) as progress:
            task = progress.add_task("warming up", total=total)
            yield lambda config, phase: progress.update(task, advance=1, description=describe(config, phase))
        return
    start = time.monotonic()
    done = 0

    def line(config: Configuration, phase: str) -> None:
        nonlocal done
        done += 1
        if phase == "skip":  # a cut configuration's replies: its "cut" line said so once
            return
        console.print(Text(f"{done}/{total} {describe(config, phase)} · {time.monotonic() - start:.0f} s"))

    yield line


OUTPUT_FILES = ("report.json", "report.md", "tradeoff.png")


def check_writable(output: Path) -> None:
    """Create the output folder and check that the reports can be written into it, before the
    sweep spends minutes measuring.

    Raises:
        FsdChatError: the folder cannot be created or written, or a report's name is taken by a
            folder.
    """
    try:
        output.mkdir(parents=True, exist_ok=True)
        for name in OUTPUT_FILES:
            if (output / name).is_dir():
                raise FsdChatError(f"cannot write {output / name}: it is a folder")
        # Permissions, read-only mounts, quotas: only writing a file tells.
        with tempfile.NamedTemporaryFile(dir=output, prefix=".fsd-chat-bench-"):
            pass
    except OSError as exc:
        raise FsdChatError(f"cannot write into the output folder {output}: {exc.strerror or exc}") from None


def write_outputs(
    output: Path,
    *,
    runs: list[Measurement],
    configs: list[Configuration],
    pairs: dict[str, ModelPair],
    sweep: dict[str, object],
    interrupted: bool,
    title: str,
    records: dict[Configuration, ConfigurationRecord] | None = None,
    cut_after: float | None = None,
) -> None:
    """Summarise the runs, show the results on stdout, then write the three files.

    The table goes out first, so a run that cannot be saved (the disk filled up, the folder went
    away) is still seen.

    Raises:
        FsdChatError: a report file cannot be written.
    """
    summaries = summarize(configs, runs, records, cut_after)
    verdicts = compare_curves(summaries, runs)
    with_rows = {s.config for s in summaries}
    cut = [
        f"{c.setup_label} · {c.sampling} · {c.label}"
        for c, record in (records or {}).items()
        if record.cut and c not in with_rows
    ]
    advice = advise(summaries)
    results = report.Report(environment(pairs), sweep, interrupted, summaries, verdicts, cut, advice)
    plot_name = "tradeoff.png" if summaries else None
    console = Console(highlight=False)
    # A terminal, a file or a pipe alike: lines of at most WIDTH columns (a table's columns that
    # do not fit are left out; report.md has them).
    console = Console(width=min(console.width, WIDTH) if console.is_terminal else WIDTH, highlight=False)
    # The title holds model and prompt-file paths: text, not markup, and no raw control characters.
    console.print(
        Text(visible(title), style="bold"), Text(" (interrupted)", style="red") if interrupted else ""
    )
    terminal.show(console, summaries)
    profiled = [(s.config.label, s.profile) for s in summaries if s.profile is not None]
    if profiled:
        bandwidth = sweep.get("copy_bandwidth_bytes_per_second")
        console.print(profile_table(profiled, bandwidth if isinstance(bandwidth, float) else None))
    for verdict in verdicts:
        console.print(Text("\n".join(verdict.lines())))
    try:
        report.write_json(output / "report.json", results)
        if plot_name:
            plot.write_plot(output / plot_name, summaries, title=title)
        report.write_markdown(output / "report.md", results, title=title, plot_name=plot_name)
    except OSError as exc:
        raise FsdChatError(
            f"cannot write {exc.filename or output}: {exc.strerror or exc} (the table above has the results)"
        ) from None
    console.print(
        Text(
            visible(
                f"wrote {output / 'report.json'}, {output / 'report.md'}"
                + (f", {output / plot_name}" if plot_name else "")
            )
        )
    )
    if cut:
        console.print(Text(report.cut_line(cut), style="yellow"))
    console.print(Text(advice, style="bold"))
