"""The most prompt lookup could gain over target-only decoding on the llama.cpp engine, at the
modelled forward times of each thread count (`fsd_chat.engines.llama_cpp.priced_timings` with none
measured): one
thread, two, and one for a token with two for a batch (the chat's split on an idle 2-core CPU).

Each prompt's reply is decoded once per rule with a fixed draft length k (every matched copy
verified, greedy), which records how many of each step's copied tokens the rule accepted. An oracle
that knew that count a before the step would draft exactly a tokens where (a + 1) / V(a + 1) beats
1 / V(1), and take a + 1 target-only steps otherwise; its time against a + 1 target-only steps for
every step is the ceiling of any draft policy on that text (the fuzzy rule's text is its fixed-k
run's: an approximation, as a target-only step would write the target's own token there). With the
prompt's prefill (priced as one forward over the prompt), which every engine pays alike, it is the
ceiling of the bench's tokens/s ratio against llama.cpp alone.

Beside each ceiling, at the chat's split (`POLICY_SPLIT`), the goodput policy's own decisions (the
default chat's: its k per step, under the same rule) priced the same way, a drafting step with the
model's step overhead (`ForwardTimings.step`): how near the policy comes to the oracle under the
model, apart from how the machine runs the forwards. The policy is priced twice, with prompt
lookup's choice among a suffix's occurrences (`lookup.find_continuation`: the most frequent next
token) and with the latest occurrence's continuation in its place (`goodput_latest_*`), what
prompt lookup proposed before. With `--forward-table` every figure is priced at this CPU's
measured forward and prefill times (`scripts/llama_forward_table.py`) instead: the modelled ones
were fitted on another CPU. The policy decides at the prices the chat decides at, calibrated on
this machine (`fsd_chat.engines.llama_calibration`, cached), with `--decide-at modelled` at the
modelled ones (what the chat did before), or with `--decide-at measured` at the forward table's (the
prices it is priced at: the policy apart from a calibration's noise). With `--length-bound`, the
best fixed draft length for each matched suffix length found on the replies themselves
(`length_bound`): between the oracle, which knows each copy's fate, and the goodput policy, which
learns acceptance as it goes, what the matched length alone can tell.

    PYTHONPATH=. .venv/bin/python scripts/lookup_ceiling.py --prompts tinystories-retell --limit 10 [--thresholds 1 2] \
        --output /tmp/lookup-ceiling.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig, Step, lookup, speculative
from fsd_chat.decoding.draft_policy import DraftPolicy, FixedPolicy
from fsd_chat.decoding.forward_timings import MEASURE_CONTEXT
from fsd_chat.decoding.settings import DEFAULT_LOOKUP_NGRAM
from fsd_chat.engines import llama_cpp
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec

SPLITS = {"1": (1, 1), "2": (2, 2), "1, batches 2": (1, 2)}
"""llama.cpp's threads for one token and for several (`--threads`, `--threads-batch`) priced."""
POLICY_SPLIT = "1, batches 2"
"""The split the goodput policy decides and is priced at (the chat's on an idle 2-core CPU)."""


def rules(thresholds: list[float]) -> dict[str, DecodingSettings]:
    """The rules priced, by name: exact, and the fuzzy rule at each greedy threshold T (regret, nats)."""
    fuzzy = {f"fuzzy T {t:g} regret": DecodingSettings(threshold=t) for t in thresholds}
    return {"exact (T = 0)": DecodingSettings(rule="exact", threshold=0.0)} | fuzzy


def speedups(priced: list[tuple[float, float, float]]) -> tuple[list[float], list[float]]:
    """Per reply (the target alone's seconds, the decoder's, the prompt's prefill): its speed-up over
    the target alone in decoding, and with the prefill, which both pay."""
    return [alone / taken for alone, taken, _ in priced], [
        (alone + prefill) / (taken + prefill) for alone, taken, prefill in priced
    ]


def latest_continuation(tokens: np.ndarray, ngram: int, limit: int) -> lookup.Match:
    """`lookup.find_continuation` as it chose before: the latest occurrence's continuation."""
    starts, matched = lookup.continuations(tokens, ngram)
    if not matched:
        return lookup.NO_MATCH
    start = int(starts[-1])
    return lookup.Match(start, min(limit, tokens.shape[0] - start), matched)


Finder = Callable[[np.ndarray, int, int], lookup.Match]


@contextlib.contextmanager
def choosing(find: Finder) -> Iterator[None]:
    """Prompt lookup choosing its continuation with `find` inside the block."""
    chosen = lookup.find_continuation
    lookup.find_continuation = find  # type: ignore[assignment]  # mypy takes a module function for fixed
    try:
        yield
    finally:
        lookup.find_continuation = chosen


