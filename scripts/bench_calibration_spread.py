"""How much llama.cpp's calibration (`fsd_chat.engines.llama_calibration`) varies from process to
process: V(1), V(2)/V(1) and V(6)/V(1) of the default model at the chat's split (one thread a token,
two a batch), each calibration in a fresh process timing into a fresh folder
(`FSD_CHAT_CALIBRATION_DIR`), with the machine as it is and with one more process keeping a core busy
(`scripts.bench_threads.busy_core`), beside the interleaved table's medians
(docs/llama-forward-table.json, "1, batches 2").

`--code LABEL=DIR` (repeatable) names a checkout whose fsd_chat the calibrating processes import (e.g.
the commit before a change, extracted with `git archive`), so that two calibrations are compared
side by side: the checkouts, runs and conditions interleaved (a load that comes and goes touches
each alike). Each process also says how long its calibration took and whether it was kept (written).

    git archive main | tar -x -C /tmp/before
    flock /work/bench.lock env PYTHONPATH=. .venv/bin/python -m scripts.bench_calibration_spread \\
        --code before=/tmp/before --code after=. --output docs/calibration-spread.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from scripts.bench_threads import busy_core  # a child run by path finds `scripts` on PYTHONPATH

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "llama-forward-table.json"
SPLIT = (1, 2)
"""The chat's split on a 2-core CPU: one thread a token, two a batch (threads for a token, a batch)."""
CONDITIONS = ("as is", "one busy core")


def calibrate_once() -> None:
    """In a fresh process: load the default model on llama.cpp, set the chat's split as `use_threads`
    does (llama.cpp's counts, torch on one thread) and find its forward times (`forward_times`,
    timing into the empty folder it is given); print V(1..6), the seconds taken and whether a file
    was written, as one JSON line."""
    import torch

    import fsd_chat
    from fsd_chat.engines.llama_calibration import forward_times
    from fsd_chat.engines.llama_cpp import LlamaCppModel
    from fsd_chat.models.default_model import default_model_path
    from fsd_chat.models.loading import load_pair
    from fsd_chat.models.options import LoadOptions, ModelSpec

    pair = load_pair(
        ModelSpec(str(default_model_path())), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1)
    )
    target = pair.target
    assert isinstance(target, LlamaCppModel)
    target.set_threads(*SPLIT)
    torch.set_num_threads(1)
    start = time.perf_counter()
    seconds = forward_times(target)
    took = time.perf_counter() - start
    kept = any(Path(os.environ["FSD_CHAT_CALIBRATION_DIR"]).glob("*.json"))
    print(json.dumps({"seconds": seconds, "took": took, "kept": kept, "fsd_chat": fsd_chat.__file__}))


def run_child(code: Path) -> dict[str, Any]:
    """One calibration in a fresh process importing `code`'s fsd_chat, into a fresh folder."""
    with tempfile.TemporaryDirectory() as folder:
        env = os.environ | {"PYTHONPATH": f"{code.resolve()}:{ROOT}", "FSD_CHAT_CALIBRATION_DIR": folder}
        # Run by path from `code`: neither the working folder nor the script's puts this checkout's
        # fsd_chat before `code`'s (as `-m` from here would).
        command = [sys.executable, str(Path(__file__).resolve()), "--child"]
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=code).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["load"] = os.getloadavg()[0]
    return result


def spread(values: list[float]) -> dict[str, float]:
    """Median, least and most."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """V(1) in ms, V(2)/V(1), V(6)/V(1) and the seconds taken over `runs`; how many were kept."""
    return {
        "v1_ms": spread([r["seconds"][0] * 1e3 for r in runs]),
        "v2_over_v1": spread([r["seconds"][1] / r["seconds"][0] for r in runs]),
        "v6_over_v1": spread([r["seconds"][5] / r["seconds"][0] for r in runs]),
        "seconds_taken": spread([r["took"] for r in runs]),
        "kept": sum(r["kept"] for r in runs),
        "runs": len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--code", action="append", default=[], help="LABEL=DIR (default: after=.)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.child:
        calibrate_once()
        return
    if args.output is None:
        parser.error("--output is required")
    codes = dict(item.split("=", 1) for item in args.code) or {"after": "."}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {label: [] for label in codes} for c in CONDITIONS}
    for condition in CONDITIONS:
        with busy_core() if condition == "one busy core" else nullcontext():
            for i in range(args.runs):
                for label, code in codes.items():
                    result = run_child(Path(code))
                    runs[condition][label].append(result)
                    v = result["seconds"]
                    print(
                        f"{condition:13s} {label:8s} {i:2d}  V(1) {v[0] * 1e3:5.2f} ms  "
                        f"V(2)/V(1) {v[1] / v[0]:.2f}  V(6)/V(1) {v[5] / v[0]:.2f}  "
                        f"{result['took']:.2f} s  kept {result['kept']}  load {result['load']:.2f}",
                        flush=True,
                    )
    table = json.loads(TABLE.read_text())["1, batches 2"]["measured_seconds"]
    summaries = {c: {label: summary(r) for label, r in by_code.items()} for c, by_code in runs.items()}
    report = {
        "split": SPLIT,
        "load_average": os.getloadavg(),
        "cores": os.cpu_count(),
        "codes": codes,
        "table_1_batches_2": {
            "v1_ms": table[0] * 1e3,
            "v2_over_v1": table[1] / table[0],
            "v6_over_v1": table[5] / table[0],
        },
        "summary": summaries,
        "runs": runs,
    }
    args.output.write_text(json.dumps(report, indent=1))
    for condition, by_code in summaries.items():
        for label, s in by_code.items():
            print(
                f"{condition:13s} {label:8s} V(1) {s['v1_ms']['median']:.2f} ms "
                f"[{s['v1_ms']['min']:.2f}-{s['v1_ms']['max']:.2f}]  V(2)/V(1) {s['v2_over_v1']['median']:.2f} "
                f"[{s['v2_over_v1']['min']:.2f}-{s['v2_over_v1']['max']:.2f}]  V(6)/V(1) "
                f"{s['v6_over_v1']['median']:.2f} [{s['v6_over_v1']['min']:.2f}-{s['v6_over_v1']['max']:.2f}]  "
                f"{s['seconds_taken']['median']:.2f} s  kept {s['kept']}/{s['runs']}"
            )


if __name__ == "__main__":
    main()
