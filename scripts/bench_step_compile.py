"""Compile seconds of the whole step's graphs against the draft length k: what a CUDA start compiles
before it captures (`step_graph.CapturedSteps`), measured on the CPU.

For the story target's shape (5 layers) and a draft of the story draft's shape at a given depth
(random weights: the seconds depend on the shapes), each kind of step (greedy untruncated,
sampled with top-p) is compiled at k = 0 (target-only) and at every k of
`step_graph.GRAPH_DRAFT_LENGTHS`, in one process, by `step_graph.compiled_step_functions`, first
from an empty inductor cache (a first start), then again in a fresh process over the cache the first
one filled (a second start, as `compile_cache` gives one). A graph's seconds are CPU seconds, the
process's and its C++ compiler's (one compile thread, so that the compiler is a child process
waited for): the work, which the load of a shared machine does not inflate as it does wall time.

`--trees A B ...` measures each source tree in turn (a fresh process each), so that two versions
of the step are compared side by side in one run:

    PYTHONPATH=. .venv/bin/python scripts/bench_step_compile.py --trees /tmp/before . \\
        --draft-layers 2 --output docs/bench-step-compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1] / "../shared/models"


def cpu_seconds() -> float:
    """CPU seconds of this process and its waited-for children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(draft_layers: int, kinds: list[str]) -> dict[str, float]:
    """Compile every graph of `kinds` in this process: CPU seconds a graph, their total and the
    wall seconds of all."""
    import torch

    from fsd_chat.bench.kernel_counts import CAPACITY, deeper
    from fsd_chat.decoding.settings import SamplingConfig
    from fsd_chat.engines.torch_engine.kv_cache import StaticModel
    from fsd_chat.engines.torch_engine.step_graph import (
        GRAPH_DRAFT_LENGTHS,
        Draws,
        StepInputs,
        compiled_step_functions,
    )

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    target = deeper(str(SHARED / "stories260K"), 5, dtype=torch.float32)
    draft = deeper(str(SHARED / "stories260K-draft"), draft_layers, dtype=torch.float32)
    vocab = target.config.vocab_size
    t, d = StaticModel(target, vocab, capacity=CAPACITY), StaticModel(draft, vocab, capacity=CAPACITY)
    inputs = StepInputs.allocate(CAPACITY, t.device, on_device=True)
    inputs.write_sampling(SamplingConfig(temperature=0.8, top_p=0.9))
    speculative, target_only = compiled_step_functions(t, d)
    generator = torch.Generator().manual_seed(0)
    seconds: dict[str, float] = {}
    began = time.perf_counter()
    with torch.inference_mode():
        for kind in kinds:
            greedy = kind == "greedy"
            step_inputs = inputs.for_step(greedy, not greedy)
            for k in (0, *GRAPH_DRAFT_LENGTHS):
                inputs.position.fill_(3)
                draws = None if greedy else Draws.make(k, vocab, generator, t.device)
                start = cpu_seconds()
                if k:
                    speculative(t, d, step_inputs, k, greedy, draws)
                else:
                    target_only(t, step_inputs, greedy, draws)
                seconds[f"{kind} k {k}"] = cpu_seconds() - start
    return seconds | {"total": sum(seconds.values()), "wall": time.perf_counter() - began}


def main() -> None:
    """Measure each tree's first and second start (or, with --one, one start in this process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--kinds", default="greedy,sampled", help="comma-separated: greedy, sampled")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if args.one:
        print(json.dumps(measure(args.draft_layers, kinds)))
        return
    report: dict[str, object] = {"draft_layers": args.draft_layers, "target_layers": 5, "kinds": kinds}
    for tree in args.trees:
        tree = tree.resolve()
        with tempfile.TemporaryDirectory() as cache:
            starts = {}
            for start in ("first", "second"):
                run = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        "--draft-layers",
                        str(args.draft_layers),
                        "--kinds",
                        args.kinds,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=tree,
                    env=os.environ | {"PYTHONPATH": str(tree), "TORCHINDUCTOR_CACHE_DIR": cache},
                )
                starts[start] = json.loads(run.stdout.strip().splitlines()[-1]) | {"load": os.getloadavg()}
                print(tree, start, json.dumps(starts[start]), flush=True)
        report[str(tree)] = starts
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
