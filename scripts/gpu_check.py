"""`make gpu-check`: check a CUDA setup in one command, in about 7 minutes on a fresh machine.

Its phases, in the order of what they are worth, each printed as soon as it is known:
1. the imports and versions (python, torch and its CUDA, transformers, bitsandbytes, gguf, the GPU);
2. a pair with real models' costs: first its start timed (`generate --whole-step`, compiled and
   captured, from launch to exit: once over an empty compile cache, once over the cache the first
   left: issue 45's first and second start; the pair's benches reuse those caches), then as whole
   steps (`--whole-step`, one captured CUDA graph a step): target-only, exact at k 2, 4 and 6 under
   fixed k and the chat's default draft policy, then fuzzy and mixture at 0.02, each with its
   profile (`bench --profile`: where a step's time goes, and bandwidth use against a device copy
   measured in the same run). The pair is built by the shared
   builder in the background from the start: a target at SmolLM2-1.7B's shape (hidden 2048,
   intermediate 8192, 24 layers, head_dim 64) and a draft at SmolLM2-135M's (hidden 640,
   intermediate 1536, 30 layers) over the story pair's weights, so that acceptance is the story
   pair's and the costs those of a 1.7B/135M pair;
3. the same with a 4-bit target (bitsandbytes NF4), target-only and the best exact k of phase 2;
4. transformers' hf-static, per-forward steps on phase 2's exact rows, then hf-assisted, each in a
   process of its own, and one table of whole steps against per-forward steps and hf-static;
5. the scaled story pair (79M, head_dim 64) as whole steps, target-only and exact k 4;
6. `pytest -m cuda tests/test_cuda.py`, and its tables.

No phase can eat the check: every bench runs in a process of its own with a hard cap (`--load-cap`
for loading, plus `--config-cap` a configuration: warm-up and replies), killed past it (its process
group, after SIGABRT has it print its stacks), shown as cut, and the check goes on; transformers'
baselines run after fsd-chat's whole-step rows, one process each. The whole check has a budget
(`--budget`, 420 s): a bench gets at most what is left of it after pytest's cap, and one that would
get too little is not run and says so. While the real-cost pair still builds, phase 5 runs first.
fsd-chat's rows run without a synchronisation per phase (the profile says where the time goes).
`--big-pair` adds an 8B/1B-cost pair last, beyond the budget. With no CUDA device it says so in one
line and exits 0.

--device cpu runs the benches on the CPU (the CPU suite checks this script that way, with tiny
shapes for the real-cost pair): the pytest phase and the 4-bit target are CUDA's alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
    compiled", `test_whole_step_graphs_speed`): whole-step graphs beside the per-forward compiled
    steps, one row a decoder (None when no test recorded any)."""
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


def _configs(paths: list[Path]) -> list[dict[str, Any]]:
    """The configurations of the reports in `paths` that exist (a bench cut at its cap wrote none)."""
    return [
        c for path in paths if path.is_file() for c in json.loads(path.read_text(encoding="utf-8"))["configs"]
    ]


