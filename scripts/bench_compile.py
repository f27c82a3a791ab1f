"""`--compile`'s effect on decoding speed: the same pair decoded with and without the compiled draft,
interleaved in one run (one torch thread, float32, greedy), printed and written as JSON.

    .venv/bin/python scripts/bench_compile.py --target ../shared/models/stories260K \\
        --draft ../shared/models/stories260K-draft --output docs/bench-compile.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird"]


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("bench-compile.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(
        ModelSpec(args.target), ModelSpec(args.draft), LoadOptions(device="cpu", dtype="float32")
    )
    decoders = {
        name: pair.speculative(Controls(DecodingSettings()), compile_draft=name == "compiled")
        for name in ("eager", "compiled")
    }
    started = time.perf_counter()
    list(decoders["compiled"].generate(pair.tokenizer(PROMPTS[0]).input_ids, max_new_tokens=8))
    compile_seconds = time.perf_counter() - started
    totals = {name: GenerationStats() for name in decoders}
    for repeat in range(args.repeats):
        for prompt in PROMPTS:
            # Alternate the order so that neither side always runs second.
            for name in ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager"):
                ids = pair.tokenizer(prompt).input_ids
                for step in decoders[name].generate(ids, max_new_tokens=args.max_new_tokens):
                    totals[name].add(step)
    report: dict[str, object] = {
        "compile_seconds": compile_seconds,
        "compile_error": decoders["compiled"].compile_error,
    }
    for name, stats in totals.items():
        report[name] = {
            "tokens_per_second": stats.tokens_per_second,
            "draft_ms_per_forward": 1e3 * stats.draft_seconds / stats.draft_forwards,
            "target_ms_per_forward": 1e3 * stats.target_seconds / stats.target_forwards,
            "tokens": stats.tokens,
        }
        print(
            f"{name:>8}: {stats.tokens_per_second:7.1f} tok/s, draft "
            f"{report[name]['draft_ms_per_forward']:.2f} ms/forward"
        )  # type: ignore[index]
    ratio = totals["compiled"].tokens_per_second / totals["eager"].tokens_per_second
    report["tokens_per_second_ratio"] = ratio
    print(f"compiled / eager tokens/s: ×{ratio:.3f} (first compilation {compile_seconds:.1f} s)")
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
