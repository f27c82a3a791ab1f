"""The `fsd-chat bench` command: sweep, report, plot.

List options take comma-separated values (`--thresholds 0.05,0.1,0.2`); `--quick` fills every
sweep option left unset from the quick preset instead of the full one, and cuts the prompt count and
token cap it chose to finish in under 10 minutes on the pair given (`pipeline.fit`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, cast

import typer

from fsd_chat.bench.prompts import PRESETS
from fsd_chat.bench.records import BASELINES, FSD_RULES, Method
from fsd_chat.cli import options as o
from fsd_chat.cli.option import takes
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.options import Engine
from fsd_chat.support.log import quiet_libraries

SWEEP = "Sweep"


@dataclass(frozen=True, slots=True)
class Preset:
    """Defaults of the sweep options (threads None: the thread policy's choice, `fsd_chat.support.threads`)."""

    limit: int
    max_new_tokens: int
    thresholds: str
    divergences: str
    rules: str
    mixture_thresholds: str
    ensemble_weights: str
    draft_tokens: str
    draft_policies: str
    repeats: int
    threads: int | None


FULL = Preset(
    limit=20,
    max_new_tokens=128,
    thresholds="0.01,0.02,0.05,0.1,0.2,0.4",
    divergences="js,kl,tv",
    rules="fuzzy",
    mixture_thresholds="0.01,0.02,0.05,0.1,0.2",
    # w = 0.9 costs about 0.02 nats/token at temperature 1 on the offline pair, 0.8 about 0.05.
    ensemble_weights="0.7,0.8,0.9,0.95",
    draft_tokens=str(o.DRAFT_TOKENS.default),
    # fixed, not the chat's goodput: a sweep compares rules and thresholds at the k it names.
    draft_policies="fixed",
    repeats=1,
    threads=None,
)
# One torch thread: on a small machine shared with other processes, two OpenMP threads on two cores
# stall each other whenever another process takes a core (measured 5-8x slower and erratic).
QUICK = replace(
    FULL,
    limit=8,
    max_new_tokens=96,
    thresholds="0.02,0.05,0.1,0.2,0.4",
    divergences="js,tv",
    mixture_thresholds="0.01,0.02,0.05,0.1",
    # A new user's first run: what the chat would do on this pair, under its own draft policy.
    draft_policies=str(o.DRAFT_POLICY.default),
    threads=1,
)


def _opt(flag: str, help_text: str, envvar: str | None = None) -> typer.models.OptionInfo:
    # bench's own options, which neither generate nor chat takes; the shared ones are in `o`.
    info: typer.models.OptionInfo = typer.Option(flag, help=help_text, rich_help_panel=SWEEP, envvar=envvar)
    return info


DRAFT_BASELINES: tuple[Method, ...] = ("autoregressive", "exact", "hf-assisted")
"""The baselines of a bench with a draft model."""
LOOKUP_BASELINES: tuple[Method, ...] = ("autoregressive", "exact", "hf-prompt-lookup")
"""The baselines of a bench with no draft (prompt lookup): transformers' own prompt lookup, not its
assisted generation, which needs a draft model."""
LLAMA_CPP_BASELINES: tuple[Method, ...] = ("autoregressive", "exact", "llama.cpp", "llama.cpp-lookup")
"""The baselines of a bench on the llama.cpp engine: llama.cpp's own decoding and prompt lookup
(`fsd_chat.bench.llama_baselines`; llama-cpp-python has no speculation with a draft model)."""
CUDA_BASELINES: tuple[Method, ...] = ("hf-static",)
"""Added to the default baselines on CUDA: there target-only decoding is compiled, and so is
transformers' `generate` with a static cache, the fair comparison."""
PRESET = " Default: the preset's."
TARGET = o.TARGET.replace(required=True)
MAX_NEW_TOKENS = o.MAX_NEW_TOKENS.replace(default=None, help=o.MAX_NEW_TOKENS.help + PRESET)
THRESHOLDS = o.THRESHOLD.replace(default=None).listed("--thresholds")
DIVERGENCES = o.DIVERGENCE.replace(default=None).listed("--divergences")
DRAFT_TOKENS = o.DRAFT_TOKENS.replace(default=None).listed()
DRAFT_POLICIES = o.DRAFT_POLICY.replace(default=None).listed("--draft-policies")
# Unset, each takes the target's generation_config (as chat and generate do), else greedy, untruncated.
TEMPERATURES = o.TEMPERATURE.listed()
TOP_KS = o.TOP_K.listed()
TOP_PS = o.TOP_P.listed()
MIN_PS = o.MIN_P.listed()
DTYPES = o.DTYPE.listed()
QUANTIZE_TARGET = o.QUANTIZE_TARGET.listed()
QUANTIZE_DRAFT = o.QUANTIZE_DRAFT.listed()


@takes(
    TARGET,
    o.DRAFT,
    MAX_NEW_TOKENS,
    THRESHOLDS,
    DIVERGENCES,
    DRAFT_TOKENS,
    DRAFT_POLICIES,
    TEMPERATURES,
    TOP_KS,
    TOP_PS,
    MIN_PS,
    QUANTIZE_TARGET,
    QUANTIZE_DRAFT,
    o.ENGINE,
    o.DEVICE,
    DTYPES,
    o.THREADS,
    o.THREADS_BATCH,
    o.TRUST_REMOTE_CODE,
    o.WHOLE_STEP.replace(
        help="fsd-chat's rows (target-only, exact, fuzzy, mixture) decode each step as one function over "
        "static buffers: one captured CUDA graph a step on CUDA, eager on the CPU. transformers' rows are "
        "unchanged; compare with a run without it."
    ),
)
def bench(
    prompts: Annotated[
        str,
        _opt(
            "--prompts",
            f"Prompt set: {', '.join(PRESETS)}, or a JSONL file with `prompt` (and optionally `answer`) fields.",
        ),
    ],
    data_dir: Annotated[
        Path, _opt("--data-dir", "Directory of the built-in prompt sets' data.", envvar="FSD_CHAT_DATA")
    ] = Path("../shared/data"),
    limit: Annotated[int | None, _opt("--limit", "Number of prompts (from the start of the set).")] = None,
    rules: Annotated[
        str | None, _opt("--rules", f"Lossy rules: {', '.join(FSD_RULES)} (comma-separated, or none).")
    ] = None,
    mixture_thresholds: Annotated[
        str | None,
        _opt(
            "--mixture-thresholds",
            "mixture rule's per-token KL budgets T, nats (greedy: regret), comma-separated.",
        ),
    ] = None,
    ensemble_weights: Annotated[
        str | None,
        _opt(
            "--ensemble-weights",
            "hf-ensemble's assistant_ensemble_weight w, each in (0, 1) (the target's weight; 1 would be lossless), comma-separated.",
        ),
    ] = None,
    seed: Annotated[int, _opt("--seed", "Base seed: prompt i is decoded with seed + i by every method.")] = 0,
    baselines: Annotated[
        str | None,
        _opt(
            "--baselines",
            f"Baselines: {', '.join(BASELINES)} (comma-separated, or none). Default: "
            f"{','.join(DRAFT_BASELINES)} with a draft model, {','.join(LOOKUP_BASELINES)} without; "
            f"on CUDA {','.join(CUDA_BASELINES)} too.",
        ),
    ] = None,
    repeats: Annotated[int | None, _opt("--repeats", "Runs of each prompt per configuration.")] = None,
    quick: Annotated[
        bool,
        _opt(
            "--quick",
            "The quick preset: under 10 minutes (its prompt count and token cap are cut to fit, "
            "from a timed target-only reply of the pair).",
        ),
    ] = False,
    output: Annotated[
        Path, _opt("--output", "Directory for report.json, report.md and tradeoff.png.")
    ] = Path("bench-out"),
    cut_after: Annotated[
        float | None,
        _opt(
            "--cut-after",
            "Seconds a configuration's measured replies may take before it is cut (reported as cut; "
            "the sweep goes on). Default: 4× what target-only decoding would take, at least 30.",
        ),
    ] = None,
    profile: Annotated[
        bool,
        _opt(
            "--profile",
            "After the sweep, one more reply of each fsd-chat row under torch.profiler: per token its wall "
            "ms, GPU busy ms, kernels, graph-launch and host-wait µs, kernels a layer, top kernels, and "
            "bandwidth use against a device copy measured in the same run (docs/benchmarks.md).",
        ),
    ] = False,
    **values: Any,
) -> None:
    """Measure FSD's speed/quality trade-off against autoregressive decoding, exact speculative
    decoding and transformers' assisted generation, side by side in one run."""
    from fsd_chat.bench.pipeline import QUICK_BUDGET_SECONDS, TimeBudget, run_bench
    from fsd_chat.bench.sweep import SweepSpec
    from fsd_chat.models.devices import resolve_device
    from fsd_chat.models.engine_choice import engine_for

    preset = QUICK if quick else FULL
    draft = o.DRAFT.get(values) or LOOKUP
    engine = cast(Engine, o.ENGINE.of(values))
    if baselines is None:
        defaults = LOOKUP_BASELINES if draft == LOOKUP else DRAFT_BASELINES
        if engine_for(TARGET.of(values), draft, engine) != "transformers":
            defaults = LLAMA_CPP_BASELINES
        elif resolve_device(o.DEVICE.of(values)).type == "cuda":
            defaults += CUDA_BASELINES
        baselines = ",".join(defaults)
    thresholds, divergences = THRESHOLDS.get(values), DIVERGENCES.get(values)
    draft_tokens, draft_policies = DRAFT_TOKENS.get(values), DRAFT_POLICIES.get(values)
    max_new_tokens, threads = MAX_NEW_TOKENS.get(values), o.THREADS.get(values)
    spec = SweepSpec(
        thresholds=thresholds if thresholds is not None else preset.thresholds,
        divergences=divergences if divergences is not None else preset.divergences,
        rules=rules if rules is not None else preset.rules,
        mixture_thresholds=mixture_thresholds
        if mixture_thresholds is not None
        else preset.mixture_thresholds,
        ensemble_weights=ensemble_weights if ensemble_weights is not None else preset.ensemble_weights,
        draft_tokens=draft_tokens if draft_tokens is not None else preset.draft_tokens,
        draft_policies=draft_policies if draft_policies is not None else preset.draft_policies,
        temperatures=TEMPERATURES.get(values),
        top_ks=TOP_KS.get(values),
        top_ps=TOP_PS.get(values),
        min_ps=MIN_PS.get(values),
        baselines=baselines,
        dtypes=DTYPES.of(values),
        quantize_target=QUANTIZE_TARGET.of(values),
        quantize_draft=QUANTIZE_DRAFT.of(values),
    )
    quiet_libraries()
    status = run_bench(
        target=TARGET.of(values),
        draft=draft,
        prompts=prompts,
        data_dir=data_dir,
        limit=limit if limit is not None else preset.limit,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else preset.max_new_tokens,
        spec=spec,
        seed=seed,
        repeats=repeats if repeats is not None else preset.repeats,
        output=output,
        device=o.DEVICE.of(values),
        threads=threads if threads is not None else preset.threads,
        threads_batch=o.THREADS_BATCH.get(values),
        trust_remote_code=o.TRUST_REMOTE_CODE.of(values),
        # --quick keeps its promise on any pair: the counts it chose are cut to fit the time.
        budget=TimeBudget(QUICK_BUDGET_SECONDS, prompts=limit is None, tokens=max_new_tokens is None)
        if quick
        else None,
        cut_after=cut_after,
        whole_step=o.WHOLE_STEP.of(values),
        profile=profile,
        engine=engine,
    )
    if status:
        raise typer.Exit(status)