class ByMatchedLength(FixedPolicy):
    """A draft policy that drafts a fixed k for each matched suffix length (`ks[m - 1]` after an
    m-token match; nothing where nothing matched): what `length_bound` searches over."""

    def __init__(self, ks: tuple[int, ...]) -> None:
        self.ks = ks

    def limit(
        self,
        settings: DecodingSettings,
        room: int,
        evidence: int | None = None,
        context: int = MEASURE_CONTEXT,
    ) -> int:
        return min(self.ks[evidence - 1], room) if evidence else 0


@contextlib.contextmanager
def deciding(policy: Callable[[], DraftPolicy] | None) -> Iterator[None]:
    """Every decoder made inside the block drafting by `policy()` (None: its own policy)."""
    if policy is None:
        yield
        return
    made = speculative.make_policy
    speculative.make_policy = lambda *_args, **_kwargs: policy()
    try:
        yield
    finally:
        speculative.make_policy = made


def length_bound(
    price: Callable[[Callable[[], DraftPolicy]], dict[str, Any]], ngram: int, most: int
) -> dict[str, Any]:
    """The best fixed k for each matched length, 1..`ngram` tokens (each k in 0..`most`), by the
    geometric mean of the replies' decoding speed-ups that `price(policy)` (`priced`) reports for
    `ByMatchedLength` of those ks: coordinate ascent from never drafting, two rounds over the
    lengths, longest first. Chosen on the very replies it is scored on, it is what a policy that
    decides from the matched length alone could hope for there at most, short of a better optimum
    the ascent missed (it knows the set; a policy must learn it as it goes)."""
    ks = (0,) * ngram
    best = price(partial(ByMatchedLength, ks))
    tried = {ks: best["decode_geometric_mean"]}
    for _ in range(2):
        for length in reversed(range(ngram)):
            for k in range(most + 1):
                trial = (*ks[:length], k, *ks[length + 1 :])
                if trial in tried:
                    continue
                scored = price(partial(ByMatchedLength, trial))
                tried[trial] = scored["decode_geometric_mean"]
                if scored["decode_geometric_mean"] > best["decode_geometric_mean"]:
                    ks, best = trial, scored
    return {"ks_by_matched_length": ks, "tried": {str(k): v for k, v in tried.items()}} | best


def priced(
    decode: Callable[[list[int]], list[Step]],
    prompts: list[list[int]],
    verify: list[float],
    step: float,
    prefill: Callable[[int], float],
    find: Finder,
    policy: Callable[[], DraftPolicy] | None = None,
) -> dict[str, Any]:
    """`decode`'s replies to `prompts` (drafting by `policy()`, default the decoder's own, with
    prompt lookup choosing by `find`), priced at `verify` (V(w) by width) plus `step` seconds a
    drafting step: each reply's speed-up over the target alone, decoding and with its `prefill`,
    their medians and geometric means, and the replies' nats/token."""
    taken_alone: list[tuple[float, float, float]] = []
    cost = tokens = 0.0
    with choosing(find), deciding(policy):
        for prompt in prompts:
            steps = decode(prompt)
            cost += sum(s.stats.cost for s in steps)
            tokens += sum(s.stats.emitted for s in steps)
            taken = sum(
                verify[s.stats.drafted + 1] + (step if s.stats.drafted else 0.0)
                for s in steps
                if s.stats.target_forwards
            )
            alone = sum(s.stats.emitted for s in steps) * verify[1]
            taken_alone.append((alone, taken, prefill(len(prompt))))
    decode_ratios, overall_ratios = speedups(taken_alone)
    return {
        "decode_median": statistics.median(decode_ratios),
        "decode_geometric_mean": geometric_mean(decode_ratios),
        "with_prefill_median": statistics.median(overall_ratios),
        "with_prefill_geometric_mean": geometric_mean(overall_ratios),
        "with_prefill": overall_ratios,
        "nats_per_token": cost / tokens,
    }


