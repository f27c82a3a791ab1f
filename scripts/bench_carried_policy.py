"""A conversation's second reply with the draft policy carried from the first: the pause's backoff
restarted at the reply's start (`GoodputPolicy.begin_reply`, fsd-chat's behaviour) against carried
as it stood (`begin_reply` a no-op: the behaviour before it), on the default chat.

Each conversation asks a question prompt lookup can hardly copy for (an MT-Bench prompt: the
policy tends to pause, its backoff growing), then a copy-heavy request (a summary of a story,
`tinystories-summarise-chat`); the second reply is timed from its call to its last token, prefill
included. The default chat's settings (prompt lookup, fuzzy, the greedy threshold T 1, k ≤ 5,
`goodput`, greedy), on llama.cpp with one thread a token and two a batch, one decoder a
conversation reusing its KV caches as the chat does. The two arms alternate which goes first,
conversation by conversation; ratios are restarted / carried a conversation, the median with its
distribution-free 95% interval (`median_with_ci95`). Prints the figures and writes a JSON file:

    .venv/bin/python scripts/bench_carried_policy.py --output docs/bench-carried-policy.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any
from unittest import mock

from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.stats import median_with_ci95
from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
from fsd_chat.decoding.draft_policy import GoodputPolicy
from fsd_chat.decoding.settings import DEFAULT_GREEDY_THRESHOLD
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair

SETTINGS = DecodingSettings(
    rule="fuzzy", divergence="js", threshold=DEFAULT_GREEDY_THRESHOLD, draft_tokens=5, draft_policy="goodput"
)


def reply(decoder: Any, prompt: list[int], tokens: int) -> tuple[list[int], float, int, bool]:
    """The greedy reply's ids, its seconds from the call to the last token, its steps, and whether
    its last step was paused (the draft policy's pause, which the next reply starts with)."""
    start = time.perf_counter()
    steps = list(decoder.generate(prompt, max_new_tokens=tokens, sampling=SamplingConfig()))
    seconds = time.perf_counter() - start
    return (
        [t.id for step in steps for t in step.tokens],
        seconds,
        len(steps),
        steps[-1].stats.paused is not None,
    )


def conversation(pair: ModelPair, question: str, request: str, tokens: int) -> dict[str, Any]:
    """The two replies of one conversation on a fresh decoder: the second's tokens/s, and whether
    the policy was paused when it began."""
    decoder = pair.decoder(Controls(SETTINGS))
    first = [Message("user", question)]
    answer, _, _, paused = reply(decoder, prompt_ids(pair.tokenizer, first), tokens)
    history = [*first, Message("assistant", pair.tokenizer.decode(answer)), Message("user", request)]
    ids, seconds, steps, _ = reply(decoder, prompt_ids(pair.tokenizer, history), tokens)
    return {"tokens": len(ids), "seconds": seconds, "steps": steps, "paused_at_start": paused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens a reply, at most")
    parser.add_argument("--output", type=Path, default=Path("bench-carried-policy.json"))
    args = parser.parse_args()
    pair = load_pair(
        ModelSpec(str(default_model_path())), ModelSpec("lookup"), LoadOptions(engine="llama.cpp")
    )
    pair.use_threads(1, requested_batch=2)
    questions = load_prompt_set("mt-bench", data_dir=args.data_dir, limit=args.conversations).items
    requests = load_prompt_set(
        "tinystories-summarise-chat", data_dir=args.data_dir, limit=args.conversations
    ).items
    rows = []
    for number, (question, request) in enumerate(zip(questions, requests, strict=True)):
        row: dict[str, Any] = {}
        for arm in ("restarted", "carried") if number % 2 == 0 else ("carried", "restarted"):
            if arm == "carried":
                with mock.patch.object(GoodputPolicy, "begin_reply", lambda self: None):
                    row[arm] = conversation(pair, question.text, request.text, args.tokens)
            else:
                row[arm] = conversation(pair, question.text, request.text, args.tokens)
        rows.append(row)
        rates = {arm: r["tokens"] / r["seconds"] for arm, r in row.items()}
        print(f"{number}: restarted {rates['restarted']:.1f} tok/s, carried {rates['carried']:.1f} tok/s")
    ratios = [
        (r["restarted"]["tokens"] / r["restarted"]["seconds"])
        / (r["carried"]["tokens"] / r["carried"]["seconds"])
        for r in rows
    ]
    median, interval = median_with_ci95(ratios)
    paused = sum(r["carried"]["paused_at_start"] for r in rows)
    print(
        f"second reply, restarted / carried: {median:.3f}× {interval}; paused at its start in {paused} of {len(rows)}"
    )
    report = {
        "settings": str(SETTINGS),
        "load_1min": os.getloadavg()[0],
        "conversations": rows,
        "ratio": {"median": median, "ci95": interval},
    }
    args.output.write_text(json.dumps(report, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
