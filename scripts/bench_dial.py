"""The dial's steps on one setup: acceptance, τ, cost, greedy agreement and loops at each T, against
T = 0 and the target alone, to place the dial's top where replies break (docs/decoding.md, "The
dial's scale"; docs/benchmarks.md).

Every prompt is decoded by every configuration in turn (the order rotated per prompt), so the
per-prompt ratios of tokens/s are paired; each median ratio has its distribution-free 95% interval
(`median_ci95`). Greedy agreement: the share of T = 0's reply that the reply at T repeats before it
first departs, averaged over prompts. A loop: a reply that ends at the token cap on a repeated
stretch (its last `LOOP_SPAN` tokens repeat with a period ≤ `LOOP_PERIOD`) where the reply at T = 0
does not. A new loop is *the target's own* when no relaxed (`draft-fuzzy`) token lies in its
looping stretch and the target alone, decoding greedily from the reply's last relaxed token on,
writes the rest of the reply token for token: the rule chose a prefix, and the target loops from
it by itself. Any other new loop is *made by the rule* (relaxed tokens inside it, as relaxed copies
of the reply's own text make). One torch thread, float32, the app's draft policy (goodput) unless
told otherwise.

    PYTHONPATH=. .venv/bin/python scripts/bench_dial.py --target default --draft lookup \\
        --preset tinystories-retell --preset mt-bench --output docs/bench-dial-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.stats import median_ci95
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig
from fsd_chat.decoding.events import Origin, StopReason
from fsd_chat.decoding.settings import DEFAULT_DRAFT_POLICY, DEFAULT_MAX_NEW_TOKENS
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair

LOOP_SPAN = 96
"""Tokens at a reply's end inspected for a loop: replies need the chat's cap (256 tokens) for a
paragraph that repeats to show as a loop."""
LOOP_PERIOD = 48
"""Longest period (tokens) of a repeated stretch counted as a loop: a paragraph said over and over
(30-40 tokens) as well as a phrase; 48 tokens at least are then repeated verbatim."""


def loops(ids: list[int], capped: bool) -> bool:
    """Whether the reply ended at the cap on a stretch that repeats with a short period."""
    tail = ids[-LOOP_SPAN:]
    if not capped or len(tail) < LOOP_SPAN:
        return False
    return any(all(tail[i] == tail[i - p] for i in range(p, len(tail))) for p in range(1, LOOP_PERIOD + 1))


@dataclass(frozen=True)
class Reply:
    """One reply of the bench: its prompt, tokens, whether it ran to the cap, and where its
    relaxed tokens are."""

    prompt: list[int]
    ids: list[int]
    capped: bool
    relaxed: list[int]

    @property
    def loops(self) -> bool:
        """Whether it ends at the cap on a short-period repeat (`loops`)."""
        return loops(self.ids, self.capped)


def targets_own_loop(pair: ModelPair, reply: Reply, stop_strings: tuple[str, ...]) -> bool:
    """Whether a looping reply's loop is the target's own (module docstring): no relaxed token in
    its looping stretch, and the target alone, greedy, continues its last relaxed token's prefix
    with the rest of the reply."""
    if not reply.relaxed:
        return True
    last = reply.relaxed[-1]
    if last >= len(reply.ids) - LOOP_SPAN:
        return False
    decoder = pair.decoder(Controls(DecodingSettings()), autoregressive=True)
    rest: list[int] = []
    for step in decoder.generate(
        reply.prompt + reply.ids[: last + 1],
        max_new_tokens=len(reply.ids) - last - 1,
        sampling=SamplingConfig(),
        stop_strings=stop_strings,
    ):
        rest += [t.id for t in step.tokens]
    return rest == reply.ids[last + 1 :]


def agreement(reply: list[int], reference: list[int]) -> float:
    """The share of `reference` that `reply` repeats before it first departs."""
    same = 0
    for a, b in zip(reply, reference, strict=False):
        if a != b:
            break
        same += 1
    return same / max(len(reference), 1)


def _interval(values: list[float]) -> list[float] | None:
    interval = median_ci95(values)
    return None if interval is None else [interval[0], interval[1]]


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default", help="a model, or 'default' (the default chat model)")
    parser.add_argument("--draft", default="lookup")
    parser.add_argument("--preset", action="append", required=True)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--thresholds", default="0,0.25,0.5,0.75,1,1.25,1.5,2")
    parser.add_argument("--rule", default="fuzzy")
    parser.add_argument("--divergence", default="js")
    parser.add_argument("--policy", default=DEFAULT_DRAFT_POLICY)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = str(default_model_path()) if args.target == "default" else args.target
    pair = load_pair(ModelSpec(target), ModelSpec(args.draft), LoadOptions(device="cpu", dtype="float32"))
    thresholds = [float(t) for t in args.thresholds.split(",")]
    names = ["target alone", *(f"T {t:g}" for t in thresholds)]
    greedy = SamplingConfig()
    report: dict[str, object] = {
        "target": args.target,
        "draft": args.draft,
        "rule": args.rule,
        "divergence": args.divergence,
        "policy": args.policy,
        "sampling": "greedy",
        "max_new_tokens": args.max_new_tokens,
        "sets": {},
    }
    for preset in args.preset:
        prompt_set = load_prompt_set(preset, data_dir=args.data_dir, limit=args.prompts)
        rates: dict[str, list[float]] = {name: [] for name in names}
        totals = {name: GenerationStats() for name in names}
        replies: dict[str, list[Reply]] = {name: [] for name in names}
        for index, item in enumerate(prompt_set.items):
            messages = [Message("user", item.text)]
            ids = prompt_ids(pair.tokenizer, messages) if args.chat else pair.tokenizer(item.text).input_ids
            order = names[index % len(names) :] + names[: index % len(names)]
            for name in order:
                threshold = 0.0 if name == "target alone" else float(name.removeprefix("T "))
                controls = Controls(
                    DecodingSettings(
                        rule=args.rule,
                        divergence=args.divergence,
                        threshold=threshold,
                        draft_policy=args.policy,
                    )
                )
                decoder = pair.decoder(controls, autoregressive=name == "target alone")
                stats, capped = GenerationStats(), False
                out: list[int] = []
                relaxed: list[int] = []  # positions of the reply's draft-fuzzy tokens
                for step in decoder.generate(
                    ids,
                    max_new_tokens=args.max_new_tokens,
                    sampling=greedy,
                    stop_strings=prompt_set.stop_strings,
                ):
                    stats.add(step)
                    totals[name].add(step)
                    relaxed += [
                        len(out) + i for i, t in enumerate(step.tokens) if t.origin == Origin.DRAFT_FUZZY
                    ]
                    out += [t.id for t in step.tokens]
                    capped = step.stop_reason == StopReason.MAX_NEW_TOKENS
                rates[name].append(stats.tokens_per_second)
                replies[name].append(Reply(ids, out, capped, relaxed))
            print(f"{preset} prompt {index + 1}/{len(prompt_set.items)}", flush=True)
        rows: dict[str, object] = {}
        reference = replies["T 0"]
        for name in names:
            t = totals[name]
            new = [
                reply
                for reply, ref in zip(replies[name], reference, strict=True)
                if reply.loops and not ref.loops
            ]
            own = sum(targets_own_loop(pair, reply, prompt_set.stop_strings) for reply in new)
            to_exact = [r / a for r, a in zip(rates[name], rates["T 0"], strict=True)]
            to_target = [r / a for r, a in zip(rates[name], rates["target alone"], strict=True)]
            rows[name] = {
                "tokens_per_second": statistics.median(rates[name]),
                "ratio_to_T0": statistics.median(to_exact),
                "ratio_to_T0_ci95": _interval(to_exact),
                "ratio_to_target": statistics.median(to_target),
                "ratio_to_target_ci95": _interval(to_target),
                "acceptance": t.acceptance_rate,
                "tau": t.mean_accepted_length,
                "fuzzy_share": t.fuzzy_share,
                "cost_per_token": t.cost_per_token,
                "greedy_agreement": statistics.mean(
                    agreement(reply.ids, ref.ids) for reply, ref in zip(replies[name], reference, strict=True)
                ),
                # The share of tokens that are the target's greedy choice after the reply's own
                # prefix (every token but the relaxed ones).
                "token_agreement": 1 - t.fuzzy_share,
                "identical_replies": sum(
                    reply.ids == ref.ids for reply, ref in zip(replies[name], reference, strict=True)
                ),
                # Greedy decoding of a small model loops from many prefixes: what a setting adds is
                # the loops beyond T = 0's (the target alone's), each attributed below.
                "loops": sum(reply.loops for reply in replies[name]),
                "new_loops": len(new),
                "new_loops_targets_own": own,
                "tokens": t.tokens,
                "paused_steps": t.paused_steps,
                "steps": t.steps,
                # Per prompt, in the set's order: where the median's gains are (or are not).
                "per_prompt_ratio_to_T0": to_exact,
                "per_prompt_identical": [
                    reply.ids == ref.ids for reply, ref in zip(replies[name], reference, strict=True)
                ],
            }
            row = rows[name]
            assert isinstance(row, dict)
            print(
                f"{preset:>18} {name:>12}: {row['tokens_per_second']:6.1f} tok/s ×{row['ratio_to_T0']:.2f} T0 "
                f"{row['ratio_to_T0_ci95']} ×{row['ratio_to_target']:.2f} target  acc {row['acceptance']:.3f} "
                f"τ {row['tau']:.3f} fuzzy {row['fuzzy_share']:.3f} cost {row['cost_per_token']:.4f} "
                f"agree {row['greedy_agreement']:.2f} same {row['identical_replies']} "
                f"loops {row['loops']}, new {len(new)} (the target's own: {own})",
                flush=True,
            )
        sets = report["sets"]
        assert isinstance(sets, dict)
        sets[preset] = {"prompts": len(prompt_set.items), "rows": rows}
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
