"""Kernels a decoder layer, counted on the CPU (`fsd_chat.bench.kernel_counts`), and compile seconds
against depth: the CPU's prediction of the GPU profile's 52 kernels a layer (DESIGN.md, "On a GPU").

For the story target's shape (stories260K: hidden 64, 8 heads) at 1×, 2× and 4× its 5 layers, a
greedy target-only whole step (`step_graph.target_step`, settings as device values):

- eager aten operators a step, before (separate projections, the greedy laws truncated as the
  captured graphs did at 9d33ad6) and after (fused projections, untruncated greedy laws), in
  bfloat16 (the GPU's dtype: its RMSNorm casts are kernels too) and float32;
- inductor's kernel launches a step and its compile seconds, each depth in a fresh process (the
  compiler's caches would otherwise serve the second depth from the first), with each decoder
  layer one nested compile region (`torch_engine.regions`) and, for comparison, unrolled.

The machine is shared (2 cores, other work running): compile seconds are wall-clock seconds of one
run each, and their ratios across depths are what the check needs.

    PYTHONPATH=. .venv/bin/python scripts/count_kernels.py --output docs/kernel-counts.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from fsd_chat.bench.kernel_counts import compiled_launches, deeper, eager_ops, per_layer, target_only_step
from fsd_chat.engines.torch_engine.regions import mark_layer_regions

SOURCE = "../shared/models/stories260K"
BASE_LAYERS = 5
MULTIPLES = (1, 2, 4)


def eager_counts(fused: bool, sorts: bool, dtype: torch.dtype) -> dict[int, int]:
    """Eager operators a step at each depth."""
    counts = {}
    for multiple in MULTIPLES:
        layers = BASE_LAYERS * multiple
        step, args = target_only_step(deeper(SOURCE, layers, fused=fused, dtype=dtype), sorts=sorts)
        with torch.inference_mode():
            counts[layers] = sum(eager_ops(step, *args).values())
    return counts


def compiled_one(layers: int, regions: bool) -> dict[str, float]:
    """One compiled count, in this process: launches and compile seconds."""
    model = deeper(SOURCE, layers, dtype=torch.float32)
    if regions:
        mark_layer_regions(model)
    step, args = target_only_step(model)
    with torch.inference_mode():
        launches, seconds = compiled_launches(step, *args)
    return {"launches": launches, "compile_seconds": seconds}


def main() -> None:
    """Count, print and write the report (or, with --one, one compiled count as JSON on stdout)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("LAYERS", "REGIONS"), help=argparse.SUPPRESS)
    parser.add_argument("--unrolled-up-to", type=int, default=2, help="deepest multiple compiled unrolled")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        # Compile from nothing: inductor's on-disk caches would serve a region or a graph compiled
        # by an earlier run.
        torch._inductor.config.force_disable_caches = True
        print(json.dumps(compiled_one(int(args.one[0]), args.one[1] == "regions")))
        return
    report: dict[str, object] = {"model": "stories260K's shape, random weights", "base_layers": BASE_LAYERS}
    eager = {}
    for name, fused, sorts in (("before", False, True), ("after", True, False)):
        for dtype in (torch.bfloat16, torch.float32):
            counts = eager_counts(fused, sorts, dtype)
            eager[f"{name}-{str(dtype).removeprefix('torch.')}"] = {
                "per_step": counts,
                "per_layer": per_layer(counts),
            }
            print(name, dtype, counts, per_layer(counts), flush=True)
    report["eager_ops"] = eager
    if args.output:  # the eager counts, should the compilations not finish
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    compiled: dict[str, dict[int, dict[str, float]]] = {"regions": {}, "unrolled": {}}
    for kind in compiled:
        for multiple in MULTIPLES:
            if kind == "unrolled" and multiple > args.unrolled_up_to:
                continue
            layers = BASE_LAYERS * multiple
            run = subprocess.run(
                [sys.executable, __file__, "--one", str(layers), kind],
                capture_output=True,
                text=True,
                check=True,
            )
            compiled[kind][layers] = json.loads(run.stdout.strip().splitlines()[-1])
            print(kind, layers, compiled[kind][layers], flush=True)
    report["compiled"] = {
        kind: {
            "per_step": counts,
            "per_layer": per_layer({layers: c["launches"] for layers, c in counts.items()}),
        }
        for kind, counts in compiled.items()
    }
    print(json.dumps(report, indent=1))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
