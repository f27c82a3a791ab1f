"""The whole step (`fsd_chat.engines.torch_engine.step_graph`, `whole_step=True`) against today's steps, in
tokens/s, paired step by step: each prompt's two replies (today's, the whole step's) run side by
side, one step of one and then one of the other, the order alternating at each step, so that a
drifting machine (other tenants of a shared CPU swing one reply's rate by ±25% from round to round)
falls on both alike within milliseconds rather than seconds.

    python scripts/bench_whole_step.py [--device cpu] [--rounds 5] [--tokens 64] [--clock process]
        [--target default --draft lookup] [--decoders target-only "exact k4"]

Prints, per decoder pair (today's / whole step), the ratio of tokens/s per prompt and round (each
reply's tokens over the sum of its own steps' times, the first step's prefill included), its median
and the median's distribution-free 95% interval (`bench.stats.median_ci95`); `--output` writes them
as JSON. Greedy decoding of the offline story pair (../shared/models) unless
`--target` and `--draft` name another (`default`: the default chat model, on the transformers
engine; `lookup`: prompt lookup), one torch thread on the CPU; on CUDA the whole step is captured
as graphs at construction and today's steps are compiled (the default there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from fsd_chat.bench.stats import median_with_ci95
from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
DECODERS: dict[str, DecodingSettings | None] = {
    "target-only": None,
    "exact k4": DecodingSettings(rule="exact", threshold=0.0, draft_tokens=4, draft_policy="fixed"),
    "fuzzy js 0.1 k4": DecodingSettings(rule="fuzzy", threshold=0.1, draft_tokens=4, draft_policy="fixed"),
}
"""The decoders timed, by name: target-only (None) or speculative under these settings."""
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "Lily had a red ball"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default=str(MODELS / "stories260K"), help="a model, or 'default'")
    parser.add_argument("--draft", default=str(MODELS / "stories260K-draft"), help="a model, or 'lookup'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="process: the process's CPU time (one torch thread), steadier on a shared machine",
    )
    parser.add_argument(
        "--decoders",
        nargs="+",
        choices=tuple(DECODERS),
        default=tuple(DECODERS),
        help="the decoder pairs to time (default: all)",
    )
    parser.add_argument("--output", type=Path, help="write the ratios and their intervals as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = str(default_model_path()) if args.target == "default" else args.target
    pair = load_pair(
        ModelSpec(target),
        ModelSpec(args.draft),
        LoadOptions(device=args.device, dtype="float32", engine="transformers"),
    )
    sampling = SamplingConfig(temperature=args.temperature, seed=0 if args.temperature else None)

    def make(settings: DecodingSettings | None, whole: bool) -> Decoder:
        if settings is None:
            return pair.autoregressive(Controls(), whole_step=whole)
        return pair.speculative(Controls(settings), whole_step=whole)

    decoders = {
        (name, whole): make(DECODERS[name], whole) for name in args.decoders for whole in (False, True)
    }
    ids = [pair.tokenizer(p).input_ids for p in PROMPTS]

    clock = time.perf_counter if args.clock == "wall" else time.process_time

    def paired(today: Decoder, whole: Decoder, prompt: list[int]) -> tuple[float, float]:
        """Tokens/s of the two decoders' replies to `prompt`, their steps alternated."""
        replies = [
            today.generate(prompt, max_new_tokens=args.tokens, sampling=sampling),
            whole.generate(prompt, max_new_tokens=args.tokens, sampling=sampling),
        ]
        tokens, seconds, done = [0, 0], [0.0, 0.0], [False, False]
        turn = 0
        while not all(done):
            turn += 1
            for side in (0, 1) if turn % 2 else (1, 0):
                if done[side]:
                    continue
                start = clock()
                step = next(replies[side])
                seconds[side] += clock() - start
                tokens[side] += len(step.tokens)
                done[side] = step.stop_reason is not None
        return tokens[0] / seconds[0], tokens[1] / seconds[1]

    for name in args.decoders:  # warm-up (first replies, the policies' measurements)
        for prompt in ids:
            paired(decoders[(name, False)], decoders[(name, True)], prompt)
    measured: dict[tuple[str, bool], list[float]] = {key: [] for key in decoders}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name in args.decoders:
            for prompt in ids:
                today, whole = paired(decoders[(name, False)], decoders[(name, True)], prompt)
                measured[(name, False)].append(today)
                measured[(name, True)].append(whole)
        loads.append(os.getloadavg()[0])
    print(
        f"{args.clock} clock, device {args.device}, {args.rounds} rounds, {len(PROMPTS)} prompts × {args.tokens} tokens,"
        f" {sampling.describe()}, load {min(loads):.1f}–{max(loads):.1f}"
    )
    ratio_report: dict[str, object] = {}
    report: dict[str, object] = {
        "target": target,
        "draft": args.draft,
        "clock": args.clock,
        "rounds": args.rounds,
        "prompts": len(PROMPTS),
        "tokens": args.tokens,
        "load": [min(loads), max(loads)],
        "ratios": ratio_report,
    }
    for name in args.decoders:
        today, whole = measured[(name, False)], measured[(name, True)]
        ratios = [w / t for w, t in zip(whole, today, strict=True)]
        median, interval = median_with_ci95(ratios)
        low, high = interval or (min(ratios), max(ratios))
        print(
            f"{name:18} today {statistics.median(today):7.0f} tok/s  whole step {statistics.median(whole):7.0f} tok/s"
            f"  ratio {median:.3f} [{low:.3f}–{high:.3f}]"
        )
        ratio_report[name] = {"median": median, "ci95": interval, "today_tok_s": today, "whole_tok_s": whole}
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
