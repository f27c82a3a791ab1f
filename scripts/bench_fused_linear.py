"""q, k, v and gate, up fused into one GEMM each (`fused_linear`, what the loader does) against the
separate projections, on the default chat model in float32 on the CPU (both prepacked for oneDNN,
as the chat loads them): the target's forward by width, and tokens/s of the target alone from the
decoder the chat runs, with the greedy texts compared.

The unfused model is the same checkpoint loaded by transformers and packed as the loader packs.
Each prompt is decoded by both in turn, the order alternating, so the ratios are paired per prompt;
the median comes with its distribution-free 95% interval.

    PYTHONPATH=. .venv/bin/python scripts/bench_fused_linear.py --output docs/bench-fused-linear.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from fsd_chat.bench.prompts import load_prompt_set
from fsd_chat.bench.stats import median_ci95
from fsd_chat.decoding import Controls, DecodingSettings
from fsd_chat.engines.torch_engine.packed_linear import pack_linear_layers
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.default_model import default_model_path
from fsd_chat.models.gguf_files import local_model
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from scripts.bench_packed_linear import forward_ms, greedy_reply


def main() -> None:
    """Measure, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8, help="MT-Bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = str(default_model_path())
    fused = load_pair(ModelSpec(source), ModelSpec("lookup"), LoadOptions(device="cpu", dtype="float32"))
    plain_model = AutoModelForCausalLM.from_pretrained(local_model(source, None), dtype=torch.float32).eval()
    pack_linear_layers(plain_model)
    pairs = {"fused": fused, "separate": dataclasses.replace(fused, target=plain_model)}
    widths = {name: forward_ms(pair) for name, pair in pairs.items()}
    print(f"forward ms by width: {widths}", flush=True)
    decoders = {name: pair.autoregressive(Controls(DecodingSettings())) for name, pair in pairs.items()}
    items = load_prompt_set("mt-bench", data_dir=args.data_dir, limit=args.prompts).items
    names = list(decoders)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    same = 0
    for index, item in enumerate(items):
        ids = prompt_ids(fused.tokenizer, [Message("user", item.text)])
        texts: dict[str, list[int]] = {}
        for name in names[index % 2 :] + names[: index % 2]:
            speed, texts[name] = greedy_reply(decoders[name], ids, args.max_new_tokens)
            speeds[name].append(speed)
        same += texts["fused"] == texts["separate"]
        print(json.dumps({name: round(speeds[name][-1], 2) for name in names}), flush=True)
    ratios = [x / y for x, y in zip(speeds["fused"], speeds["separate"], strict=True)]
    report = {
        "model": "default (SmolLM2-135M-Instruct, float32, prepacked)",
        "preset": "mt-bench",
        "prompts": len(items),
        "max_new_tokens": args.max_new_tokens,
        "threads": 1,
        "forward_ms": widths,
        "tokens_per_second_median": {name: statistics.median(v) for name, v in speeds.items()},
        "target_alone_fused_over_separate": {
            "median": statistics.median(ratios),
            "ci95": median_ci95(ratios),
        },
        "same_greedy_text": f"{same}/{len(items)}",
        "speeds": speeds,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "speeds"}, indent=1))
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