def whole_step_table(per_forward: list[Path], whole: list[Path]) -> Table:
    """The real-cost pair's rows, per-forward steps (`per_forward`'s reports, transformers' rows
    among them) beside whole steps (`whole`'s), with hf-static's tok/s: each row's tok/s (mean over its
    replies), the ratio of the two, and the whole step's tok/s over hf-static's (issue 36's goals:
    target-only ≥ 1.2× hf-static, exact at its best k ≥ 1.8× target-only, the default policy ≥ its
    best fixed k, fuzzy or mixture ≥ 1.15× exact). A row missing (cut, or not run) shows "-"."""
    reports = [{"configs": _configs(per_forward)}, {"configs": _configs(whole)}]
    rates = [
        {c["label"]: c["tokens_per_second"] for c in r["configs"] if c["status"] == "ok"} for r in reports
    ]
    static = rates[0].get("hf-static")
    table = Table(
        "configuration",
        "per-forward tok/s",
        "whole step tok/s",
        "whole / per-forward",
        "whole / hf-static",
        title="the real-cost pair: whole steps (--whole-step) vs per-forward steps",
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
    def start(cls, builder: Path, source: Path, out: Path, shape: Shape, *options: str) -> Build:
        """Start building `source` scaled to `shape` into `out` (the builder's `options` too, e.g.
        --dtype bfloat16 --device cuda), unless already built there (deterministic: seed 0)."""
        if out.is_dir():
            return cls(out, None)
        with open(source / "config.json", encoding="utf-8") as config:
            layers = int(json.load(config)["num_hidden_layers"])
        partial = out.with_name(out.name + ".partial")
        command = [
            *(sys.executable, str(builder), str(source), str(partial)),
            *("--hidden", str(shape.hidden), "--intermediate", str(shape.intermediate)),
            *("--extra-layers", str(shape.layers - layers), "--head-dim", str(shape.head_dim)),
            *options,
        ]
        # A few threads: the CUDA tests beside it launch kernels from the host.
        return cls(out, subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "4"}))

    def done(self) -> bool:
        """Whether the build has ended (or was not needed)."""
        return self.process is None or self.process.poll() is not None

    def wait(self, timeout: float | None = None) -> Path:
        """The built model's folder, once built (the builder killed past `timeout` seconds).

        Raises:
            subprocess.CalledProcessError: the builder failed.
            subprocess.TimeoutExpired: it ran past `timeout`.
        """
        if self.process is not None:
            try:
                code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
            if code:
                raise subprocess.CalledProcessError(code, self.process.args)
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


def real_cost_pair(
    models: Path, builder: Path, target: Shape, draft: Shape, *options: str
) -> tuple[Build, Build]:
    """Start building the story pair at real models' shapes (`REAL_TARGET`, `REAL_DRAFT` by
    default; the builder's `options` too) into .cache/, unless already built there."""
    suffix = "-bf16" if "bfloat16" in options else ""

    def folder(name: str, shape: Shape) -> Path:
        return CACHE / f"{name}-as-{str(shape).replace(',', '-')}{suffix}"

    return (
        Build.start(builder, models / "stories260K", folder("stories260K", target), target, *options),
        Build.start(
            builder, models / "stories260K-draft", folder("stories260K-draft", draft), draft, *options
        ),
    )


BIG_TARGET = Shape(4096, 14336, 32, 128)
"""Llama-3.1-8B's shape (the builder keeps the source's 2:1 grouping: 32 query, 16 KV heads)."""
BIG_DRAFT = Shape(2048, 8192, 16, 64)
"""Llama-3.2-1B's shape."""
BIG_BUILD = ("--dtype", "bfloat16", "--device", "cuda")
"""The 8B/1B pair is built on the GPU in bfloat16: 16 GB written, not 30 GB of float32."""


WHOLE_KS = "2,4,6"
LOSSY_THRESHOLD = "0.02"
"""fuzzy's JS threshold and mixture's per-token KL budget (nats) in phase 2: a cost of at most
0.02 nats a token."""


def bench_base(args: argparse.Namespace, target: str, draft: str, output: Path) -> list[str]:
    """`fsd-chat bench` on a pair, few prompts and tokens (the check's 7 minutes), each
    configuration's replies cut past `--config-cap` less its warm-up's share."""
    return [
        *(sys.executable, "-m", "fsd_chat", "bench", "--target", target, "--draft", draft),
        *("--device", args.device, "--dtype", args.dtype),
        *("--prompts", "tinystories", "--data-dir", str(args.data_dir), "--limit", str(args.limit)),
        *("--max-new-tokens", str(args.max_new_tokens), "--output", str(output)),
        *("--cut-after", f"{args.config_cap * REPLIES_SHARE:g}", "--temperature", "0"),
    ]


MIN_CAP = 15.0
"""The least a bench is started with: less would not load the pair."""
REPLIES_SHARE = 0.4
"""The share of a configuration's cap its measured replies may take (the rest is its warm-up's,
which compiles or captures): 20 s of 50."""


