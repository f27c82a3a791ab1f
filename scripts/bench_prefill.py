"""Time to first token of a long prompt, prefilled in one forward pass or `PREFILL_CHUNK` tokens a
pass (what lets the chat show the tokens read so far): target alone, one-token replies, caches
emptied before each, the two kinds interleaved so that drift in the machine's load hits both alike.

    .venv/bin/python scripts/bench_prefill.py --target MODEL_DIR --tokens 2000 --chunk 512 --runs 4

Prints each run and the median ratio (chunked / one pass, with the runs' range), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fsd_chat.decoding import Controls
from fsd_chat.decoding import reply as reply_module
from fsd_chat.decoding.settings import LOOKUP
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec

TEXT = Path(__file__).resolve().parents[1] / "docs" / "chat.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--tokens", type=int, default=2000, help="prompt tokens (from docs/chat.md)")
    parser.add_argument("--chunk", type=int, default=reply_module.PREFILL_CHUNK)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=Path("bench_prefill.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair(ModelSpec(args.target), ModelSpec(LOOKUP), LoadOptions(device="cpu"))
    ids = pair.tokenizer(TEXT.read_text(encoding="utf-8")).input_ids[: args.tokens]
    seconds: dict[str, list[float]] = {"one pass": [], "chunked": []}
    for run in range(args.runs):
        for kind, chunk in (("one pass", len(ids)), ("chunked", args.chunk)):
            reply_module.PREFILL_CHUNK = chunk
            decoder = pair.decoder(Controls(), autoregressive=True)
            start = time.perf_counter()
            for _ in decoder.generate(ids, max_new_tokens=1):
                pass
            seconds[kind].append(time.perf_counter() - start)
            print(f"run {run + 1} {kind}: {seconds[kind][-1]:.2f} s", flush=True)
    ratios = [c / w for c, w in zip(seconds["chunked"], seconds["one pass"], strict=True)]
    summary = {
        "target": args.target,
        "prompt_tokens": len(ids),
        "chunk": args.chunk,
        "threads": args.threads,
        "seconds": seconds,
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }
    print(
        f"{len(ids)} tokens: one pass {statistics.median(seconds['one pass']):.2f} s, chunks of {args.chunk} "
        f"{statistics.median(seconds['chunked']):.2f} s (medians); chunked / one pass ×{summary['ratio_median']:.2f} "
        f"(runs {min(ratios):.2f}–{max(ratios):.2f})"
    )
    args.output.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
