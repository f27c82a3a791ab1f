"""Load on `fsd-chat serve`: N concurrent clients (20 by default), each streaming one chat reply
through the official `openai` client; every reply must arrive whole (a finish_reason, then the usage
chunk, then the stream's end) and none may be lost.

Starts the server itself on a free localhost port (`fsd-chat serve --port 0`, queue large enough for
every client), or loads one already running on this machine (`--url`, loopback addresses only).
Prints and writes JSON: the clients' time to first token (p50/p99, seconds, from sending the request
to the first text chunk; p99 by linear interpolation, which with 20 clients is close to the slowest)
and the total throughput (completion tokens of all clients / wall-clock seconds from the first
request to the last reply's end).

    .venv/bin/python scripts/load_server.py --output load-server.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
from openai import OpenAI

from fsd_chat.server.run import is_loopback

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
PROMPTS = [
    "Once upon a time",
    "Tom had a red ball",
    "The little cat was sad",
    "One day, Lily went to the park",
]
MAX_CLIENTS = 200
"""More clients than this is not a local load test."""


def one_client(client: OpenAI, model: str, index: int, max_tokens: int, temperature: float) -> dict[str, Any]:
    """One streamed chat reply; its timings and whether it arrived whole."""
    start = time.perf_counter()
    first: float | None = None
    finish = None
    usage = None
    text = ""
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            max_tokens=max_tokens,
            temperature=temperature,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta.content or ""
            if delta and first is None:
                first = time.perf_counter() - start
            text += delta
            finish = chunk.choices[0].finish_reason or finish
    except Exception as exc:  # a lost reply is a result here, reported with its reason
        return {"client": index, "complete": False, "error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter() - start
    complete = finish in {"stop", "length"} and usage is not None and first is not None
    return {
        "client": index,
        "complete": complete,
        "first_token_s": first,
        "total_s": end,
        "completion_tokens": usage,
        "finish_reason": finish,
        "characters": len(text),
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """`fsd-chat serve` on a free localhost port; returns the process and its API URL."""
    command = [sys.executable, "-m", "fsd_chat", "serve", "--target", args.target, "--draft", args.draft]
    command += ["--device", args.device, "--port", "0", "--queue-size", str(max(args.clients, 1))]
    command += ["--threshold", str(args.threshold)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    assert process.stderr is not None
    line = process.stderr.readline()
    found = re.search(r"at (http://\S+/v1)", line)
    if not found:
        process.kill()
        raise SystemExit(f"the server did not start: {line.strip()} {process.stderr.read()[-2000:]}")
    return process, found.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", help="A running server's API on this machine, e.g. http://127.0.0.1:8000/v1."
    )
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--target", default=str(MODELS / "stories260K"))
    parser.add_argument("--draft", default=str(MODELS / "stories260K-draft"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threshold", type=float, default=0.05)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds the whole load may take.")
    parser.add_argument("--output", type=Path, default=Path("load-server.json"))
    args = parser.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS:
        parser.error(f"--clients must be in 1..{MAX_CLIENTS}")
    if args.url and not is_loopback(urlparse(args.url).hostname or ""):
        parser.error("--url must be a server on this machine (127.0.0.1, ::1 or localhost)")

    process, url = (None, args.url) if args.url else start_server(args)
    try:
        client = OpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
        model = client.models.list().data[0].id
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.clients) as pool:
            futures = [
                pool.submit(one_client, client, model, i, args.max_tokens, args.temperature)
                for i in range(args.clients)
            ]
            results = [
                f.result(timeout=max(args.timeout - (time.perf_counter() - started), 1)) for f in futures
            ]
        wall = time.perf_counter() - started
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    done = [r for r in results if r["complete"]]
    firsts = np.array([r["first_token_s"] for r in done], dtype=float)
    tokens = sum(r["completion_tokens"] for r in done)
    summary = {
        "url": url,
        "model": model,
        "clients": args.clients,
        "complete": len(done),
        "lost": args.clients - len(done),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "first_token_p50_s": float(np.percentile(firsts, 50)) if len(done) else None,
        "first_token_p99_s": float(np.percentile(firsts, 99)) if len(done) else None,
        "completion_tokens": tokens,
        "wall_s": wall,
        "total_tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "results": results,
    }
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    print(f"written to {args.output}")
    if summary["lost"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