@dataclass(frozen=True, slots=True)
class Bench:
    """One capped `fsd-chat bench` process: what it runs, its configurations' count (its cap) and
    its report folder."""

    what: str
    command: list[str]
    configs: int
    output: Path

    def cap(self, args: argparse.Namespace) -> float:
        """Its hard cap in seconds: the load, then `--config-cap` a configuration."""
        return float(args.load_cap + self.configs * args.config_cap)

    @property
    def report(self) -> Path:
        """Its report.json."""
        return self.output / "report.json"


START_PROMPT = "Once upon a time"
START_TOKENS = 8
"""The start's reply: a few tokens, so that its seconds are the start's (load, compile, capture)."""


START_GOALS = (60.0, 10.0)
"""Issue 45's goals for the real-cost pair's start, compilation and capture included: seconds of
the first start and of a second one."""


@dataclass(frozen=True, slots=True)
class Start:
    """One timed start of `generate`: its outcome ("ok", "failed", "cut") and wall seconds from
    launch to exit."""

    outcome: str
    seconds: float


def start_command(args: argparse.Namespace, target: str, draft: str) -> list[str]:
    """`fsd-chat generate` over the pair as the chat starts it on a GPU with `--whole-step`: its
    graphs compiled and captured while the models load, then `START_TOKENS` greedy tokens."""
    return [
        *(sys.executable, "-m", "fsd_chat", "generate", "--target", target, "--draft", draft),
        *("--device", args.device, "--dtype", args.dtype, "--whole-step", "--temperature", "0"),
        *("--max-new-tokens", str(START_TOKENS), "--raw", START_PROMPT),
    ]


