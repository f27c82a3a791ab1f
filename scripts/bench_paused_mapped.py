"""A paused mapped draft against the target alone: tokens/s on the wall clock, the first token, and
the modelled seconds (`modelled_timings`), which no machine load moves.

The pair: the default chat model as the target and the story draft mapped onto its vocabulary (the
coverage check lifted: its tokens hold 60% of the target's mass, so it is accepted too rarely to
pay and the `goodput` policy pauses it). One decoder for all prompts, as in a conversation, so the
pause carries from reply to reply. Each prompt is decoded by both in turn, the order alternating.

    PYTHONPATH=. .venv/bin/python scripts/bench_paused_mapped.py --output docs/bench-paused-mapped.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import fsd_chat.models.vocabulary
from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.stats import median_ci95
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig
from fsd_chat.decoding.events import Step
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec


def modelled_seconds(steps: list[Step], timings: ForwardTimings) -> float:
    """The reply's seconds by the cost model: each step's forwards, and a draft's catch-up on the
    tokens it missed while paused."""
    total, missed = 0.0, 0
    for step in steps:
        k = step.stats.drafted
        if k:
            total += (
                k * timings.draft + timings.verify_seconds(k + 1) + timings.step + missed * timings.catch_up
            )
            missed = 0
        else:
            total += timings.verify_seconds(1)
            missed += step.stats.emitted
    return total


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="../shared/models/stories260K-draft")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fsd_chat.models.vocabulary.MIN_COVERAGE = 0.0  # measured here, not refused
    options = LoadOptions(device="cpu", dtype="float32")
    pair = load_pair(ModelSpec(str(default_model_path())), ModelSpec(args.draft), options)
    timings = pair.forward_timings()
    spec = pair.speculative(Controls(DecodingSettings(draft_policy="goodput", threshold=0.5)))
    alone = pair.autoregressive(Controls(DecodingSettings()))
    items = load_prompt_set("mt-bench", data_dir=args.data_dir, limit=args.prompts).items
    wall, modelled, rows = [], [], []
    for index, item in enumerate(items):
        ids = prompt_ids(pair.tokenizer, [Message("user", item.text)])
        runs: dict[str, tuple[GenerationStats, list[Step]]] = {}
        order: list[tuple[str, Decoder]] = [("spec", spec), ("alone", alone)]
        for name, decoder in order if index % 2 == 0 else order[::-1]:
            stats, steps = GenerationStats(), []
            for step in decoder.generate(ids, max_new_tokens=args.max_new_tokens, sampling=SamplingConfig()):
                stats.add(step)
                steps.append(step)
            runs[name] = (stats, steps)
        (s, s_steps), (a, a_steps) = runs["spec"], runs["alone"]
        wall.append(s.tokens_per_second / a.tokens_per_second)
        # Tokens per modelled second, paused reply over the target alone.
        modelled.append(
            (s.tokens / modelled_seconds(s_steps, timings)) / (a.tokens / modelled_seconds(a_steps, timings))
        )
        rows.append(
            {
                "wall_ratio": wall[-1],
                "modelled_ratio": modelled[-1],
                "first_token_seconds": [s.first_token_seconds, a.first_token_seconds],
                "paused_steps": s.paused_steps,
                "steps": s.steps,
                "drafted": s.drafted,
                "paused": s.paused,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "target": "default",
        "draft": args.draft,
        "coverage": pair.coverage,
        "prompts": len(items),
        "max_new_tokens": args.max_new_tokens,
        "wall_ratio_median": statistics.median(wall),
        "wall_ratio_ci95": median_ci95(wall),
        "modelled_ratio_median": statistics.median(modelled),
        "modelled_ratio_min": min(modelled),
        "rows": rows,
    }
    print({k: v for k, v in report.items() if k != "rows"})
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
