"""Time to the first token through a long conversation, with and without prefix reuse, and how long
the UI thread blocks when a message is sent in a resumed 600-turn session. Printed and written as
JSON.

First tokens: one conversation (messages of the same length, replies capped) driven until it has
filled the context window and lost its oldest exchanges; every reply is decoded by two decoders
over the same pair, one reusing its KV caches (`reuse_prefix`) and reading the conversation ahead
when a reply ends (`Decoder.read_ahead`, as the chat does while the user types), one starting each
reply from empty caches, in alternating order. Both reply the same text (greedy); the conversation
goes on with it. The conversation is driven `--repeats` times with new decoders; each reply's
figure is the median over them.

UI block: the real chat (Textual, headless) resumes a stored 600-turn session; a ticker in the UI's
event loop records how late it runs (the longest stall) from Enter until the message is stored.

    .venv/bin/python scripts/bench_first_token.py --target /tmp/scaled-target \\
        --draft ../shared/models/stories260K-draft --output docs/bench-first-token.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fsd_chat.conversation.session import ReplyRecord, Session, Turn, new_session_id, now
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig, SpeculativeDecoder
from fsd_chat.models.chat_template import Message, PromptBuilder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair

QUESTIONS = [
    "Once upon a time there was a little girl who liked to play.",
    "What did the little girl find in the big green park?",
    "Then a small brown dog came and wanted to play too.",
    "Why was the sun so warm and happy on that day?",
]
"""User messages of about the same length (12 to 13 tokens), asked in turn."""


def count_prefill(decoder: SpeculativeDecoder) -> list[int]:
    """Tokens fed by the target's forward passes that keep one position's logits (a reply's
    prefill comes first; verifying steps keep k + 1), recorded by wrapping its real forward."""
    target = decoder.target
    forward = target.forward
    counts: list[int] = []

    def counting(seq: torch.Tensor, upto: int, keep: int) -> torch.Tensor:
        if keep == 1:  # only a prefill keeps one position's logits: a step keeps k + 1
            counts.append(upto - target.seen)
        return forward(seq, upto, keep)

    target.forward = counting  # type: ignore[method-assign]
    return counts


def first_tokens(pair: ModelPair, turns: int, max_new_tokens: int) -> list[dict[str, float | int]]:
    """Per reply: the prompt's length, the tokens dropped from it, and both decoders' first-token
    seconds."""
    settings = DecodingSettings(rule="exact", threshold=0.0)
    reusing = pair.speculative(Controls(settings))
    fresh = pair.speculative(Controls(settings))
    fresh.reuse_prefix = False
    prefilled = {name: count_prefill(d) for name, d in (("reuse", reusing), ("fresh", fresh))}
    context = reusing.context
    assert context is not None
    for decoder in (reusing, fresh):  # the first forward passes of a process pay for set-up
        list(decoder.generate(pair.tokenizer("The end.").input_ids, max_new_tokens=4))
    builder = PromptBuilder(pair.tokenizer, raw=False)
    messages: list[Message] = []
    rows: list[dict[str, float | int]] = []
    for turn in range(turns):
        messages.append(Message("user", QUESTIONS[turn % len(QUESTIONS)]))
        dropped, ids = builder.build(messages, context=context, reserve=max_new_tokens)
        seconds: dict[str, float] = {}
        texts: dict[str, str] = {}
        order = ("reuse", "fresh") if turn % 2 == 0 else ("fresh", "reuse")
        for name in order:
            decoder = reusing if name == "reuse" else fresh
            prefilled[name].clear()
            stats = GenerationStats()
            text = []
            for step in decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=SamplingConfig()):
                stats.add(step)
                text.append(step.text)
            seconds[name], texts[name] = stats.first_token_seconds, "".join(text)
        assert texts["reuse"] == texts["fresh"], "prefix reuse changed a greedy reply"
        messages.append(Message("assistant", texts["reuse"]))
        reusing.read_ahead(builder.history(messages[-1]))  # as the chat does while the user types
        rows.append(
            {
                "reply": turn + 1,
                "prompt_tokens": len(ids),
                "dropped_messages": dropped,
                "prefilled_tokens_fresh": prefilled["fresh"][0] if prefilled["fresh"] else 0,
                "prefilled_tokens_reuse": prefilled["reuse"][0] if prefilled["reuse"] else 0,
                "first_token_seconds_fresh": seconds["fresh"],
                "first_token_seconds_reuse": seconds["reuse"],
            }
        )
        r = rows[-1]
        print(
            f"reply {turn + 1:2d}: prompt {len(ids):3d} tokens ({r['prefilled_tokens_reuse']:3d} prefilled "
            f"with reuse), {dropped:2d} messages dropped; first token "
            f"{seconds['fresh']:.3f} s without reuse, {seconds['reuse']:.3f} s with "
            f"(×{r['first_token_seconds_fresh'] / r['first_token_seconds_reuse']:.1f})",
            flush=True,
        )
    return rows


def median_row(rows: list[dict[str, float | int]]) -> dict[str, float | int]:
    """One reply's figures over the conversations: the median of each (the counts are the same
    in every run: greedy replies)."""
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def long_session(turns: int) -> Session:
    """A stored-looking session of `turns` turns (user and assistant alternating)."""
    session = Session(new_session_id(), now(), {}, {})
    for i in range(turns // 2):
        session.turns.append(Turn("user", f"Tell me about the cat number {i}, please."))
        reply = f"The cat number {i} sat on a mat and slept all day long."
        session.turns.append(Turn("assistant", reply, reply=ReplyRecord(stop_reason="max-new-tokens")))
    return session


async def ui_block(pair: ModelPair, turns: int, sends: int) -> list[float]:
    """Longest stall (seconds) of the UI's event loop from Enter until the message is stored (its
    prompt built), per send."""
    from fsd_chat.conversation.controller import ChatOptions
    from fsd_chat.tui.app import FsdChatApp
    from fsd_chat.tui.screens.chat import ChatScreen
    from fsd_chat.tui.widgets.prompt import PromptInput

    with tempfile.TemporaryDirectory() as folder:
        store = SessionStore(Path(folder) / "sessions.sqlite3")
        session = long_session(turns)
        store.append_turns(session, session.turns)
        options = ChatOptions(
            target=pair.target_spec, draft=pair.draft_spec, store=store, resume=store.load(session.id)
        )
        options.max_new_tokens = 8
        app = FsdChatApp(options, loader=lambda progress: pair)
        stalls: list[float] = []
        async with app.run_test(size=(110, 32)) as pilot:
            while not (isinstance(app.screen, ChatScreen) and isinstance(app.focused, PromptInput)):
                await pilot.pause(0.05)
            screen = app.screen
            for send in range(sends):
                stored = len(screen.session.turns) + 2
                await pilot.press(*f"And what about the dog number {send}?")
                await pilot.pause(0.2)
                worst = 0.0

                async def ticker(stored: int = stored) -> None:
                    # A tick every 5 ms, in the UI's own event loop: a late tick is a stalled loop.
                    nonlocal worst
                    tick = time.perf_counter()
                    while len(screen.session.turns) < stored:
                        await asyncio.sleep(0.005)
                        now_ = time.perf_counter()
                        worst = max(worst, now_ - tick - 0.005)
                        tick = now_

                ticking = asyncio.ensure_future(ticker())
                await pilot.press("enter")
                await ticking
                while screen.streaming is not None:
                    await pilot.pause(0.05)
                stalls.append(worst)
                print(f"send {send + 1}: the UI loop stalled at most {1e3 * worst:.1f} ms", flush=True)
        return stalls


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--turns", type=int, default=16, help="Replies in the conversation.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--session-turns", type=int, default=600)
    parser.add_argument("--sends", type=int, default=3)
    parser.add_argument(
        "--repeats", type=int, default=3, help="Conversations (each figure is the replies' median)."
    )
    parser.add_argument("--output", type=Path, default=Path("bench-first-token.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(
        ModelSpec(args.target), ModelSpec(args.draft), LoadOptions(device="cpu", dtype="float32")
    )
    runs = [first_tokens(pair, args.turns, args.max_new_tokens) for _ in range(args.repeats)]
    rows = [median_row([run[i] for run in runs]) for i in range(args.turns)]
    second = rows[1]["first_token_seconds_reuse"]
    before_trim = [r for r in rows[1:] if not r["dropped_messages"]]
    worst_before_trim = max(r["first_token_seconds_reuse"] for r in before_trim) / second
    print(f"with reuse, until the first trim: worst first token ×{worst_before_trim:.2f} the second reply's")
    stalls = asyncio.run(ui_block(pair, args.session_turns, args.sends))
    report = {
        "target": args.target,
        "draft": args.draft,
        "threads": 1,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "replies": rows,
        "runs": runs,
        "worst_reuse_over_second_before_trim": worst_before_trim,
        "session_turns": args.session_turns,
        "ui_stall_seconds_per_send": stalls,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
