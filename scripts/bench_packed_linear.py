"""Linear layers prepacked for oneDNN against torch's default (MKL) linear, on the default chat
model: the forward's seconds by width, and tokens/s of the target alone and of the default chat
(prompt lookup, `goodput`, greedy, the default T) from the decoders the chat runs.

The model is loaded twice, once as the chat loads it (`LoadOptions.prepack`, the default) and once
unpacked. Each prompt is decoded by all four decoders in turn, the order rotated per prompt, so the
ratios are paired per prompt; each median comes with its distribution-free 95% interval.

    PYTHONPATH=. .venv/bin/python scripts/bench_packed_linear.py --output docs/bench-packed-linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.stats import median_ci95
from fsd_chat.decoding import Controls, DecodingSettings, GenerationStats, SamplingConfig
from fsd_chat.decoding.protocol import Decoder
from fsd_chat.engines.torch_engine.packed_linear import PackedLinear
from fsd_chat.engines.torch_engine.timings import time_forwards
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair

WIDTHS = (1, 2, 3, 4, 6)


def forward_ms(pair: ModelPair) -> dict[int, float]:
    """The target's forward over each of WIDTHS tokens after MEASURE_CONTEXT, best of
    MEASURE_REPEATS (`time_forwards`), in ms."""
    timings = time_forwards(pair.target, None, pair.vocab_size)
    return {w: v * 1e3 for w, v in zip(timings.widths, timings.verify, strict=True) if w in WIDTHS}


def greedy_reply(decoder: Decoder, ids: list[int], max_new_tokens: int) -> tuple[float, list[int]]:
    """(tokens/s, token ids) of a greedy reply to `ids`."""
    stats, tokens = GenerationStats(), []
    for step in decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=SamplingConfig()):
        stats.add(step)
        tokens.extend(step.tokens)
    return stats.tokens_per_second, tokens


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--preset", default="mt-bench")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, lookup = ModelSpec(str(default_model_path())), ModelSpec("lookup")
    pairs = {
        packed: load_pair(target, lookup, LoadOptions(device="cpu", dtype="float32", prepack=packed))
        for packed in (True, False)
    }
    layers = sum(isinstance(m, PackedLinear) for m in pairs[True].target.modules())
    widths = {name: forward_ms(pairs[packed]) for name, packed in (("packed", True), ("mkl", False))}
    print(f"{layers} linear layers packed; forward ms by width: {widths}", flush=True)
    decoders: dict[str, Decoder] = {}
    for name, packed in (("packed", True), ("mkl", False)):
        pair = pairs[packed]
        decoders[f"alone-{name}"] = pair.autoregressive(Controls(DecodingSettings()))
        decoders[f"chat-{name}"] = pair.speculative(Controls(DecodingSettings(draft_policy="goodput")))
    items = load_prompt_set(args.preset, data_dir=args.data_dir, limit=args.prompts).items
    names = list(decoders)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    texts_equal = 0
    for index, item in enumerate(items):
        ids = prompt_ids(pairs[True].tokenizer, [Message("user", item.text)])
        texts: dict[str, list[int]] = {}
        for name in names[index % len(names) :] + names[: index % len(names)]:
            speed, texts[name] = greedy_reply(decoders[name], ids, args.max_new_tokens)
            speeds[name].append(speed)
        texts_equal += texts["alone-packed"] == texts["alone-mkl"]
        print(json.dumps({name: round(speeds[name][-1], 2) for name in names}), flush=True)

    def ratio(a: str, b: str) -> dict[str, object]:
        values = [x / y for x, y in zip(speeds[a], speeds[b], strict=True)]
        return {"median": statistics.median(values), "ci95": median_ci95(values)}

    report = {
        "model": "default (SmolLM2-135M-Instruct, float32)",
        "preset": args.preset,
        "prompts": len(items),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "packed_layers": layers,
        "forward_ms": widths,
        "tokens_per_second_median": {name: statistics.median(v) for name, v in speeds.items()},
        "target_alone_packed_over_mkl": ratio("alone-packed", "alone-mkl"),
        "chat_packed_over_mkl": ratio("chat-packed", "chat-mkl"),
        "chat_packed_over_target_alone_packed": ratio("chat-packed", "alone-packed"),
        "chat_mkl_over_target_alone_mkl": ratio("chat-mkl", "alone-mkl"),
        "target_alone_same_text": f"{texts_equal}/{len(items)}",
        "speeds": speeds,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "speeds"}, indent=1))
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
