"""`make gpu-check`: check a CUDA setup in one command.

Runs the CUDA tests (`pytest -m cuda`: greedy identity, bfloat16 / float16, 8-bit and 4-bit targets,
losslessness, device_map="auto", host synchronisations) and prints their table, then a quick
`fsd-chat bench` of the CPU-scale pair on the GPU in bfloat16 with the target unquantized, 8-bit
and 4-bit (tokens/s, ×AR, ×exact, ×HF assisted, per-forward times, share outside the forward passes).
With no CUDA device it says so in one line and exits 0.

The pair is stories260K's CPU-scale copy (built once by the shared builder script into .cache/)
with the offline draft, or any pair given with --target / --draft.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

CACHE = Path(".cache")


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
    """The CPU-scale copy of stories260K, built on first use (deterministic, a few seconds)."""
    out = CACHE / "stories260K-scaled"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, str(builder), str(models / "stories260K"), str(out)], check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit code (1 when a CUDA test failed)."""
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("../shared/models"), help="offline models folder")
    parser.add_argument("--builder", type=Path, default=Path("../shared/tools/build_scaled_target.py"))
    parser.add_argument("--target", help="target model (default: the CPU-scale stories260K)")
    parser.add_argument("--draft", help="draft model (default: stories260K-draft)")
    args = parser.parse_args(argv)

    device = _cuda_device()
    if device is None:
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check.")
        return 0
    console = Console(highlight=False)
    console.print(Text(f"gpu-check on {device}", style="bold"))
    CACHE.mkdir(exist_ok=True)
    junit = CACHE / "gpu-check-tests.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", f"--junitxml={junit}", "tests"])
    table, failed = _test_table(junit)
    console.print(table)

    target = args.target or str(_scaled_target(args.models, args.builder))
    draft = args.draft or str(args.models / "stories260K-draft")
    bench = [
        *(sys.executable, "-m", "fsd_chat", "bench", "--target", target, "--draft", draft),
        *("--device", "cuda", "--dtype", "bfloat16", "--quantize-target", "none,8bit,4bit"),
        *("--prompts", "tinystories", "--limit", "8", "--max-new-tokens", "96"),
        *("--divergences", "js", "--thresholds", "0.05", "--output", str(CACHE / "gpu-check-bench")),
    ]
    bench_run = subprocess.run(bench)
    return 1 if failed or bench_run.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
