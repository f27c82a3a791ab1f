"""`--compile`'s effect on decoding speed: the same pair decoded with and without compilation
(target, draft and acceptance rule), speculative (fuzzy js 0.05, k 5) and target-only, interleaved
in one run (one torch thread, float32, greedy), printed and written as JSON.

Each (repeat, prompt) gives one compiled/eager tokens-per-second ratio per decoder; the report
gives their geometric mean with a 95% bootstrap interval (the interleaving pairs each compiled
reply with an eager one of the same prompt). The first replies, which compile, are timed apart (`compile_seconds`).

    .venv/bin/python scripts/bench_compile.py --target ../shared/models/stories260K \\
        --draft ../shared/models/stories260K-draft --output docs/bench-compile.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird"]


def interval(ratios: list[float]) -> dict[str, float]:
    """Geometric mean of `ratios` and its 95% percentile-bootstrap interval (10,000 resamples of
    the log ratios, seed 0)."""
    logs = np.log(np.asarray(ratios))
    resampled = np.random.default_rng(0).choice(logs, size=(10_000, len(logs))).mean(axis=1)
    low, high = np.quantile(resampled, [0.025, 0.975])
    return {"ratio": math.exp(logs.mean()), "low": math.exp(low), "high": math.exp(high)}


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("bench-compile.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(
        ModelSpec(args.target), ModelSpec(args.draft), LoadOptions(device="cpu", dtype="float32")
    )
    settings = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.05, draft_tokens=5)
    decoders: dict[str, dict[str, Decoder]] = {
        "speculative": {
            name: pair.speculative(Controls(settings), compiled=name == "compiled")
            for name in ("eager", "compiled")
        },
        "target-only": {
            name: pair.autoregressive(Controls(), compiled=name == "compiled")
            for name in ("eager", "compiled")
        },
    }
    report: dict[str, object] = {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    for kind, pairs in decoders.items():
        compiled = pairs["compiled"]
        started = time.perf_counter()
        # Every prompt once: the graphs of the widths these replies use are compiled here.
        for prompt in PROMPTS:
            list(compiled.generate(pair.tokenizer(prompt).input_ids, max_new_tokens=args.max_new_tokens))
        compile_seconds = time.perf_counter() - started
        totals = {name: GenerationStats() for name in pairs}
        ratios = []
        for repeat in range(args.repeats):
            for prompt in PROMPTS:
                rates = {}
                # Alternate the order so that neither side always runs second.
                for name in ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager"):
                    run = GenerationStats()
                    ids = pair.tokenizer(prompt).input_ids
                    for step in pairs[name].generate(ids, max_new_tokens=args.max_new_tokens):
                        run.add(step)
                        totals[name].add(step)
                    rates[name] = run.tokens_per_second
                ratios.append(rates["compiled"] / rates["eager"])
        entry: dict[str, object] = {
            "compile_seconds": compile_seconds,
            "compile_error": compiled.compile_error,
            **{
                name: {
                    "tokens_per_second": stats.tokens_per_second,
                    "target_ms_per_forward": 1e3 * stats.target_seconds / stats.target_forwards,
                    "tokens": stats.tokens,
                }
                for name, stats in totals.items()
            },
            "compiled_over_eager": interval(ratios),
        }
        report[kind] = entry
        ratio = entry["compiled_over_eager"]
        assert isinstance(ratio, dict)
        print(
            f"{kind:>12}: eager {totals['eager'].tokens_per_second:6.1f} tok/s, compiled "
            f"{totals['compiled'].tokens_per_second:6.1f} tok/s: ×{ratio['ratio']:.3f} "
            f"[{ratio['low']:.3f}, {ratio['high']:.3f}] (95%, {len(ratios)} paired replies); "
            f"first replies (compiling) {compile_seconds:.1f} s; {compiled.compile_error or 'compiled'}"
        )
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
