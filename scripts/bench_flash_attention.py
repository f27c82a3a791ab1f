"""llama.cpp with and without flash attention on a GGUF file: decoding and prefill speed, and how far
a batch's logits are from those of the same tokens fed one by one.

Why: the llama.cpp engine opens its contexts with flash attention (`engines.llama_cpp.open_gguf`),
as llama.cpp's own tools do by default (`-fa auto`), where llama-cpp-python defaults to without.
Without it, a batch attends other than single tokens on some CPUs, which moved greedy speculative
decoding off llama.cpp's own greedy text; this measures what the choice costs or buys.

Both contexts are open in one process; each round runs both, which first switching every round, on
the same prompt (a prefill of its tokens, then greedy decoding of `--tokens` tokens, one thread a
token and two a batch as the chat's split). Ratios are with / without flash attention a round, the
median with its distribution-free 95% interval (`fsd_chat.bench.stats.median_with_ci95`: at least 6
rounds). Prints the figures and writes them to a JSON file:

    .venv/bin/python scripts/bench_flash_attention.py --output docs/bench-flash-attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from fsd_chat.bench.stats import median_with_ci95
from fsd_chat.engines.llama_cpp import BATCH, llama_cpp_module
from fsd_chat.models.default_model import default_model_path

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 8


def open_context(path: Path, flash: bool) -> Any:
    """A `Llama` over `path` as the engine opens one but for flash attention, with every
    position's logits kept (the batch comparison reads them)."""
    return llama_cpp_module().Llama(
        model_path=str(path),
        n_ctx=2048,
        n_batch=BATCH,
        n_ubatch=BATCH,
        n_threads=1,
        n_threads_batch=2,
        logits_all=True,
        flash_attn=flash,
        verbose=False,
    )


def round_of(llama: Any, prompt: list[int], tokens: int) -> tuple[float, float]:
    """Prefill and decoding tokens/s of one run: `prompt` in one batch, then `tokens` greedy."""
    llama.reset()
    start = time.perf_counter()
    llama.eval(prompt)
    prefill = len(prompt) / (time.perf_counter() - start)
    start = time.perf_counter()
    for n, _ in enumerate(llama.generate([], temp=0.0, reset=False), 1):
        if n == tokens:
            break
    return prefill, tokens / (time.perf_counter() - start)


def batch_gap(llama: Any, prompt: list[int], tokens: int) -> float:
    """The largest |logit| difference between `tokens` greedy continuation tokens fed after a
    cached `prompt` as one batch (as a verify is) and fed one by one (0.0: the same to the bit)."""
    llama.reset()
    continuation = [t for _, t in zip(range(tokens), llama.generate(prompt, temp=0.0), strict=False)]
    llama.reset()
    llama.eval(prompt)
    llama.eval(continuation)
    batch = np.array(llama.scores[len(prompt) : len(prompt) + tokens])
    llama.reset()
    llama.eval(prompt)
    single = []
    for token in continuation:
        llama.eval([token])
        single.append(np.array(llama.scores[llama.n_tokens - 1]))
    return float(np.abs(batch - np.stack(single)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gguf", type=Path, default=None, help="the GGUF file (default: the default chat model)"
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens decoded a round")
    parser.add_argument("--output", type=Path, default=Path("bench-flash-attention.json"))
    args = parser.parse_args()
    path = args.gguf or default_model_path()
    contexts = {flash: open_context(path, flash) for flash in (False, True)}
    prompt = contexts[False].tokenize(PROMPT.encode())
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for number in range(args.rounds):
        for flash in (False, True) if number % 2 == 0 else (True, False):
            runs[flash].append(round_of(contexts[flash], prompt, args.tokens))
    report: dict[str, Any] = {"gguf": str(path), "prompt_tokens": len(prompt), "tokens": args.tokens}
    report["load_1min"] = os.getloadavg()[0]
    for index, what in enumerate(("prefill", "decode")):
        ratios = [
            with_[index] / without[index] for with_, without in zip(runs[True], runs[False], strict=True)
        ]
        median, interval = median_with_ci95(ratios)
        report[f"{what}_tokens_per_second"] = {str(f): [r[index] for r in runs[f]] for f in runs}
        report[f"{what}_ratio"] = {"median": median, "ci95": interval}
        print(f"{what}: with / without flash attention {median:.3f}× {interval}")
    report["batch_gap"] = {str(flash): batch_gap(llama, prompt, 8) for flash, llama in contexts.items()}
    print(f"largest |batch - one by one| logit gap: {report['batch_gap']}")
    args.output.write_text(json.dumps(report, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