def geometric_mean(ratios: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def prices(
    target: llama_cpp.LlamaCppModel, label: str, table: dict[str, Any] | None
) -> tuple[list[float], Callable[[int], float]]:
    """V(w) indexed by width w (index 0: V(1)) and a prompt's prefill seconds by its length, at the
    split `label` the target's threads are set to: modelled, or measured (`table`, from
    `scripts/llama_forward_table.py`)."""
    if table is None:
        return llama_cpp.priced_timings(target, None, {}).verify_table(), partial(
            llama_cpp.forward_seconds, target
        )
    measured = [float(v) for v in table[label]["measured_seconds"]]
    per_token = float(table[label]["prefill_seconds_per_token"])
    return [measured[0], *measured], lambda length: per_token * length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="tinystories-retell")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        default=[1.0],
        help="the fuzzy rule's greedy thresholds T (regret, nats) priced beside exact (default: 1, the chat's)",
    )
    parser.add_argument(
        "--forward-table",
        type=Path,
        help="price at this CPU's measured forward and prefill times (scripts/llama_forward_table.py's "
        "JSON) instead of the modelled ones",
    )
    parser.add_argument(
        "--decide-at",
        choices=["calibrated", "modelled", "measured"],
        default="calibrated",
        help="the prices the goodput policy decides at: this machine's calibrated ones (the chat's), "
        "the modelled ones, or the --forward-table's",
    )
    parser.add_argument(
        "--length-bound",
        action="store_true",
        help="also search the best fixed k for each matched length at the policy's split (slow: "
        "about 30 decodings of the set a rule)",
    )
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    if args.decide_at == "measured" and args.forward_table is None:
        parser.error("--decide-at measured needs --forward-table")
    table = None if args.forward_table is None else json.loads(args.forward_table.read_text())
    pair = load_pair(
        ModelSpec(str(default_model_path())), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1)
    )
    target = pair.target
    assert isinstance(target, llama_cpp.LlamaCppModel)
    items = load_prompt_set(args.prompts, data_dir=args.data_dir, limit=args.limit).items
    prompts = [prompt_ids(pair.tokenizer, [Message("user", item.text)]) for item in items]
    report: dict[str, object] = {
        "argv": vars(args)
        | {
            "output": str(args.output),
            "data_dir": str(args.data_dir),
            "forward_table": str(args.forward_table),
        }
    }

    def reply(settings: DecodingSettings, prompt: list[int]) -> list[Step]:
        target.reset()
        return list(
            pair.speculative(Controls(settings)).generate(
                prompt, max_new_tokens=args.max_new_tokens, sampling=SamplingConfig()
            )
        )

    for name, rule in rules(args.thresholds).items():
        settings = replace(rule, draft_tokens=args.draft_tokens)
        runs: list[tuple[int, list[tuple[int, int]], float]] = []
        for prompt in prompts:
            decoded = reply(settings, prompt)
            runs.append(
                (
                    len(prompt),
                    [(s.stats.accepted_exact + s.stats.accepted_fuzzy, s.stats.emitted) for s in decoded],
                    sum(s.stats.cost for s in decoded),
                )
            )
        by_threads = {}
        for label, threads in SPLITS.items():
            target.set_threads(*threads)
            verify, prefill = prices(target, label, table)
            decode, overall = speedups(
                [
                    (
                        sum(emitted for _, emitted in steps) * verify[1],
                        sum(
                            verify[a + 1]
                            if a and (a + 1) / verify[a + 1] > 1 / verify[1]
                            else emitted * verify[1]
                            for a, emitted in steps
                        ),
                        prefill(prompt_length),
                    )
                    for prompt_length, steps, _ in runs
                ]
            )
            by_threads[label] = {
                "decode_median": statistics.median(decode),
                "with_prefill_median": statistics.median(overall),
                "with_prefill": overall,
            }
        pair.use_threads(SPLITS[POLICY_SPLIT][0], requested_batch=SPLITS[POLICY_SPLIT][1])
        if args.decide_at != "calibrated":
            measured = (
                {target: table[POLICY_SPLIT]["measured_seconds"]}
                if table is not None and args.decide_at == "measured"
                else {}
            )
            pair.timings = llama_cpp.priced_timings(target, None, measured)
        timings = pair.forward_timings()
        report[f"{args.decide_at}_verify_seconds"] = timings.verify_table()[1:9]  # V(1..8) decided at
        verify, prefill = prices(target, POLICY_SPLIT, table)
        goodput_reply = partial(reply, replace(settings, draft_policy="goodput"))

        for label, find in (("goodput", lookup.find_continuation), ("goodput_latest", latest_continuation)):
            scored = priced(goodput_reply, prompts, verify, timings.step, prefill, find)
            by_threads[POLICY_SPLIT] |= {f"{label}_{key}": value for key, value in scored.items()}
        if args.length_bound:
            by_threads[POLICY_SPLIT]["length_bound"] = length_bound(
                partial(
                    priced, goodput_reply, prompts, verify, timings.step, prefill, lookup.find_continuation
                ),
                DEFAULT_LOOKUP_NGRAM,
                args.draft_tokens,
            )
        target.set_threads(1, 1)
        tokens = sum(emitted for _, steps, _ in runs for _, emitted in steps)
        report[name] = {"threads": by_threads, "nats_per_token": sum(cost for *_, cost in runs) / tokens}
        print(name, json.dumps(by_threads), flush=True)
    args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
