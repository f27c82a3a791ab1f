"""The rule table under truncated sampling: fuzzy share, cost per token and acceptance of each rule
under no truncation, top-k 40, top-p 0.9 and min-p 0.1 (temperature 0.8, the offline pair).

Usage: python scripts/truncation_table.py [--replies-per-prompt N] [--tokens N] [--json PATH]

Every configuration decodes the same prompts and seeds, interleaved (one reply of each in turn), so
machine load affects none more than another. Figures are pooled over the replies (ratios of sums);
the intervals are 95% percentile bootstrap intervals over replies (2,000 resamples, seed 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird"]
SAMPLINGS = {
    "no truncation": SamplingConfig(temperature=0.8),
    "top-k 40": SamplingConfig(temperature=0.8, top_k=40),
    "top-p 0.9": SamplingConfig(temperature=0.8, top_p=0.9),
    "min-p 0.1": SamplingConfig(temperature=0.8, min_p=0.1),
}
RULES = {
    "exact": DecodingSettings(rule="exact", threshold=0.0),
    "mixture T 0.1": DecodingSettings(rule="mixture", threshold=0.1),
    "mixture T 0.02": DecodingSettings(rule="mixture", threshold=0.02),
    "fuzzy kl T 0.5": DecodingSettings(rule="fuzzy", divergence="kl", threshold=0.5),
    "fuzzy js T 0.05": DecodingSettings(rule="fuzzy", divergence="js", threshold=0.05),
}


def interval(rows: torch.Tensor, numerator: int, denominator: int) -> tuple[float, float, float]:
    """Ratio of column sums, and its 95% bootstrap interval over rows ([replies, columns])."""
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(rows), (2000, len(rows)), generator=generator)
    sums = rows[picks].sum(1)
    ratios = sums[:, numerator] / sums[:, denominator]
    total = rows.sum(0)
    low, high = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=rows.dtype)).tolist()
    return float(total[numerator] / total[denominator]), low, high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies-per-prompt", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(
        ModelSpec(str(MODELS / "stories260K")),
        ModelSpec(str(MODELS / "stories260K-draft")),
        LoadOptions(device="cpu", dtype="float32"),
    )
    decoders = {name: pair.speculative(Controls(settings)) for name, settings in RULES.items()}
    # Per (sampling, rule): one row per reply: tokens, fuzzy tokens, cost, drafted, accepted.
    rows: dict[tuple[str, str], list[list[float]]] = {(s, r): [] for s in SAMPLINGS for r in RULES}
    for seed in range(args.replies_per_prompt):
        for prompt in PROMPTS:
            ids = pair.tokenizer(prompt).input_ids
            for (sampling_name, rule_name), out in rows.items():
                sampling = SamplingConfig(**{**_fields(SAMPLINGS[sampling_name]), "seed": seed})
                totals = [0.0] * 5
                for step in decoders[rule_name].generate(ids, max_new_tokens=args.tokens, sampling=sampling):
                    s = step.stats
                    totals = [
                        totals[0] + s.emitted,
                        totals[1] + s.accepted_fuzzy,
                        totals[2] + s.cost,
                        totals[3] + s.drafted,
                        totals[4] + s.accepted_exact + s.accepted_fuzzy,
                    ]
                out.append(totals)
    results = []
    print("| sampling | rule | fuzzy share | cost/token | acceptance |")
    print("|---|---|---|---|---|")
    for (sampling_name, rule_name), table in rows.items():
        data = torch.tensor(table, dtype=torch.float64)
        fuzzy, cost, acceptance = interval(data, 1, 0), interval(data, 2, 0), interval(data, 4, 3)
        results.append(
            {
                "sampling": sampling_name,
                "rule": rule_name,
                "fuzzy_share": fuzzy,
                "cost_per_token": cost,
                "acceptance": acceptance,
                "tokens": int(data[:, 0].sum()),
                "replies": len(table),
            }
        )
        print(
            f"| {sampling_name} | {rule_name} | {fuzzy[0]:.1%} [{fuzzy[1]:.1%}, {fuzzy[2]:.1%}] | "
            f"{cost[0]:.4f} [{cost[1]:.4f}, {cost[2]:.4f}] | {acceptance[0]:.3f} [{acceptance[1]:.3f}, {acceptance[2]:.3f}] |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def _fields(config: SamplingConfig) -> dict[str, object]:
    return {
        "temperature": config.temperature,
        "top_k": config.top_k,
        "top_p": config.top_p,
        "min_p": config.min_p,
    }


if __name__ == "__main__":
    main()
