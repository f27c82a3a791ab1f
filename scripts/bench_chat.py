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

3. With `--compare-threads A,B`, instead of 1 and 2: the chat at A against B threads for one-token
   forwards (`--threads`; every batch on `--threads-batch`), interleaved (the order alternating
   within pairs), with the machine as it is and, with `--busy-core`, with one more process keeping a
   core busy (scripts/bench_threads.py's). Per setting: decode tokens/s of the reply and the UI
   thread's share of the decoding as in 1, the paired ratio B / A (median, 95% bootstrap interval);
   then, in runs of their own (typing costs the UI thread work), the latency from a key press
   (Pilot, while the reply streams, every 50-150 ms at random, seed 0) to its effect: a character
   in the prompt (its text edited), the dial's ctrl+down / ctrl+up (the controls moved); median and
   95th percentile with 95% bootstrap intervals over every press of the setting.

Prints the figures and writes them to a JSON file. Offline pair by default (from the repository
root, which `-m` puts on the path):

    .venv/bin/python -m scripts.bench_chat --output bench-chat.json
    .venv/bin/python -m scripts.bench_chat --target default --draft lookup --dial chat --tokens 200 \
        --compare-threads 1,2 --threads-batch 2 --busy-core --output bench-chat-llama-threads.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from textual import events

from fsd_chat.cli.options import DECODING_OPTIONS, decoding_settings
from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.session import ReplyBuilder, Session, Turn, now
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig, Step
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import pair_specs
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.threads import choose_thread_counts, idle_cores
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.chat import ChatScreen
from fsd_chat.tui.widgets.prompt import PromptInput
from scripts.bench_threads import busy_core

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
PROMPT = "Once upon a time"
SETTINGS = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.05, draft_tokens=5)
CHAT_PROMPT = "Tell me a long story about a dragon who learns to fly."
"""A chat request the default model answers at length (300 greedy tokens before its end)."""
MECHANISM = (
    "tokens",
    "mean_accepted_length",
    "target_forwards",
    "drafted",
    "target_seconds",
    "other_seconds",
)
"""The reply's stats kept beside its tokens/s."""
KEYS = ("a", "ctrl+down", "a", "ctrl+up")
"""Pressed in turn while a reply streams: a character, then the dial down and back up."""


@dataclass(frozen=True)
class Setup:
    """What one chat run is asked: its message, dial and threads (None: the thread policy's)."""

    prompt: str = PROMPT
    settings: DecodingSettings = SETTINGS
    threshold_given: bool = True
    threads: int | None = None
    threads_batch: int | None = None
    typing: bool = False
    """Press `KEYS` while the reply streams and time their effects."""


@dataclass
class Latencies:
    """Seconds from a key press to its effect, by kind ("text": the prompt, "dial": the controls)."""

    text: list[float] = field(default_factory=list)
    dial: list[float] = field(default_factory=list)


