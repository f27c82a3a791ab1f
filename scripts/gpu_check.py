"""`make gpu-check`: check a CUDA setup in one command, in under 5 minutes on a fresh machine.

Its phases, each with a line of progress and its seconds:
1. the CUDA tests (`pytest -m cuda tests/test_cuda.py`: greedy identity, CUDA graphs (`--compile`,
   on by default on CUDA) against eager decoding, bfloat16 / float16, 8-bit and 4-bit targets,
   losslessness on batched verdicts, device_map="auto", host synchronisations), and their table;
2. a pair with real models' costs, built by the shared builder in the background from the start
   (while the tests run): a target at SmolLM2-1.7B's shape (hidden 2048, intermediate 8192, 24
   layers, head_dim 64) and a draft at SmolLM2-135M's (hidden 640, intermediate 1536, 30 layers),
   over the story pair's weights, so that acceptance is the story pair's and the costs those of a
   1.7B/135M pair;
3. its bench in bfloat16: target-only, exact, fuzzy and mixture, under fixed k and the chat's
   default draft policy, against hf-static and hf-assisted (bench's table, its advice line, and
   its report.json under --real-output);
4. the same fsd-chat rows with `--whole-step` (one captured CUDA graph a step; its report.json
   under --whole-step-output), then one table of both: each row's tok/s today and as whole steps,
   and against hf-static, issue 36's goals read off it;
5. the scaled story pair, and 6. a short bench of it in bfloat16 (target-only decoding and exact SD
   against transformers' `generate` with a static cache and its assisted generation; --output).
With no CUDA device it says so in one line and exits 0.

The scaled pair is stories260K's scaled copy (79M parameters, head_dim 64: the source's head_dim of
8 sends attention to kernels no real model meets), built once by the shared builder into .cache/,
with the offline draft; or any pair given with --target / --draft. --device cpu runs the benches on
the CPU (the CPU suite checks this script that way, with tiny shapes for the real-cost pair).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsd_chat.decoding.settings import DEFAULT_DRAFT_POLICY

CACHE = Path(".cache")
HEAD_DIM = 64
"""Head size of the scaled target: that of SmolLM2 and Llama-style models of its size."""


@dataclass(frozen=True, slots=True)
class Shape:
    """A scaled model's shape: the builder's --hidden, --intermediate, layers and --head-dim."""

    hidden: int
    intermediate: int
    layers: int
    head_dim: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """The shape written "hidden,intermediate,layers,head_dim", e.g. "2048,8192,24,64"."""
        try:
            hidden, intermediate, layers, head_dim = (int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected hidden,intermediate,layers,head_dim, got {text!r}"
            ) from None
        return cls(hidden, intermediate, layers, head_dim)

    def __str__(self) -> str:
        return f"{self.hidden},{self.intermediate},{self.layers},{self.head_dim}"


REAL_TARGET = Shape(2048, 8192, 24, 64)
"""SmolLM2-1.7B's shape."""
REAL_DRAFT = Shape(640, 1536, 30, 64)
"""SmolLM2-135M's shape."""


def _cuda_device() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _rate_table(junit: Path) -> Table | None:
    """The tok/s the CUDA tests recorded (JUnit properties "<decoder> graphs" and "<decoder>
    compiled", `test_whole_step_graphs_speed`): whole-step graphs beside today's compiled steps, one
    row a decoder (None when no test recorded any)."""
    rates: dict[str, dict[str, float]] = {}
    for prop in ET.parse(junit).getroot().iter("property"):
        name, _, kind = (prop.get("name") or "").rpartition(" ")
        if name and kind in ("graphs", "compiled"):
            rates.setdefault(name, {})[kind] = float(prop.get("value") or "nan")
    if not rates:
        return None
    table = Table(
        "decoder", "whole step tok/s", "compiled tok/s", "ratio", title="whole step vs compiled steps"
    )
    for name, rate in rates.items():
        graphs, compiled = rate.get("graphs"), rate.get("compiled")
        ratio = f"{graphs / compiled:.2f}" if graphs and compiled else "?"
        table.add_row(Text(name), f"{graphs or 0:.0f}", f"{compiled or 0:.0f}", ratio)
    return table


