"""Prompt lookup's draft-length policies replayed over greedy replies, in seconds: the goodput policy
at the forward table's prices and at the modelled ones, against an oracle and the best fixed k per
matched length, on the default model at the chat's split (one thread a token, two a batch).

Under greedy decoding at T = 0 the reply is the target's whatever the policy drafts, so each prompt
is decoded once (the target alone; `--replies` keeps them) and every policy is replayed over it
without a model: at each position, prompt lookup's copy (`lookup.find_continuation` over the
context so far, up to k tokens) and how many of its tokens the reply goes on with are known, and a
step drafting j of them emits min(j, accepted) + 1 tokens. The policy object is the decoder's own
(`draft_policy.make_policy`), told each step's matched length and verdict as the decoder tells it.
A step is priced at the table's V(j + 1) over the step's context (`ForwardTimings.verify_table`),
plus the drafting step's own work (`ForwardTimings.step`), against a target-only step's V(1); each
reply's ratio is the target alone's seconds over the policy's (decoding: the prefill is the same for
both). The replay is exact at T = 0; a lossy rule changes the text with the policy, which
`scripts/lookup_ceiling.py` decodes.

- oracle: drafts exactly the copy's accepted tokens where that pays, none elsewhere;
- length bound: the best fixed k for each matched length found on these replies
  (`lookup_ceiling.length_bound`);
- goodput: the app's policy deciding at the table's prices, and at the modelled ones.

    PYTHONPATH=. .venv/bin/python scripts/policy_replay.py --prompts tinystories-summarise-chat --limit 30 \
        --forward-table docs/llama-forward-table.json --replies /tmp/summarise-replies.json --output /tmp/replay.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig, lookup
from fsd_chat.decoding.draft_policy import DraftPolicy, make_policy
from fsd_chat.decoding.forward_timings import ForwardTimings
from fsd_chat.decoding.settings import DEFAULT_LOOKUP_NGRAM
from fsd_chat.engines import llama_cpp
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from scripts.lookup_ceiling import POLICY_SPLIT, SPLITS, geometric_mean, length_bound


class Copy(NamedTuple):
    """Prompt lookup's copy at one position of a reply."""

    matched: int
    """The matched suffix's length in tokens (0: nothing matched)."""
    proposed: int
    """Tokens the copy offers, ≤ k."""
    accepted: int
    """How many of them the reply goes on with."""


class Recorded(NamedTuple):
    """A greedy reply as the replay reads it (not the decoder's `Reply`)."""

    prompt: int
    """The prompt's length in tokens."""
    copies: list[Copy]
    """One a position of the reply."""


def copies(prompt: list[int], reply: list[int], k: int) -> Recorded:
    """Prompt lookup's copy at each position of `reply` after `prompt` (up to `k` tokens)."""
    context = np.array(prompt + reply, dtype=np.int64)
    found = []
    for length in range(len(prompt), len(context)):
        start, proposed, matched = lookup.find_continuation(context[:length], DEFAULT_LOOKUP_NGRAM, k)
        n = min(proposed, len(context) - length)
        same = context[start : start + n] == context[length : length + n]
        accepted = int(same.size if same.all() else same.argmin())
        found.append(Copy(matched, proposed, accepted))
    return Recorded(len(prompt), found)


def replay(
    replies: list[Recorded], timings: ForwardTimings, choose: Callable[[], Callable[[Copy, int, int], int]]
) -> dict[str, Any]:
    """Each reply's decoding speed-up over the target alone when `choose()` (a fresh chooser a reply)
    picks each step's draft length from (copy, room to draft, context length), and its steps (tokens
    drafted, tokens emitted)."""
    ratios: list[float] = []
    steps: list[list[tuple[int, int]]] = []
    for reply in replies:
        pick = choose()
        position = 0
        taken = alone = 0.0
        steps.append([])
        while position < len(reply.copies):
            context = reply.prompt + position
            copy = reply.copies[position]
            # The decoder's room: the tokens a step may draft and still emit one after them.
            room = len(reply.copies) - position - 1
            drafted = min(pick(copy, room, context), copy.proposed)
            emitted = min(min(drafted, copy.accepted) + 1, len(reply.copies) - position)
            taken += timings.verify_table(context)[drafted + 1] + (timings.step if drafted else 0.0)
            alone += sum(timings.verify_table(context + j)[1] for j in range(emitted))
            position += emitted
            steps[-1].append((drafted, emitted))
        ratios.append(alone / taken)
    return {"decode_geometric_mean": geometric_mean(ratios), "decode": ratios, "steps": steps}


