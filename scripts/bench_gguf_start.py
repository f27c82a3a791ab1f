"""Start time of a GGUF model: the first start (converting the file into an empty cache), the second
start (loading the converted copy), and the start from the equivalent safetensors folder (a copy of
that converted folder, named directly).

Each start is a fresh process that imports fsd-chat and runs `load_pair` for the target alone
(prompt lookup) on the CPU: `load_s` is `load_pair`'s wall time, `process_s` the whole process's
(Python, imports and load, as a user waits for it). First starts come first, one a fresh cache; then
the second starts and the folder starts alternate, which order first switching every repeat, so
the machine's load drifts into both alike. Prints the figures and writes them to a JSON file:

    .venv/bin/python scripts/bench_gguf_start.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --output bench-gguf-start.json

Ratios: second / folder, the median of the repeats' paired ratios with its distribution-free 95%
interval (`fsd_chat.bench.stats.median_ci95`: at least 6 repeats); first / second, the mean with a
normal-approximation 95% interval (`mean_ci95`: few first starts, so it undercovers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsd_chat.bench.stats import mean_ci95, median_with_ci95
from fsd_chat.models.default_model import default_model_path
from fsd_chat.support.config import ENV_CACHE_DIR

LOAD = """
import sys, time
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
start = time.perf_counter()
load_pair(ModelSpec(sys.argv[1]), ModelSpec(LOOKUP), LoadOptions(device="cpu", dtype=sys.argv[2]), lambda _: None)
print(time.perf_counter() - start)
"""


def start(source: str, cache: Path, dtype: str) -> dict[str, float]:
    """One start in a fresh process: {"load_s": load_pair's seconds, "process_s": the process's}."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", LOAD, source, dtype],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, ENV_CACHE_DIR: str(cache), "TQDM_DISABLE": "1"},
    )
    return {"load_s": float(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=default_model_path())
    parser.add_argument("--firsts", type=int, default=3, help="first starts (a minute each for 135M)")
    parser.add_argument("--repeats", type=int, default=8, help="second and folder starts, each")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", type=Path, default=Path("bench-gguf-start.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"first": [], "second": [], "folder": []}
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as scratch:
        root = Path(scratch)
        cache = root / "cache-0"
        for index in range(args.firsts):
            cache = root / f"cache-{index}"
            runs["first"].append(start(str(args.gguf), cache, args.dtype))
            print(
                f"first  {runs['first'][-1]['load_s']:7.2f} s load {runs['first'][-1]['process_s']:7.2f} s process",
                flush=True,
            )
        converted = next((cache / "gguf").iterdir())
        folder = Path(shutil.copytree(converted, root / "folder"))
        for index in range(args.repeats):
            order = ("second", "folder") if index % 2 == 0 else ("folder", "second")
            for kind in order:
                runs[kind].append(
                    start(str(args.gguf) if kind == "second" else str(folder), cache, args.dtype)
                )
                print(
                    f"{kind:6s} {runs[kind][-1]['load_s']:7.2f} s load {runs[kind][-1]['process_s']:7.2f} s process",
                    flush=True,
                )
    summary: dict[str, object] = {}
    for measure in ("load_s", "process_s"):
        values = {kind: [run[measure] for run in runs[kind]] for kind in runs}
        second_over_folder = [s / f for s, f in zip(values["second"], values["folder"], strict=True)]
        median, interval = median_with_ci95(second_over_folder)
        first_over_second = [f / statistics.median(values["second"]) for f in values["first"]]
        mean, half = mean_ci95(first_over_second)
        summary[measure] = {
            "median_s": {kind: statistics.median(v) for kind, v in values.items()},
            "second_over_folder": {"median": median, "ci95": interval, "ratios": second_over_folder},
            "first_over_second": {"mean": mean, "ci95_half_width": half, "ratios": first_over_second},
        }
        bounds = f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "(too few repeats)"
        spread = f" ± {half:.2f}" if half is not None else ""
        print(
            f"{measure}: median first {statistics.median(values['first']):.2f} s, second "
            f"{statistics.median(values['second']):.2f} s, folder {statistics.median(values['folder']):.2f} s; "
            f"second/folder {median:.2f} {bounds}; first/second {mean:.1f}{spread}"
        )
    record = {"gguf": str(args.gguf), "dtype": args.dtype, "runs": runs, "summary": summary}
    args.output.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