def compile_cache_env(cache: Path) -> dict[str, str]:
    """The environment that keeps a process's compile caches under `cache`: fsd-chat's artifacts
    (`FSD_CHAT_CACHE_DIR`) and torch's own inductor and Triton caches (`TORCHINDUCTOR_CACHE_DIR`)."""
    return {"FSD_CHAT_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


def time_starts(console: Console, command: list[str], cache: Path, caps: tuple[float, float]) -> list[Start]:
    """Time `command` twice (issue 45's first and second start), each under its cap: first over
    empty compile caches (`compile_cache_env(cache)`, emptied first), then over what the first
    left there. The second is not run when the first did not end well."""
    shutil.rmtree(cache, ignore_errors=True)
    env = compile_cache_env(cache)
    starts: list[Start] = []
    for which, cap in zip(("first start", "second start"), caps, strict=True):
        began = time.monotonic()
        outcome = run_capped(console, command, cap, f"the {which}", **env)
        starts.append(Start(outcome, time.monotonic() - began))
        if outcome != "ok":
            break
    return starts


def starts_line(starts: list[Start]) -> str:
    """The starts in one line, beside issue 45's goals."""
    parts = []
    for which, start, goal in zip(("first start", "second start"), starts, START_GOALS, strict=False):
        outcome = "" if start.outcome == "ok" else f", {start.outcome}"
        parts.append(f"{which} {start.seconds:.1f} s (goal ≤ {goal:g} s{outcome})")
    return "gpu-check: the real-cost pair's " + ", ".join(parts)


def exact_rows(args: argparse.Namespace, target: str, draft: str, output: Path, *, whole: bool) -> Bench:
    """Target-only and exact at k 2, 4, 6 under fixed k and the chat's default policy."""
    command = [
        *bench_base(args, target, draft, output),
        *("--baselines", "autoregressive,exact", "--rules", "none", "--draft-tokens", WHOLE_KS),
        *("--draft-policies", f"fixed,{DEFAULT_DRAFT_POLICY}"),
    ]
    # The per-forward compiled steps: the whole step replaced them as CUDA's default.
    command += ["--whole-step", "--profile"] if whole else ["--no-whole-step"]
    what = "target-only, exact k 2/4/6 (fixed, default policy)" + (
        " as whole steps" if whole else ", per-forward steps"
    )
    return Bench(what, command, 1 + 2 * len(WHOLE_KS.split(",")), output)


def lossy_rows(args: argparse.Namespace, target: str, draft: str, output: Path) -> Bench:
    """fuzzy (JS) and mixture at k 4 and `LOSSY_THRESHOLD`, whole steps, profiled."""
    command = [
        *bench_base(args, target, draft, output),
        *("--baselines", "none", "--rules", "fuzzy,mixture", "--draft-tokens", "4", "--divergences", "js"),
        *(
            "--thresholds",
            LOSSY_THRESHOLD,
            "--mixture-thresholds",
            LOSSY_THRESHOLD,
            "--draft-policies",
            "fixed",
        ),
        *("--whole-step", "--profile"),
    ]
    return Bench(f"fuzzy and mixture at {LOSSY_THRESHOLD}, k 4, as whole steps", command, 2, output)


def quantized_rows(args: argparse.Namespace, target: str, draft: str, output: Path, k: int) -> Bench:
    """A 4-bit (NF4) target: target-only and exact at `k`, whole steps, profiled."""
    command = [
        *bench_base(args, target, draft, output),
        *("--quantize-target", "4bit", "--baselines", "autoregressive,exact", "--rules", "none"),
        *("--draft-tokens", str(k), "--draft-policies", "fixed", "--whole-step", "--profile"),
    ]
    return Bench(f"4-bit target: target-only and exact k {k}, as whole steps", command, 2, output)


def transformers_row(args: argparse.Namespace, target: str, draft: str, output: Path, method: str) -> Bench:
    """One of transformers' baselines alone in its process (hf-assisted at k 4)."""
    command = [
        *bench_base(args, target, draft, output),
        *("--baselines", method, "--rules", "none", "--draft-tokens", "4", "--draft-policies", "fixed"),
    ]
    return Bench(f"transformers' {method}" + (" k 4" if method == "hf-assisted" else ""), command, 1, output)


ABORT_GRACE = 5.0
"""Seconds a process cut at its cap has to print its stacks (SIGABRT) before it is killed."""


def run_capped(console: Console, command: list[str], cap: float, what: str, **env: str) -> str:
    """Run `command` in a process group of its own, killed whole (compile workers too) past `cap`
    seconds: "ok", "failed" (its exit status was not 0) or "cut" (killed at the cap, said in one
    line). A cut process first gets SIGABRT, on which Python's faulthandler (PYTHONFAULTHANDLER)
    prints every thread's stack, so the log says where it sat; SIGKILL follows. Ctrl-C kills it too,
    and is raised again."""
    process = subprocess.Popen(
        command, start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1", **env}
    )
    try:
        code = process.wait(timeout=cap)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as stop:
        if isinstance(stop, subprocess.TimeoutExpired):
            _signal_group(process.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=ABORT_GRACE)
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        if isinstance(stop, KeyboardInterrupt):
            raise
        console.print(
            Text(
                f"gpu-check: cut: {what} ran past its cap of {cap:.0f} s and was killed (its stacks are "
                "above); the check goes on",
                style="yellow",
            )
        )
        return "cut"
    if code:
        return "failed"
    return "ok"


def _signal_group(group: int, number: signal.Signals) -> None:
    """Send `number` to every process of `group` that is left (none may be)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, number)


def best_exact_k(report: Path) -> int:
    """The fixed k of the fastest exact row in `report` (4 when it has none)."""
    if not report.is_file():
        return 4
    configs = json.loads(report.read_text(encoding="utf-8"))["configs"]
    rows = [
        c for c in configs if c["method"] == "exact" and c["draft_policy"] == "fixed" and c["status"] == "ok"
    ]
    return int(max(rows, key=lambda c: c["tokens_per_second"])["draft_tokens"]) if rows else 4


def versions_lines(device: str) -> list[str]:
    """The imports the check needs and their versions, one line (a missing one says so)."""
    parts = [f"python {sys.version.split()[0]}"]
    for name in ("torch", "transformers", "bitsandbytes", "gguf", "textual", "fastapi", "typer"):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            parts.append(f"{name} MISSING ({exc})")
            continue
        parts.append(f"{name} {importlib.metadata.version(name)}")
    import torch

    parts.append(f"CUDA {torch.version.cuda or '-'} on {device}")
    try:
        import fsd_chat.cli.app  # noqa: F401  (every command's module-level imports)
    except ImportError as exc:
        return [", ".join(parts), f"gpu-check: fsd-chat does not import: {exc}"]
    return [", ".join(parts)]


@contextmanager
def phase(console: Console, number: int, total: int, what: str) -> Iterator[None]:
    """A line when a phase starts, and one with its seconds when it ends."""
    console.print(Text(f"gpu-check {number}/{total}: {what}", style="bold"))
    start = time.monotonic()
    yield
    console.print(Text(f"gpu-check {number}/{total}: done in {time.monotonic() - start:.0f} s", style="dim"))


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit code (1 when a CUDA test or a bench failed or was cut)."""
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("../shared/models"), help="offline models folder")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"), help="bench's prompt sets")
    parser.add_argument("--builder", type=Path, default=Path("../shared/tools/build_scaled_target.py"))
    parser.add_argument("--target", help="target model (default: the scaled stories260K, head_dim 64)")
    parser.add_argument("--draft", help="draft model (default: stories260K-draft)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the benches alone)")
    parser.add_argument("--dtype", default="bfloat16", help="the pairs' dtype in the benches")
    parser.add_argument("--limit", type=int, default=4, help="bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="bench tokens per reply")
    parser.add_argument(
        "--config-cap",
        type=float,
        default=50.0,
        help="seconds a configuration may take, warm-up and replies (40%%) together, before its bench is killed",
    )
    parser.add_argument(
        "--load-cap", type=float, default=60.0, help="seconds a bench may take to load and time"
    )
    parser.add_argument("--tests-cap", type=float, default=150.0, help="seconds pytest -m cuda may take")
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds the whole check may take: a bench gets at most what is left of it (pytest's cap kept)",
    )
    parser.add_argument(
        "--start-cap",
        type=float,
        default=240.0,
        help="seconds the real-cost pair's first start (generate: load, compile, capture) may take; the second gets a third",
    )
    parser.add_argument("--build-cap", type=float, default=240.0, help="seconds a pair's build may take")
    parser.add_argument(
        "--big-pair",
        action="store_true",
        help="last, an 8B/1B-cost pair (Llama-3.1-8B's and Llama-3.2-1B's shapes, built on the GPU in "
        "bfloat16): target-only and exact k 4 as whole steps (beyond the 7 minutes)",
    )
    parser.add_argument(
        "--output", type=Path, default=CACHE / "gpu-check", help="the reports' folder (one folder a bench)"
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
    args = parser.parse_args(argv)

    on_cuda = args.device.startswith("cuda")
    device = _cuda_device() if on_cuda else "cpu"
    if device is None:
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check.")
        return 0
    console = Console(highlight=False, soft_wrap=True)  # a log keeps each line whole
    console.print(Text(f"gpu-check on {device}", style="bold"))
    CACHE.mkdir(exist_ok=True)
    # The real-cost pair (6.5 GB of float32 weights, a minute or more) is built while phase 1 and the
    # scaled pair's build run: the check's 7 minutes have no room for it in series.
    builds = real_cost_pair(args.models, args.builder, args.real_target, args.real_draft)
    out = args.output
    outcomes: list[str] = []

    started = time.monotonic()
    tests_pending = on_cuda

    def left() -> float:
        # The check's budget, less what pytest (last) may take: a bench that would run past it gets
        # what is left, and none when too little is.
        return args.budget - (time.monotonic() - started) - (args.tests_cap if tests_pending else 0)

    # The real-cost pair's benches compile what its starts compiled (the same graphs): they find it
    # in the starts' caches instead of compiling it again within their caps.
    real_cost_caches = out / "real-cost-compile-cache"
    real_cost_env = compile_cache_env(real_cost_caches)

    def too_little(cap: float, what: str) -> bool:
        # Less than a bench needs to load is not started: one line says so, and it counts as cut.
        if cap >= MIN_CAP:
            return False
        console.print(
            Text(f"gpu-check: cut: {what} not run: the check's {args.budget:.0f} s are spent", style="yellow")
        )
        outcomes.append("cut")
        return True

    def bench(run: Bench, *, budgeted: bool = True, env: dict[str, str] | None = None) -> None:
        cap = min(run.cap(args), left()) if budgeted else run.cap(args)
        if too_little(cap, run.what):
            return
        console.print(Text(f"gpu-check: {run.what} (cap {cap:.0f} s)", style="dim"))
        outcome = run_capped(console, run.command, cap, run.what, **(env or {}))
        if outcome == "failed":
            console.print(
                Text(f"gpu-check: failed: {run.what} (its error is above); the check goes on", style="red")
            )
        outcomes.append(outcome)

    failed = 0
    pair: list[str] = []  # the real-cost target and draft, once built

    def imports() -> None:
        for line in versions_lines(device):
            console.print(Text(line))

    def time_the_starts() -> None:
        first_cap = min(args.start_cap, left())
        if too_little(first_cap, "the starts"):
            return
        command = start_command(args, pair[0], pair[1])
        starts = time_starts(console, command, real_cost_caches, (first_cap, first_cap / 3))
        console.print(Text(starts_line(starts), style="bold"))
        out.mkdir(parents=True, exist_ok=True)
        report = {"command": command, "starts": [asdict(s) for s in starts], "goals_seconds": START_GOALS}
        (out / "start.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        outcomes.extend(start.outcome for start in starts)

    def whole_steps() -> None:
        try:
            pair.extend(str(build.wait(args.build_cap)) for build in builds)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            console.print(
                Text(
                    f"gpu-check: the real-cost pair did not build ({exc}); its phases are skipped",
                    style="red",
                )
            )
            outcomes.append("failed")
            return
        time_the_starts()
        bench(exact_rows(args, pair[0], pair[1], out / "real-whole", whole=True), env=real_cost_env)
        bench(lossy_rows(args, pair[0], pair[1], out / "real-lossy"), env=real_cost_env)

    def quantized() -> None:
        if not pair or not on_cuda:
            console.print(
                Text("gpu-check: skipped (bitsandbytes' 4-bit target needs CUDA and the real-cost pair)")
            )
            return
        bench(
            quantized_rows(
                args, pair[0], pair[1], out / "real-4bit", best_exact_k(out / "real-whole" / "report.json")
            )
        )

    def per_forward_and_transformers() -> None:
        if not pair:
            console.print(Text("gpu-check: skipped (no real-cost pair)"))
            return
        per_forward = exact_rows(args, pair[0], pair[1], out / "real-per-forward", whole=False)
        static = transformers_row(args, pair[0], pair[1], out / "real-hf-static", "hf-static")
        assisted = transformers_row(args, pair[0], pair[1], out / "real-hf-assisted", "hf-assisted")
        # hf-static first: the reference of issue 36's goals, worth more than per-forward steps.
        for run in (static, per_forward, assisted):
            bench(run, env=real_cost_env)
        whole = [out / name / "report.json" for name in ("real-whole", "real-lossy")]
        console.print(whole_step_table([per_forward.report, static.report, assisted.report], whole))

    def scaled_pair() -> None:
        target = args.target or str(_scaled_target(args.models, args.builder))
        draft = args.draft or str(args.models / "stories260K-draft")
        command = [
            *bench_base(args, target, draft, out / "scaled-whole"),
            *("--baselines", "autoregressive,exact", "--rules", "none", "--draft-tokens", "4"),
            *("--draft-policies", "fixed", "--whole-step", "--profile"),
        ]
        what = f"{Path(target).name} / {Path(draft).name}: target-only, exact k 4"
        bench(Bench(what, command, 2, out / "scaled-whole"))

    def cuda() -> None:
        nonlocal failed, tests_pending
        tests_pending = False
        if on_cuda:
            failed = cuda_tests(console, args)
        else:
            console.print(Text("gpu-check: the CUDA tests need CUDA: skipped"))

    def big_pair() -> None:
        console.print(
            Text(f"gpu-check: building target {BIG_TARGET}, draft {BIG_DRAFT} on the GPU in bfloat16")
        )
        built: list[str] = []
        for build in real_cost_pair(args.models, args.builder, BIG_TARGET, BIG_DRAFT, *BIG_BUILD):
            try:
                built.append(str(build.wait(args.build_cap)))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                console.print(Text(f"gpu-check: the 8B/1B pair did not build ({exc})", style="red"))
                outcomes.append("failed")
                return
        command = [
            *bench_base(args, built[0], built[1], out / "big-whole"),
            *("--baselines", "autoregressive,exact", "--rules", "none"),
            *("--draft-tokens", "4", "--draft-policies", "fixed", "--whole-step", "--profile"),
        ]
        what = "the 8B/1B pair: target-only, exact k 4, as whole steps"
        bench(Bench(what, command, 2, out / "big-whole"), budgeted=False)

    phases = [
        ("imports and versions", imports),
        (f"the real-cost pair in {args.dtype} as whole steps, profiled", whole_steps),
        ("the real-cost pair with a 4-bit target (NF4), target-only and the best exact k", quantized),
        ("hf-static, per-forward steps and hf-assisted (one process each)", per_forward_and_transformers),
        ("the scaled story pair as whole steps, profiled", scaled_pair),
        ("the CUDA tests (pytest -m cuda)", cuda),
    ]
    if args.big_pair:
        phases.append(("the 8B/1B-cost pair (--big-pair)", big_pair))
    for number, (what, run) in enumerate(phases, 1):
        if number == 2 and not all(build.done() for build in builds):
            # Nothing waits on the builder while something else can run: the scaled pair first.
            console.print(
                Text("gpu-check: the real-cost pair is still building: the scaled pair first", style="dim")
            )
            phases.insert(1, phases.pop(4))
            what, run = phases[1]
        with phase(console, number, len(phases), what):
            run()
    console.print(Text(f"gpu-check: the reports are under {out}/ (one folder a bench)"))
    return 1 if failed or any(o != "ok" for o in outcomes) else 0


def cuda_tests(console: Console, args: argparse.Namespace) -> int:
    """`pytest -m cuda tests/test_cuda.py` under `--tests-cap`, and its tables; the number of tests
    that failed (1 when pytest did not start or was cut: one line says so)."""
    junit = CACHE / "gpu-check-tests.xml"
    junit.unlink(missing_ok=True)
    # Only the CUDA tests' module: collecting the whole suite would import the chat's and the
    # server's test dependencies, which a GPU image need not have.
    tests = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", f"--junitxml={junit}", "tests/test_cuda.py"]
    if importlib.util.find_spec("xdist") is not None:
        # Two workers compile the module's two halves side by side (tests/test_cuda.py's groups).
        tests += ["-n", "2", "--dist", "loadgroup"]
    outcome = run_capped(console, tests, args.tests_cap, "pytest -m cuda", FSD_CHAT_MODELS=str(args.models))
    try:
        table, failed = _test_table(junit)
    except (OSError, ET.ParseError) as exc:
        table, failed, why = None, 1, f"no report: {exc}"
    else:
        why = "no test ran"
    if table is None or (not table.row_count and outcome != "ok"):
        console.print(
            Text(
                f"gpu-check: pytest -m cuda did not start or finish ({outcome}, {why}; its error is above)",
                style="red",
            )
        )
        return 1
    console.print(table)
    rates = _rate_table(junit)
    if rates is not None:
        console.print(rates)
    return failed or outcome != "ok"


if __name__ == "__main__":
    sys.exit(main())