def whole_step_table(today: Path, whole: Path) -> Table:
    """The real-cost pair's fsd-chat rows, today's steps (`today`'s report.json) beside whole steps
    (`whole`'s), with hf-static's tok/s: each row's tok/s (mean over its replies), the ratio of the
    two, and the whole step's tok/s over hf-static's (issue 36's goals: target-only ≥ 1.2× hf-static,
    exact at its best k ≥ 1.8× target-only, the default policy ≥ its best fixed k, fuzzy or mixture
    ≥ 1.15× exact). A row missing from either report shows "-"."""
    reports = [json.loads(path.read_text(encoding="utf-8")) for path in (today, whole)]
    rates = [
        {c["label"]: c["tokens_per_second"] for c in r["configs"] if c["status"] == "ok"} for r in reports
    ]
    static = rates[0].get("hf-static")
    table = Table(
        "configuration",
        "today tok/s",
        "whole step tok/s",
        "whole / today",
        "whole / hf-static",
        title="the real-cost pair: whole steps (--whole-step) vs today's steps",
    )
    labels = [c["label"] for c in reports[1]["configs"]] + [c["label"] for c in reports[0]["configs"]]

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for label in dict.fromkeys(labels):  # in order, once each
        before, after = rates[0].get(label), rates[1].get(label)
        if label.startswith("hf-") and after is None:
            table.add_row(Text(label), cell(before), "-", "-", "-")
            continue
        ratio = f"{after / before:.2f}" if after and before else "-"
        over_static = f"{after / static:.2f}" if after and static else "-"
        table.add_row(Text(label), cell(before), cell(after), ratio, over_static)
    return table


def _test_table(junit: Path) -> tuple[Table, int]:
    """The CUDA tests' outcomes from pytest's JUnit XML, and the number that failed."""
    table = Table("CUDA test", "outcome", "seconds", title="pytest -m cuda")
    failed = 0
    for case in ET.parse(junit).getroot().iter("testcase"):
        # An Element without children is falsy: test for None explicitly.
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            failed += 1
            outcome = Text(f"failed: {(problem.get('message') or '').splitlines()[0][:80]}", style="red")
        elif skipped is not None:
            outcome = Text(f"skipped: {skipped.get('message', '')[:80]}", style="yellow")
        else:
            outcome = Text("passed", style="green")
        table.add_row(Text(case.get("name", "?")), outcome, f"{float(case.get('time', 0)):.1f}")
    return table, failed


@dataclass
class Build:
    """A model the shared builder writes in a process of its own (so that it runs while the CUDA
    tests do), into a folder beside `out`, renamed to `out` once it succeeded (a build cut short
    leaves no model that looks whole)."""

    out: Path
    process: subprocess.Popen[bytes] | None

    @classmethod
    def start(cls, builder: Path, source: Path, out: Path, shape: Shape) -> Build:
        """Start building `source` scaled to `shape` into `out`, unless already built there
        (deterministic: seed 0)."""
        if out.is_dir():
            return cls(out, None)
        with open(source / "config.json", encoding="utf-8") as config:
            layers = int(json.load(config)["num_hidden_layers"])
        partial = out.with_name(out.name + ".partial")
        command = [
            *(sys.executable, str(builder), str(source), str(partial)),
            *("--hidden", str(shape.hidden), "--intermediate", str(shape.intermediate)),
            *("--extra-layers", str(shape.layers - layers), "--head-dim", str(shape.head_dim)),
        ]
        # A few threads: the CUDA tests beside it launch kernels from the host.
        return cls(out, subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "4"}))

    def wait(self) -> Path:
        """The built model's folder, once built.

        Raises:
            subprocess.CalledProcessError: the builder failed.
        """
        if self.process is not None:
            if self.process.wait():
                raise subprocess.CalledProcessError(self.process.returncode, self.process.args)
            self.out.with_name(self.out.name + ".partial").rename(self.out)
            self.process = None
        return self.out


def _scaled_target(models: Path, builder: Path) -> Path:
    """The scaled copy of stories260K with head_dim 64, built on first use (deterministic, seconds)."""
    out = CACHE / f"stories260K-scaled-hd{HEAD_DIM}"
    if not (out / "config.json").is_file():
        source = models / "stories260K"
        subprocess.run(
            [sys.executable, str(builder), str(source), str(out), "--head-dim", str(HEAD_DIM)], check=True
        )
    return out


