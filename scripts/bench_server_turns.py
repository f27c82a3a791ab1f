"""What reading the conversation ahead saves a multi-turn client of `fsd-chat serve`.

Two servers over one loaded pair, each with its own decoder: one reads a conversation ahead when a
reply ends (what `serve` does), one does not (its `Engine._read_ahead` does nothing). For each
MT-Bench question, on both servers in turn (the order alternating): the first turn streamed, then,
once the engine is idle (a user types for longer than it reads), the second turn with the first
reply re-sent as the official `openai` client sends it. Per second turn: the prompt tokens
prefilled (`timings.prompt_n`) and the time to first token measured by the client (streamed, from
sending the request to the first text chunk). Prints the medians and the paired ratio of the times
to first token with its 95% percentile bootstrap interval (2,000 resamples, seed 0), and writes
them to a JSON file. By default the default chat model (SmolLM2-135M-Instruct, GGUF) with prompt
lookup, greedy:

    .venv/bin/python scripts/bench_server_turns.py --output bench-server-turns.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from openai import OpenAI

from fsd_chat.decoding.controls import Controls
from fsd_chat.decoding.settings import DecodingSettings, SamplingRequest
from fsd_chat.models.default_model import fetch_default_model
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.server.app import ServeOptions, create_app
from fsd_chat.server.engine import Engine
from fsd_chat.server.run import bind, url
from fsd_chat.support.threads import apply_threads

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MODEL = "bench"


@contextmanager
def server(pair: ModelPair, read_ahead: bool) -> Iterator[tuple[str, Engine]]:
    """A server of `pair` on a free localhost port, with its own decoder; yields its URL and engine."""
    controls = Controls(DecodingSettings())
    engine = Engine(pair.decoder(controls), controls, queue_size=4)
    if not read_ahead:
        engine._read_ahead = lambda *args: None  # type: ignore[method-assign]
    options = ServeOptions(
        MODEL, frozenset(), DecodingSettings(), SamplingRequest(temperature=0.0), 64, False, None
    )
    sock = bind("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn.Config(create_app(pair, engine, options), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    try:
        yield url(sock), engine
    finally:
        uv.should_exit = True
        thread.join(30)
        engine.close()
        sock.close()


def turn(client: OpenAI, messages: list[Any], tokens: int) -> tuple[str, float, dict[str, Any]]:
    """One streamed reply: its text, the time to its first text chunk (seconds), its timings."""
    start = time.perf_counter()
    first: float | None = None
    text, timings = "", dict[str, Any]()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=tokens,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - start
            text += chunk.choices[0].delta.content
        timings = (chunk.model_extra or {}).get("timings", timings)
    assert first is not None, "a reply without text"
    return text, first, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target model (default: the default chat model)")
    parser.add_argument("--draft", default="lookup", help="draft model, or lookup")
    parser.add_argument("--questions", type=int, default=12, help="MT-Bench questions")
    parser.add_argument("--tokens", type=int, default=96, help="tokens a reply")
    parser.add_argument("--threads", type=int, help="torch threads (default: the chat's policy)")
    parser.add_argument("--output", type=Path, default=Path("bench-server-turns.json"))
    args = parser.parse_args()
    target = args.target or str(fetch_default_model())
    pair = load_pair(ModelSpec(target), ModelSpec(args.draft), LoadOptions())
    apply_threads(args.threads)
    lines = (DATA / "mt_bench" / "question.jsonl").read_text().splitlines()
    questions = [json.loads(line)["turns"] for line in lines[: args.questions]]
    rows: dict[str, list[dict[str, float]]] = {"read ahead": [], "not read ahead": []}
    load_before = os.getloadavg()[0]
    with server(pair, True) as (on_url, on_engine), server(pair, False) as (off_url, off_engine):
        sides = [("read ahead", OpenAI(base_url=on_url, api_key="-"), on_engine)]
        sides.append(("not read ahead", OpenAI(base_url=off_url, api_key="-"), off_engine))
        for index, (first, second) in enumerate(questions):
            for name, client, engine in sides if index % 2 == 0 else sides[::-1]:
                history = [{"role": "user", "content": first}]
                reply, _, _ = turn(client, history, args.tokens)
                assert engine.wait_idle(120)
                history += [{"role": "assistant", "content": reply}, {"role": "user", "content": second}]
                _, ttft, timings = turn(client, history, args.tokens)
                assert engine.wait_idle(120)
                rows[name].append(
                    {"ttft": ttft, "prompt_n": timings["prompt_n"], "cache_n": timings["cache_n"]}
                )
            on, off = rows["read ahead"][-1], rows["not read ahead"][-1]
            print(
                f"question {index + 1}: prefilled {on['prompt_n']:4d} vs {off['prompt_n']:4d} tokens, "
                f"first token {on['ttft']:.3f} s vs {off['ttft']:.3f} s",
                flush=True,
            )
    ratios = [
        on["ttft"] / off["ttft"] for on, off in zip(rows["read ahead"], rows["not read ahead"], strict=True)
    ]
    picks = np.random.default_rng(0).integers(len(ratios), size=(2000, len(ratios)))
    low, high = np.quantile(np.median(np.array(ratios)[picks], axis=1), [0.025, 0.975])
    report = {
        "target": target,
        "draft": args.draft,
        "tokens": args.tokens,
        "questions": len(questions),
        "rows": rows,
        "prefilled_median": {
            name: statistics.median(r["prompt_n"] for r in side) for name, side in rows.items()
        },
        "ttft_median": {name: statistics.median(r["ttft"] for r in side) for name, side in rows.items()},
        "ttft_ratio_median": statistics.median(ratios),
        "ttft_ratio_ci95": [float(low), float(high)],
        "load_average_1min": [load_before, os.getloadavg()[0]],
    }
    args.output.write_text(json.dumps(report, indent=2))
    print(
        f"second turns prefilled (median): {report['prefilled_median']['read ahead']:.0f} tokens read ahead, "
        f"{report['prefilled_median']['not read ahead']:.0f} not; time to first token, read ahead / not: "
        f"{report['ttft_ratio_median']:.2f} (95% CI {low:.2f}-{high:.2f})  ({args.output})"
    )


if __name__ == "__main__":
    main()