def median_interval(values: list[float], q: float = 0.5) -> tuple[float, float]:
    """95% percentile bootstrap interval of the `q` quantile of `values` (the median by default;
    2,000 resamples, seed 0)."""
    data = torch.tensor(values, dtype=torch.float64)
    picks = torch.randint(len(values), (2000, len(values)), generator=torch.Generator().manual_seed(0))
    quantiles = torch.quantile(data[picks], q, dim=1)
    low, high = torch.quantile(quantiles, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def generate_tps(pair: ModelPair, tokens: int) -> float:
    """Decode tokens/s of `fsd-chat generate`'s loop (its output written nowhere)."""
    decoder = pair.speculative(Controls(SETTINGS))
    totals = GenerationStats()
    for step in decoder.generate(
        pair.tokenizer.encode(PROMPT), max_new_tokens=tokens, sampling=SamplingConfig()
    ):
        totals.add(step)
    assert totals.tokens == tokens, "the reply ended early: pick another prompt"
    return totals.tokens_per_second


def timed_effect(method: Callable[..., Any], pressed: deque[float], into: list[float]) -> Callable[..., Any]:
    """`method`, appending to `into` the seconds since the oldest press in `pressed` (taken) once it
    returns: keys take effect in the order they were pressed."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        if pressed:
            into.append(time.perf_counter() - pressed.popleft())
        return result

    return timed


async def type_while_streaming(app: FsdChatApp, screen: ChatScreen, rng: random.Random) -> Latencies:
    """Press `KEYS` in turn every 50-150 ms (at random) until the reply ends; the latency of each
    press (`send_key`) to its effect: the prompt's text edited, or the dial's controls moved."""
    latencies = Latencies()
    pressed: dict[str, deque[float]] = {"text": deque(), "dial": deque()}
    prompt = screen.query_one(PromptInput)
    prompt.edit = timed_effect(prompt.edit, pressed["text"], latencies.text)  # type: ignore[method-assign]
    screen._update_controls = timed_effect(  # type: ignore[method-assign]
        screen._update_controls, pressed["dial"], latencies.dial
    )
    keys = itertools.cycle(KEYS)
    while screen.streaming is None and not screen.session.turns:  # Enter's message not yet taken
        await asyncio.sleep(0.01)
    while screen.streaming is not None:
        await asyncio.sleep(rng.uniform(0.05, 0.15))
        if screen.streaming is None:
            break
        key = next(keys)
        pressed["text" if len(key) == 1 else "dial"].append(time.perf_counter())
        send_key(app, key)
    return latencies


def send_key(app: FsdChatApp, key: str) -> None:
    """Press `key` as the terminal driver does (`Driver.send_message`), as Pilot's `press` does,
    without Pilot's wait for the process to idle after it: a process decoding is never idle, so that
    wait runs to its 1 s cap twice a key."""
    driver = app._driver
    assert driver is not None
    event = events.Key(key, key if len(key) == 1 else None)
    event.set_sender(app)
    driver.send_message(event)


async def chat_run(
    pair: ModelPair, tokens: int, turns: int, setup: Setup, folder: Path, rng: random.Random | None = None
) -> dict[str, Any]:
    """One reply in the headless chat: its decode tokens/s, the UI thread's CPU per update and
    share of the decoding, and (`setup.typing`) the key presses' latencies in ms."""
    resume = None
    if turns > 1:
        builder = ReplyBuilder()
        steps = pair.speculative(Controls(SETTINGS)).generate(
            pair.tokenizer.encode(PROMPT), max_new_tokens=60
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
        settings=setup.settings,
        threshold_given=setup.threshold_given,
        max_new_tokens=tokens,
        resume=resume,
        threads=setup.threads,
        threads_batch=setup.threads_batch,
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
        await pilot.press(*setup.prompt)
        send_key(app, "enter")  # Pilot would wait (2 s) for the decoding process to idle
        latencies = Latencies()
        if setup.typing:
            latencies = await type_while_streaming(app, screen, rng or random.Random(0))
        while screen.streaming is not None or not screen.session.turns:
            await asyncio.sleep(0.05)  # not pilot.pause: it forces a screen update each time
        stats = screen.session.turns[-1].reply.stats  # type: ignore[union-attr]
    # The dial moved by typing may end the reply elsewhere: only its latencies are compared.
    assert setup.typing or stats["tokens"] == tokens, "the reply ended early: pick another prompt"
    # From the first update to the last: the steady work per update, drawing included (sending the
    # message, a one-off, is left out).
    per_update = (marks[-1] - marks[0]) / (len(marks) - 1)
    (start, ui_start), (end, ui_end) = window[0], window[-1]
    return {
        "tokens_per_second": stats["tokens_per_second"],
        "updates": len(marks),
        "ui_ms_per_update": 1000 * per_update,
        "ui_share_of_decoding": (ui_end - ui_start) / (end - start),
        # Where the time went: how many target forwards, at what price (the thread counts move both).
        **{key: stats[key] for key in MECHANISM},
        "text_ms": [1000 * t for t in latencies.text],
        "dial_ms": [1000 * t for t in latencies.dial],
    }


def compare_generate(args: argparse.Namespace, pair: ModelPair, setup: Setup, folder: Path) -> dict[str, Any]:
    """Parts 1 and 2 of the module docstring: the chat against `generate`, the UI's work per update."""
    torch.set_num_threads(args.threads)
    generate_tps(pair, 50)  # warm-up
    load_before = os.getloadavg()[0]  # the machine's other work, which scatters single runs

    ratios, gen, chat, ui_shares = [], [], [], []
    for _ in range(args.repeats):  # interleaved, so drift on the shared machine hits both alike
        g = generate_tps(pair, args.tokens)
        run = asyncio.run(chat_run(pair, args.tokens, 1, setup, folder))
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
            runs = [asyncio.run(chat_run(pair, tokens, turns, setup, folder)) for _ in range(3)]
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
    print(
        f"chat / generate, median of {args.repeats}: {statistics.median(ratios):.2f} "
        f"(95% CI {ratio_interval[0]:.2f}-{ratio_interval[1]:.2f}); UI thread "
        f"{statistics.median(ui_shares):.1%} of decoding (95% CI {ui_interval[0]:.1%}-"
        f"{ui_interval[1]:.1%}); load average {load_before:.1f} -> {load_after:.1f}"
    )
    return {
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


def summary(values: list[float]) -> dict[str, Any]:
    """Median and 95th percentile of `values` with their 95% bootstrap intervals, and their count."""
    return {
        "n": len(values),
        "median": statistics.median(values),
        "median_ci95": median_interval(values),
        "p95": torch.quantile(torch.tensor(values, dtype=torch.float64), 0.95).item(),
        "p95_ci95": median_interval(values, 0.95),
        "max": max(values),
    }


def compare_threads(args: argparse.Namespace, pair: ModelPair, setup: Setup, folder: Path) -> dict[str, Any]:
    """Part 3 of the module docstring: the chat at `--compare-threads` A against B."""
    counts = args.compare_threads
    setups = {
        n: Setup(setup.prompt, setup.settings, setup.threshold_given, n, args.threads_batch) for n in counts
    }
    conditions: dict[str, Callable[[], AbstractContextManager[Any]]] = {"as is": nullcontext}
    if args.busy_core:
        conditions["one busy core"] = busy_core
    rng = random.Random(0)
    asyncio.run(chat_run(pair, 50, 1, setups[counts[0]], folder))  # warm-up
    report: dict[str, Any] = {}
    for condition, context in conditions.items():
        with context():
            time.sleep(1)  # the busy process started, the load average settled a little
            seen = idle_cores()
            policy = {f"reserve {r}": choose_thread_counts(None, reserve=r) for r in (0, 1)}
            load_before = os.getloadavg()[0]
            runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
            typed: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
            for repeat in range(args.repeats):  # interleaved, the order alternating within pairs
                order = counts if repeat % 2 == 0 else counts[::-1]
                for n in order:
                    runs[n].append(asyncio.run(chat_run(pair, args.tokens, 1, setups[n], folder)))
                for n in order:
                    typing = Setup(**{**setups[n].__dict__, "typing": True})
                    typed[n].append(asyncio.run(chat_run(pair, args.tokens, 1, typing, folder, rng)))
                print(
                    f"{condition}: "
                    + "   ".join(
                        f"{n} a token {runs[n][-1]['tokens_per_second']:6.1f} tok/s, "
                        f"UI {runs[n][-1]['ui_share_of_decoding']:.1%}, "
                        f"key {statistics.median(typed[n][-1]['text_ms'] or [float('nan')]):.1f} ms"
                        for n in counts
                    ),
                    flush=True,
                )
            load_after = os.getloadavg()[0]
        a, b = counts
        ratios = [
            rb["tokens_per_second"] / ra["tokens_per_second"] for ra, rb in zip(runs[a], runs[b], strict=True)
        ]
        row: dict[str, Any] = {
            "idle_cores_seen": seen,
            "policy_counts": policy,
            "load_average_1min": [load_before, load_after],
            f"ratio_{b}_over_{a}": ratios,
            f"ratio_{b}_over_{a}_median": statistics.median(ratios),
            f"ratio_{b}_over_{a}_median_ci95": median_interval(ratios),
        }
        for n in counts:
            tps = [r["tokens_per_second"] for r in runs[n]]
            shares = [r["ui_share_of_decoding"] for r in runs[n]]
            row[f"{n} a token"] = {
                "tokens_per_second": tps,
                "tokens_per_second_median": statistics.median(tps),
                "ui_share_of_decoding": shares,
                "ui_share_of_decoding_median": statistics.median(shares),
                "ui_share_of_decoding_median_ci95": median_interval(shares),
                **{key: [r[key] for r in runs[n]] for key in MECHANISM},
                "typing_tokens_per_second": [r["tokens_per_second"] for r in typed[n]],
                "typing_tokens": [r["tokens"] for r in typed[n]],
                "key_to_text_ms": summary([t for r in typed[n] for t in r["text_ms"]]),
                "key_to_dial_ms": summary([t for r in typed[n] for t in r["dial_ms"]]),
            }
        report[condition] = row
        low, high = row[f"ratio_{b}_over_{a}_median_ci95"]
        print(
            f"{condition}: {b} / {a} threads a token, median of {args.repeats} pairs "
            f"{row[f'ratio_{b}_over_{a}_median']:.2f} (95% CI {low:.2f}-{high:.2f}); idle cores seen {seen}; "
            f"load average {load_before:.1f} -> {load_after:.1f}",
            flush=True,
        )
        for n in counts:
            text, dial = row[f"{n} a token"]["key_to_text_ms"], row[f"{n} a token"]["key_to_dial_ms"]
            print(
                f"  {n} a token: UI {row[f'{n} a token']['ui_share_of_decoding_median']:.1%} of decoding; "
                f"key to text median {text['median']:.1f} ms, p95 {text['p95']:.1f} ms (n {text['n']}); "
                f"key to dial median {dial['median']:.1f} ms, p95 {dial['p95']:.1f} ms (n {dial['n']})",
                flush=True,
            )
    return {
        "settings": {
            "target": pair.target_spec.source,
            "draft": pair.draft_spec.source,
            "engine": pair.describe(),
            "prompt": setup.prompt,
            "tokens": args.tokens,
            "threads_a_token": counts,
            "threads_batch": args.threads_batch,
            "dial": "the chat's defaults" if not setup.threshold_given else setup.settings.__dict__,
            "keys": KEYS,
            "cores": os.cpu_count(),
        },
        **report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(MODELS / "stories260K"), help="a model, or default")
    parser.add_argument("--draft", default=str(MODELS / "stories260K-draft"), help="a model, or lookup")
    parser.add_argument(
        "--dial",
        choices=("story", "chat"),
        default="story",
        help="story: fuzzy js T 0.05, k 5, fixed, 'Once upon a time'; chat: the chat's defaults "
        "(T from the model's sampling) and CHAT_PROMPT",
    )
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch's and the chat's threads (parts 1, 2)")
    parser.add_argument(
        "--compare-threads",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        help="A,B: part 3, the chat's threads for one-token forwards",
    )
    parser.add_argument("--threads-batch", type=int, default=None, help="part 3: the threads for batches")
    parser.add_argument("--busy-core", action="store_true", help="part 3: also with one more busy core")
    parser.add_argument("--output", type=Path, default=Path("bench-chat.json"))
    args = parser.parse_args()
    pair = load_pair(*pair_specs(args.target, args.draft, "none", "none", "cpu", "float32", False))
    setup = Setup(threads=args.threads)
    if args.dial == "chat":
        chat_dial = decoding_settings({option.name: option.default for option in DECODING_OPTIONS})
        setup = Setup(CHAT_PROMPT, chat_dial, threshold_given=False)
    folder = Path(tempfile.mkdtemp())
    if args.compare_threads is None:
        report = compare_generate(args, pair, setup, folder)
    else:
        report = compare_threads(args, pair, setup, folder)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