def real_cost_pair(models: Path, builder: Path, target: Shape, draft: Shape) -> tuple[Build, Build]:
    """Start building the story pair at real models' shapes (`REAL_TARGET`, `REAL_DRAFT` by
    default) into .cache/, unless already built there."""

    def folder(name: str, shape: Shape) -> Path:
        return CACHE / f"{name}-as-{str(shape).replace(',', '-')}"

    return (
        Build.start(builder, models / "stories260K", folder("stories260K", target), target),
        Build.start(builder, models / "stories260K-draft", folder("stories260K-draft", draft), draft),
    )


def bench_command(args: argparse.Namespace, target: str, draft: str) -> list[str]:
    """The `fsd-chat bench` command line of the scaled pair: target-only decoding and exact SD
    against transformers' static-cache generate and assisted generation, few prompts, few tokens
    (the whole check must fit in 5 minutes)."""
    return [
        *(sys.executable, "-m", "fsd_chat", "bench", "--target", target, "--draft", draft),
        *("--device", args.device, "--dtype", args.dtype, "--quantize-target", args.quantize),
        *("--prompts", "tinystories", "--data-dir", str(args.data_dir), "--limit", str(args.limit)),
        *("--max-new-tokens", str(args.max_new_tokens), "--rules", "none"),
        *("--baselines", "autoregressive,exact,hf-static,hf-assisted", "--output", str(args.output)),
    ]


def real_bench_command(
    args: argparse.Namespace, target: str, draft: str, *, whole_step: bool = False
) -> list[str]:
    """The `fsd-chat bench` command line of the real-cost pair: target-only, exact, fuzzy and
    mixture, under fixed k and the chat's default policy, against hf-static and hf-assisted, in
    bfloat16 (one threshold per rule). `whole_step`: fsd-chat's rows alone, with `--whole-step`
    (transformers' rows would be the same as without it), into --whole-step-output."""
    if whole_step:
        command = real_bench_command(args, target, draft)
        command[command.index("--baselines") + 1] = "autoregressive,exact"
        command[command.index("--output") + 1] = str(args.whole_step_output)
        return [*command, "--whole-step"]
    return [
        *(sys.executable, "-m", "fsd_chat", "bench", "--target", target, "--draft", draft),
        *("--device", args.device, "--dtype", args.dtype),
        *("--prompts", "tinystories", "--data-dir", str(args.data_dir), "--limit", str(args.limit)),
        *("--max-new-tokens", str(args.max_new_tokens), "--rules", "fuzzy,mixture"),
        *("--divergences", "js", "--thresholds", "0.05", "--mixture-thresholds", "0.05"),
        # The chat's own draft policy beside fixed k.
        *("--draft-policies", f"fixed,{DEFAULT_DRAFT_POLICY}"),
        *("--baselines", "autoregressive,exact,hf-static,hf-assisted", "--output", str(args.real_output)),
    ]


