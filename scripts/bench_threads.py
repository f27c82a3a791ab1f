"""`fsd-chat generate` tokens/s under the CPU thread policy against torch's default thread count
(one per core), with the machine as it is and with one more process keeping a core busy.

Runs the real command line (`fsd-chat generate --json`) in subprocesses, interleaved over
repeats; prints the figures and writes them to a JSON file:

    .venv/bin/python scripts/bench_threads.py --output bench-threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import psutil

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
FSD_CHAT = Path(sys.executable).with_name("fsd-chat")


def generate_tps(args: argparse.Namespace, threads: int | None) -> float:
    """Decode tokens/s of one `fsd-chat generate` run (greedy, k = 5, js T = 0.05)."""
    command = [str(FSD_CHAT), "generate", "Once upon a time", "--json", "--target", args.target]
    command += ["--draft", args.draft, "--max-new-tokens", str(args.tokens), "--draft-tokens", "5"]
    command += ["--divergence", "js", "--threshold", "0.05", "--device", "cpu"]
    if threads is not None:
        command += ["--threads", str(threads)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["stats"]["tokens_per_second"])


@contextmanager
def busy_core() -> Iterator[None]:
    """One more process keeping a core busy (a Python loop) while the block runs."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(MODELS / "stories260K"))
    parser.add_argument("--draft", default=str(MODELS / "stories260K-draft"))
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("bench-threads.json"))
    args = parser.parse_args()
    cores = psutil.cpu_count() or 1
    settings = {"policy": None, f"torch default ({cores})": cores}
    results: dict[str, dict[str, list[float]]] = {"as is": {}, "one busy core": {}}
    for condition in results:
        with busy_core() if condition == "one busy core" else nullcontext():
            for _ in range(args.repeats):
                for name, threads in settings.items():
                    tps = generate_tps(args, threads)
                    results[condition].setdefault(name, []).append(tps)
                    print(f"{condition:14s} {name:18s} {tps:8.1f} tok/s", flush=True)
    medians = {c: {n: statistics.median(v) for n, v in r.items()} for c, r in results.items()}
    report = {
        "cores": cores,
        "load_average": os.getloadavg(),
        "tokens": args.tokens,
        "tokens_per_second": results,
        "median": medians,
        "policy_busy_over_as_is": medians["one busy core"]["policy"] / medians["as is"]["policy"],
    }
    args.output.write_text(json.dumps(report, indent=2))
    for condition, row in medians.items():
        print(condition, "  ".join(f"{n}: {v:.1f}" for n, v in row.items()))
    print(f"policy, one busy core / as is: {report['policy_busy_over_as_is']:.2f}  ({args.output})")


if __name__ == "__main__":
    main()
