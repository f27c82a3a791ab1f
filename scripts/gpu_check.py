"""`make gpu-check`: check a CUDA setup in one command, in under 5 minutes on a fresh machine.

Runs the CUDA tests (`pytest -m cuda tests/test_cuda.py`: greedy identity, CUDA graphs (`--compile`,
on by default on CUDA) against eager decoding, bfloat16 / float16, 8-bit and 4-bit targets,
losslessness on batched verdicts, device_map="auto", host synchronisations)
and prints their table, then a short `fsd-chat bench` of the scaled pair in bfloat16 with the target
unquantized, 8-bit and 4-bit: tokens/s and ×AR of target-only decoding, exact, fuzzy, mixture and
transformers' assisted generation (bench's table, and its report.json under --output).
With no CUDA device it says so in one line and exits 0.

The pair is stories260K's scaled copy (79M parameters, head_dim 64: the source's head_dim of 8 sends
attention to kernels no real model meets), built once by the shared builder into .cache/, with the
offline draft; or any pair given with --target / --draft. --device cpu runs the same bench on the
CPU (the CPU suite checks this script that way).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

CACHE = Path(".cache")
HEAD_DIM = 64
"""Head size of the scaled target: that of SmolLM2 and Llama-style models of its size."""


def _cuda_device() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


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


def _scaled_target(models: Path, builder: Path) -> Path:
    """The scaled copy of stories260K with head_dim 64, built on first use (deterministic, seconds)."""
    out = CACHE / f"stories260K-scaled-hd{HEAD_DIM}"
    if not (out / "config.json").is_file():
        source = models / "stories260K"
        subprocess.run(
            [sys.executable, str(builder), str(source), str(out), "--head-dim", str(HEAD_DIM)], check=True
        )
    return out


def bench_command(args: argparse.Namespace, target: str, draft: str) -> list[str]:
    """The `fsd-chat bench` command line of the check: one threshold per rule, few prompts, few
    tokens (the whole check must fit in 5 minutes), every quantization of the target in one run."""
    return [
        *(sys.executable, "-m", "fsd_chat", "bench", "--target", target, "--draft", draft),
        *("--device", args.device, "--dtype", args.dtype, "--quantize-target", args.quantize),
        *("--prompts", "tinystories", "--data-dir", str(args.data_dir), "--limit", str(args.limit)),
        *("--max-new-tokens", str(args.max_new_tokens), "--rules", "fuzzy,mixture"),
        *("--divergences", "js", "--thresholds", "0.05", "--mixture-thresholds", "0.05"),
        *("--baselines", "autoregressive,exact,hf-assisted", "--output", str(args.output)),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit code (1 when a CUDA test or the bench failed)."""
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("../shared/models"), help="offline models folder")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"), help="bench's prompt sets")
    parser.add_argument("--builder", type=Path, default=Path("../shared/tools/build_scaled_target.py"))
    parser.add_argument("--target", help="target model (default: the scaled stories260K, head_dim 64)")
    parser.add_argument("--draft", help="draft model (default: stories260K-draft)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the bench alone, no tests)")
    parser.add_argument("--dtype", default="bfloat16", help="the pair's dtype in the bench")
    parser.add_argument(
        "--quantize", default="none,8bit,4bit", help="the target's quantizations in the bench"
    )
    parser.add_argument("--limit", type=int, default=4, help="bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="bench tokens per reply")
    parser.add_argument(
        "--output", type=Path, default=CACHE / "gpu-check-bench", help="bench's report folder"
    )
    args = parser.parse_args(argv)

    on_cuda = args.device.startswith("cuda")
    device = _cuda_device() if on_cuda else "cpu"
    if device is None:
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check.")
        return 0
    console = Console(highlight=False)
    console.print(Text(f"gpu-check on {device}", style="bold"))
    CACHE.mkdir(exist_ok=True)
    failed = 0
    if on_cuda:
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

    target = args.target or str(_scaled_target(args.models, args.builder))
    draft = args.draft or str(args.models / "stories260K-draft")
    bench_run = subprocess.run(bench_command(args, target, draft))
    console.print(Text(f"gpu-check: the bench's report is {args.output / 'report.json'}"))
    return 1 if failed or bench_run.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