@contextmanager
def phase(console: Console, number: int, total: int, what: str) -> Iterator[None]:
    """A line when a phase starts, and one with its seconds when it ends."""
    console.print(Text(f"gpu-check {number}/{total}: {what}", style="bold"))
    start = time.monotonic()
    yield
    console.print(Text(f"gpu-check {number}/{total}: done in {time.monotonic() - start:.0f} s", style="dim"))


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit code (1 when a CUDA test or a bench failed)."""
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("../shared/models"), help="offline models folder")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"), help="bench's prompt sets")
    parser.add_argument("--builder", type=Path, default=Path("../shared/tools/build_scaled_target.py"))
    parser.add_argument("--target", help="target model (default: the scaled stories260K, head_dim 64)")
    parser.add_argument("--draft", help="draft model (default: stories260K-draft)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the bench alone, no tests)")
    parser.add_argument("--dtype", default="bfloat16", help="the pair's dtype in the bench")
    parser.add_argument(
        "--quantize",
        default="none",
        help="the scaled target's quantizations in its bench (e.g. none,8bit,4bit)",
    )
    parser.add_argument("--limit", type=int, default=4, help="bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="bench tokens per reply")
    parser.add_argument(
        "--output", type=Path, default=CACHE / "gpu-check-bench", help="the scaled pair's report folder"
    )
    parser.add_argument(
        "--real-target",
        type=Shape.parse,
        default=REAL_TARGET,
        help="the real-cost target's shape: hidden,intermediate,layers,head_dim (default: SmolLM2-1.7B's)",
    )
    parser.add_argument(
        "--real-draft",
        type=Shape.parse,
        default=REAL_DRAFT,
        help="the real-cost draft's shape (default: SmolLM2-135M's)",
    )
    parser.add_argument("--no-real", action="store_true", help="skip the real-cost pair")
    parser.add_argument(
        "--whole-step-output",
        type=Path,
        default=CACHE / "gpu-check-real-whole-step",
        help="the real-cost pair's report folder with --whole-step",
    )
    parser.add_argument(
        "--real-output",
        type=Path,
        default=CACHE / "gpu-check-real",
        help="the real-cost pair's report folder",
    )
    args = parser.parse_args(argv)

    on_cuda = args.device.startswith("cuda")
    device = _cuda_device() if on_cuda else "cpu"
    if device is None:
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check.")
        return 0
    console = Console(highlight=False, soft_wrap=True)  # a log keeps each line whole
    console.print(Text(f"gpu-check on {device}", style="bold"))
    CACHE.mkdir(exist_ok=True)
    # The real-cost pair (6.5 GB of float32 weights, a minute or more) is built while the CUDA
    # tests run: the check's 5 minutes have no room for it in series.
    builds = (
        None if args.no_real else real_cost_pair(args.models, args.builder, args.real_target, args.real_draft)
    )
    failed = 0
    total = 2 + (0 if args.no_real else 3)
    number = 0
    if on_cuda:
        total += 1
        number += 1
        with phase(console, number, total, "the CUDA tests (pytest -m cuda)"):
            junit = CACHE / "gpu-check-tests.xml"
            # Only the CUDA tests' module: collecting the whole suite would import the chat's and the
            # server's test dependencies, which a GPU image need not have.
            tests = [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "cuda",
                "-q",
                f"--junitxml={junit}",
                "tests/test_cuda.py",
            ]
            subprocess.run(tests, env={**os.environ, "FSD_CHAT_MODELS": str(args.models)})
            table, failed = _test_table(junit)
            console.print(table)
            rates = _rate_table(junit)
            if rates is not None:
                console.print(rates)

    benches = 0
    # The real-cost pair first: the figures a user's pair would see, printed even if the check
    # runs out of time in the scaled pair's bench after it.
    if builds is not None:
        number += 1
        with phase(
            console, number, total,
            f"building the real-cost pair: target {args.real_target}, draft {args.real_draft} "
            "(hidden,intermediate,layers,head_dim; started with the check)",
        ):  # fmt: skip
            real_target, real_draft = (build.wait() for build in builds)
        number += 1
        with phase(console, number, total, f"bench of the real-cost pair in {args.dtype}"):
            benches += (
                subprocess.run(real_bench_command(args, str(real_target), str(real_draft))).returncode != 0
            )
            console.print(
                Text(f"gpu-check: the real-cost pair's report is {args.real_output / 'report.json'}")
            )
        number += 1
        with phase(console, number, total, f"bench of the real-cost pair in {args.dtype}, --whole-step"):
            command = real_bench_command(args, str(real_target), str(real_draft), whole_step=True)
            benches += subprocess.run(command).returncode != 0
            reports = (args.real_output / "report.json", args.whole_step_output / "report.json")
            if all(path.is_file() for path in reports):
                console.print(whole_step_table(*reports))
            console.print(
                Text(f"gpu-check: the whole-step report is {args.whole_step_output / 'report.json'}")
            )
    number += 1
    with phase(console, number, total, "building the scaled story pair"):
        target = args.target or str(_scaled_target(args.models, args.builder))
        draft = args.draft or str(args.models / "stories260K-draft")
    number += 1
    with phase(console, number, total, f"bench of {Path(target).name} / {Path(draft).name} in {args.dtype}"):
        benches += subprocess.run(bench_command(args, target, draft)).returncode != 0
        console.print(Text(f"gpu-check: the bench's report is {args.output / 'report.json'}"))
    return 1 if failed or benches else 0


if __name__ == "__main__":
    sys.exit(main())
