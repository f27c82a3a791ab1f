"""The chat's decoding speed against `generate`'s, and the UI's work per update.

1. Decode tokens/s of one reply of N tokens in the real chat (headless Textual app, the worker
   thread, batching, the reply widget) against the same decoder driven the way `fsd-chat generate`
   drives it, same settings and the same number of torch threads, interleaved over repeats; the
   median of the paired ratios with its 95% percentile bootstrap interval (2,000 resamples, seed 0).
   With it, the UI thread's CPU time over the chat's decoding (first step to last) as a share of
   that wall time: on one core, or under the interpreter lock, the decoding thread loses about
   that much. A figure of the chat alone, it does not swing with the machine's speed, which on a
   shared virtual machine moves both sides of a pair by up to 1.6× between runs.
2. The UI thread's CPU time per update while a reply streams (from the first update to the last,
   drawing included), for replies of 100 and 500 tokens and for 1 and 100 turns in the session
   (a resumed one).

Prints the figures and writes them to a JSON file. Offline pair by default:

    .venv/bin/python scripts/bench_chat.py --output bench-chat.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.session import ReplyBuilder, Session, Turn, now
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig, Step
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.chat import ChatScreen

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
PROMPT = "Once upon a time"
SETTINGS = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.05, draft_tokens=5)


def median_interval(values: list[float]) -> tuple[float, float]:
    """95% percentile bootstrap interval of the median of `values` (2,000 resamples, seed 0)."""
    data = torch.tensor(values, dtype=torch.float64)
    picks = torch.randint(len(values), (2000, len(values)), generator=torch.Generator().manual_seed(0))
    medians = data[picks].median(dim=1).values
    low, high = torch.quantile(medians, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def generate_tps(pair: ModelPair, tokens: int) -> float:
    """Decode tokens/s of `fsd-chat generate`'s loop (its output written nowhere)."""
    decoder = pair.speculative(Controls(SETTINGS))
    totals = GenerationStats()
    for step in decoder.generate(
        pair.tokenizer(PROMPT).input_ids, max_new_tokens=tokens, sampling=SamplingConfig()
    ):
        totals.add(step)
    assert totals.tokens == tokens, "the reply ended early: pick another prompt"
    return totals.tokens_per_second