def driving(policy: Callable[[], DraftPolicy], k: int) -> Callable[[], Callable[[Copy, int, int], int]]:
    """A chooser driving a fresh `policy()` as the decoder does: `limit` with the matched length,
    then `observe` with the verdict."""
    settings = DecodingSettings(draft_tokens=k)

    def fresh() -> Callable[[Copy, int, int], int]:
        made = policy()

        def pick(copy: Copy, room: int, context: int) -> int:
            drafted = min(made.limit(settings, room, copy.matched, context), copy.proposed)
            if drafted:
                made.observe(drafted, min(drafted, copy.accepted))
            return drafted

        return pick

    return fresh


def oracle(timings: ForwardTimings) -> Callable[[Copy, int, int], int]:
    """Drafts the copy's accepted tokens where a + 1 tokens in V(a + 1) beat a target-only step."""

    def pick(copy: Copy, room: int, context: int) -> int:
        verify = timings.verify_table(context)
        a = copy.accepted
        return a if a and (a + 1) / (verify[a + 1] + timings.step) > 1 / verify[1] else 0

    return pick


def record(
    pair: ModelPair, prompts: list[list[int]], max_new_tokens: int, path: Path | None
) -> list[list[int]]:
    """The target alone's greedy replies to `prompts` (read from `path` where it holds them)."""
    if path is not None and path.exists():
        return [list(reply) for reply in json.loads(path.read_text())]
    decoder = pair.autoregressive(Controls(DecodingSettings(rule="exact", threshold=0.0)), reuse_prefix=False)
    replies = []
    for prompt in prompts:
        steps = decoder.generate(prompt, max_new_tokens=max_new_tokens, sampling=SamplingConfig())
        replies.append([token.id for step in steps for token in step.tokens])
    if path is not None:
        path.write_text(json.dumps(replies))
    return replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="tinystories-summarise-chat")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument(
        "--forward-table", type=Path, required=True, help="scripts/llama_forward_table.py's JSON"
    )
    parser.add_argument("--replies", type=Path, help="keep (or reuse) the greedy replies here")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    pair = load_pair(
        ModelSpec(str(default_model_path())), ModelSpec("lookup"), LoadOptions(engine="llama.cpp")
    )
    target = pair.target
    assert isinstance(target, llama_cpp.LlamaCppModel)
    target.set_threads(*SPLITS[POLICY_SPLIT])
    items = load_prompt_set(args.prompts, data_dir=args.data_dir, limit=args.limit).items
    prompts = [prompt_ids(pair.tokenizer, [Message("user", item.text)]) for item in items]
    replies = [
        copies(p, r, args.draft_tokens)
        for p, r in zip(prompts, record(pair, prompts, args.max_new_tokens, args.replies), strict=True)
    ]
    table = json.loads(args.forward_table.read_text())[POLICY_SPLIT]["measured_seconds"]
    measured = llama_cpp.priced_timings(target, None, {target: table})
    modelled = llama_cpp.priced_timings(target, None, {})
    k = args.draft_tokens

    def goodput(timings: ForwardTimings) -> Callable[[], DraftPolicy]:
        return lambda: make_policy("goodput", lambda: timings, "lookup", DEFAULT_LOOKUP_NGRAM)

    report: dict[str, Any] = {"argv": {key: str(value) for key, value in vars(args).items()}}
    report["oracle"] = replay(replies, measured, lambda: oracle(measured))
    report["length_bound"] = length_bound(
        lambda policy: replay(replies, measured, driving(policy, k)), DEFAULT_LOOKUP_NGRAM, k
    )
    report["goodput_at_measured_prices"] = replay(replies, measured, driving(goodput(measured), k))
    report["goodput_at_modelled_prices"] = replay(replies, measured, driving(goodput(modelled), k))
    for name, result in report.items():
        if name != "argv":
            print(f"{name}: {result['decode_geometric_mean']:.3f}", result.get("ks_by_matched_length", ""))
    args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
