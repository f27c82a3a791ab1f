"""Drafts with another tokenizer against the same-tokenizer draft and the target alone: tokens/s,
acceptance and the share of the target's mass the draft's tokens cover, on one pair.

The mapped drafts are the offline draft with its token ids shuffled (every token kept: 100%
coverage) and with a growing share of its multi-character tokens removed (`tests/mapped_pairs.py`).
Each prompt is decoded by every configuration in turn (the order rotated per prompt), so the
per-prompt ratios to the target alone are paired; the median ratio has its distribution-free 95%
interval (`median_ci95`). One torch thread, float32, sampling at temperature 1 with a fixed seed.

    PYTHONPATH=. .venv/bin/python scripts/bench_mapped.py --target /tmp/scaled-target \\
        --draft ../shared/models/stories260K-draft --output docs/bench-mapped.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import fsd_chat.models.vocabulary
from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.stats import median_ci95
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from tests.mapped_pairs import multi_character_tokens, permuted_draft, pruned_draft

REMOVED_SHARES = (0.1, 0.25, 0.5, 0.75)
"""Shares of the draft's multi-character tokens removed, one mapped draft each."""


def _pairs(target: str, draft: Path, folder: Path) -> dict[str, ModelPair]:
    options = LoadOptions(device="cpu", dtype="float32")
    drafts = {
        "same tokenizer": draft,
        "mapped, ids shuffled": permuted_draft(draft, folder / "shuffled", 0)[0],
    }
    multi = multi_character_tokens(draft)
    order = torch.randperm(len(multi), generator=torch.Generator().manual_seed(0)).tolist()
    for share in REMOVED_SHARES:
        removed = {multi[i] for i in order[: round(share * len(multi))]}
        drafts[f"mapped, {share:.0%} removed"] = pruned_draft(draft, folder / f"pruned-{share}", removed)[0]
    # Measured here, not refused: the threshold is what this script is for.
    fsd_chat.models.vocabulary.MIN_COVERAGE = 0.0
    return {
        name: load_pair(ModelSpec(target), ModelSpec(str(path)), options) for name, path in drafts.items()
    }


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rule", default="exact")
    parser.add_argument("--output", type=Path, default=Path("bench-mapped.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = [
        i.text for i in load_prompt_set("tinystories", data_dir=args.data_dir, limit=args.prompts).items
    ]
    with tempfile.TemporaryDirectory() as folder:
        pairs = _pairs(args.target, args.draft, Path(folder))
    first = next(iter(pairs.values()))
    settings = DecodingSettings(rule=args.rule)
    decoders: dict[str, Decoder] = {"target alone": first.autoregressive(Controls(settings))}
    decoders |= {name: pair.speculative(Controls(settings)) for name, pair in pairs.items()}
    totals = {name: GenerationStats() for name in decoders}
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    for index, prompt in enumerate(prompts):
        ids = first.tokenizer(prompt).input_ids
        names = list(decoders)
        for name in names[index % len(names) :] + names[: index % len(names)]:
            stats = GenerationStats()
            for step in decoders[name].generate(
                ids, max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(temperature=1.0, seed=index)
            ):
                stats.add(step)
                totals[name].add(step)
            rates[name].append(stats.tokens_per_second)
    rows: dict[str, object] = {}
    for name in decoders:
        ratios = [r / a for r, a in zip(rates[name], rates["target alone"], strict=True)]
        pair = pairs.get(name)
        row = {
            "coverage": None if pair is None else (1.0 if pair.coverage is None else pair.coverage),
            "tokens_per_second": statistics.median(rates[name]),
            "acceptance": totals[name].acceptance_rate,
            "ratio_to_target": statistics.median(ratios),
            "ratio_ci95": median_ci95(ratios),
        }
        rows[name] = row
        rates_median = statistics.median(rates[name])
        interval = median_ci95(ratios)
        shown = f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "(too few prompts)"
        coverage = "" if pair is None else f"{row['coverage']:.0%}"
        print(
            f"{name:>24}: coverage {coverage:>4}  {rates_median:7.1f} tok/s  acceptance "
            f"{totals[name].acceptance_rate:.2f}  ×{statistics.median(ratios):.2f} {shown}"
        )
    report = {"target": args.target, "rule": args.rule, "prompts": len(prompts), "rows": rows}
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