async def chat_run(pair: ModelPair, tokens: int, turns: int, threads: int, folder: Path) -> dict[str, float]:
    """One reply in the headless chat: its decode tokens/s and the UI thread's CPU per update."""
    resume = None
    if turns > 1:
        builder = ReplyBuilder()
        steps = pair.speculative(Controls(SETTINGS)).generate(
            pair.tokenizer(PROMPT).input_ids, max_new_tokens=60
        )
        for step in steps:
            builder.add(step)
        # Empty texts for the prompt (a base model skips them), full replies on screen: the screen
        # holds `turns` turns while the prompt still leaves room for the whole reply.
        history: list[Turn] = []
        for _ in range((turns - 1) // 2):
            history += [Turn("user", ""), Turn("assistant", "", reply=builder.record)]
        resume = Session("bench000", now(), {}, {}, None, history)
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(folder / f"s{time.monotonic_ns()}.sqlite3"),
        settings=SETTINGS,
        max_new_tokens=tokens,
        resume=resume,
        threads=threads,
    )
    ui_clock = time.pthread_getcpuclockid(threading.main_thread().ident or 0)  # the app runs here
    window: list[tuple[float, float]] = []  # (wall, UI thread CPU) at the first and last step

    def timed(pair: ModelPair, controls: Controls) -> Decoder:
        decoder = pair.decoder(controls)
        generate = decoder.generate

        def steps(*args: object, **kwargs: object) -> Iterator[Step]:
            for step in generate(*args, **kwargs):  # type: ignore[arg-type]
                if not window or step.stop_reason is not None:
                    window.append((time.perf_counter(), time.clock_gettime(ui_clock)))
                yield step

        decoder.generate = steps  # type: ignore[method-assign]
        return decoder

    app = FsdChatApp(options, loader=lambda progress: pair, decoder_factory=timed)
    async with app.run_test(size=(110, 32)) as pilot:
        while not isinstance(app.screen, ChatScreen):
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        screen = app.screen
        marks: list[float] = []  # the UI thread's CPU clock at each update
        show = screen._show_steps

        def counting(ended: bool = False) -> None:
            marks.append(time.thread_time())
            show(ended)

        screen._show_steps = counting  # type: ignore[method-assign]
        await pilot.press(*PROMPT, "enter")
        while screen.streaming is not None or not screen.session.turns:
            await asyncio.sleep(0.05)  # not pilot.pause: it forces a screen update each time
        stats = screen.session.turns[-1].reply.stats  # type: ignore[union-attr]
    assert stats["tokens"] == tokens, "the reply ended early: pick another prompt"
    # From the first update to the last: the steady work per update, drawing included (sending the
    # message, a one-off, is left out).
    per_update = (marks[-1] - marks[0]) / (len(marks) - 1)
    (start, ui_start), (end, ui_end) = window[0], window[-1]
    return {
        "tokens_per_second": stats["tokens_per_second"],
        "updates": len(marks),
        "ui_ms_per_update": 1000 * per_update,
        "ui_share_of_decoding": (ui_end - ui_start) / (end - start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(MODELS / "stories260K"))
    parser.add_argument("--draft", default=str(MODELS / "stories260K-draft"))
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=Path("bench-chat.json"))
    args = parser.parse_args()
    pair = load_pair(
        ModelSpec(args.target), ModelSpec(args.draft), LoadOptions(device="cpu", dtype="float32")
    )
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp())
    generate_tps(pair, 50)  # warm-up
    load_before = os.getloadavg()[0]  # the machine's other work, which scatters single runs

    ratios, gen, chat, ui_shares = [], [], [], []
    for _ in range(args.repeats):  # interleaved, so drift on the shared machine hits both alike
        g = generate_tps(pair, args.tokens)
        run = asyncio.run(chat_run(pair, args.tokens, 1, args.threads, folder))
        c = run["tokens_per_second"]
        torch.set_num_threads(args.threads)
        gen.append(g)
        chat.append(c)
        ratios.append(c / g)
        ui_shares.append(run["ui_share_of_decoding"])
        print(
            f"generate {g:7.1f} tok/s   chat {c:7.1f} tok/s   ratio {c / g:.2f}   "
            f"UI {ui_shares[-1]:.1%} of decoding",
            flush=True,
        )
    load_after = os.getloadavg()[0]
    ratio_interval = median_interval(ratios)
    ui_interval = median_interval(ui_shares)
    per_update = {}
    for tokens in (100, 500):
        for turns in (1, 100):
            runs = [asyncio.run(chat_run(pair, tokens, turns, args.threads, folder)) for _ in range(3)]
            torch.set_num_threads(args.threads)
            ms = statistics.median(r["ui_ms_per_update"] for r in runs)
            per_update[f"{tokens} tokens, {turns} turns"] = {
                "ui_ms_per_update": ms,
                "updates": statistics.median(r["updates"] for r in runs),
                "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            }
            print(
                f"{tokens:4d} tokens, {turns:3d} turns on screen: UI {ms:5.2f} ms CPU per update", flush=True
            )
    report = {
        "settings": {
            "tokens": args.tokens,
            "threads": args.threads,
            "rule": "fuzzy",
            "divergence": "js",
            "threshold": 0.05,
            "k": 5,
            "temperature": 0,
        },
        "generate_tokens_per_second": gen,
        "chat_tokens_per_second": chat,
        "chat_over_generate": ratios,
        "chat_over_generate_median": statistics.median(ratios),
        "chat_over_generate_median_ci95": ratio_interval,
        "ui_share_of_decoding": ui_shares,
        "ui_share_of_decoding_median": statistics.median(ui_shares),
        "ui_share_of_decoding_median_ci95": ui_interval,
        "generate_median": statistics.median(gen),
        "chat_median": statistics.median(chat),
        "load_average_1min": [load_before, load_after],
        "per_update": per_update,
    }
    args.output.write_text(json.dumps(report, indent=2))
    print(
        f"chat / generate, median of {args.repeats}: {report['chat_over_generate_median']:.2f} "
        f"(95% CI {ratio_interval[0]:.2f}-{ratio_interval[1]:.2f}); UI thread "
        f"{report['ui_share_of_decoding_median']:.1%} of decoding (95% CI {ui_interval[0]:.1%}-"
        f"{ui_interval[1]:.1%}); load average {load_before:.1f} -> {load_after:.1f}  ({args.output})"
    )


if __name__ == "__main__":
    main()
