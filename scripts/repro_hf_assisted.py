"""Reproduce transformers' assisted generation stalling in a process that compiled before it.

What was seen (2026-11-26 and -27, one H200, torch 2.11.0+cu130, transformers 5.24.0): in
`fsd-chat bench`, hf-assisted (generate(assistant_model=draft), k 5, greedy) ran at 16 tok/s on a
79M/260K pair with 47–57 ms a forward pass, and sat in its 8-token warm-up for more than 95 s on a
1.5B/126M pair, where transformers' eager generate runs at 48 tok/s and assisted generation alone,
in a fresh process, ran at 108 tok/s on the 79M pair. In the bench, before it, the same process had
run fsd-chat's compiled decoders (`torch.compile(model.forward, mode="reduce-overhead",
fullgraph=True, dynamic=False)` on *another* instance of the same model class, with
`torch._dynamo.config.recompile_limit` raised from 8 to 64) and transformers' hf-static
(`generate(cache_implementation="static")`, which compiles the target's `__call__`) on the very
target that assisted generation then uses.

Each variant runs in a fresh process under a hard cap; a variant still running 5 s before its cap
dumps every thread's stack (faulthandler), so a stall shows where it sits. Per variant: the
warm-up's seconds (8 tokens), tok/s of a 64-token reply (`--max-new-tokens`), and torch._dynamo's
counters (graphs compiled, frames it intercepted) during assisted generation alone:

- `alone`: assisted generation in a fresh process;
- `after-static`: after hf-static's generate on the same target;
- `after-static-limit64`: the same with the recompile limit at 64, as fsd-chat sets it;
- `after-twin`: after a compiled forward of another instance of the target's class (as fsd-chat's
  decoders compile theirs), recompile limit 64: what `make gpu-check`'s hf-assisted process does
  now (the bench times fsd-chat's target-only decoding first, for its estimate);
- `after-twin-and-static`: the twin, then hf-static, as the bench of 2026-11-27 ran them.

Usage (only torch and transformers; no fsd-chat):
    python scripts/repro_hf_assisted.py TARGET DRAFT [--device cuda] [--dtype bfloat16] [--cap 120]
        [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

VARIANTS = ("alone", "after-static", "after-static-limit64", "after-twin", "after-twin-and-static")
PROMPT = [1, 403, 1683, 263, 931, 29892]  # "Once upon a time," in a Llama-style vocabulary


def child(
    target_dir: str, draft_dir: str, device: str, dtype: str, variant: str, cap: float, max_new_tokens: int
) -> dict[str, object]:
    """One variant in this process (see the module docstring)."""
    import faulthandler

    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    faulthandler.dump_traceback_later(max(cap - 5, 1), exit=False)
    kind = getattr(torch, dtype)

    def load(path: str) -> Any:  # a causal LM (`generate`); PreTrainedModel does not declare it
        return AutoModelForCausalLM.from_pretrained(path, dtype=kind).to(device).eval()

    target, draft = load(target_dir), load(draft_dir)
    vocab = target.config.vocab_size
    ids = torch.tensor([[t % vocab for t in PROMPT]], device=device)
    twin_first = variant.startswith("after-twin")
    if variant.endswith("limit64") or twin_first:
        torch._dynamo.config.recompile_limit = 64
    with torch.inference_mode():
        if twin_first:
            twin = load(target_dir)
            mode = "reduce-overhead" if device.startswith("cuda") else None
            compiled = torch.compile(twin.forward, mode=mode, fullgraph=True, dynamic=False)
            for width in (1, 2, 3, 5):  # a few verify widths, as fsd-chat's static caches compile
                compiled(input_ids=ids[:, :width], use_cache=False)
        if "static" in variant:
            target.generate(ids, max_new_tokens=64, do_sample=False, cache_implementation="static")
        draft.generation_config.num_assistant_tokens = 5
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
        start = time.perf_counter()
        target.generate(ids, assistant_model=draft, max_new_tokens=8, do_sample=False)
        warmup = time.perf_counter() - start
        start = time.perf_counter()
        out = target.generate(ids, assistant_model=draft, max_new_tokens=max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
    faulthandler.cancel_dump_traceback_later()
    tokens = out.shape[1] - ids.shape[1]
    return {
        "variant": variant,
        "warmup_s": round(warmup, 2),
        "tok_s": round(tokens / seconds, 1),
        "graphs_compiled_during_assisted": counters["stats"]["unique_graphs"] - graphs,
        # Frames torch._dynamo intercepted: 0 if assisted generation ran eagerly, as it should.
        "dynamo_frames_during_assisted": counters["frames"]["total"] - frames,
    }


def main(argv: list[str] | None = None) -> int:
    """Run every variant (or those given) in a process of its own; one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a variant may take")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens of the timed reply")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(
            args.target, args.draft, args.device, args.dtype, args.child, args.cap, args.max_new_tokens
        )
        print(json.dumps(result))
        return 0
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, args.target, args.draft, "--device", args.device]
        command += ["--dtype", args.dtype, "--cap", str(args.cap), "--child", variant]
        command += ["--max-new-tokens", str(args.max_new_tokens)]
        start = time.perf_counter()
        # A session of its own: past the cap the whole group goes, inductor's compile workers too.
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = process.communicate(timeout=args.cap)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            print(json.dumps({"variant": variant, "cut_after_s": args.cap}))
            print(stderr[-6000:], file=sys.stderr)  # the stacks faulthandler dumped before the cap
            continue
        if process.returncode:
            print(json.dumps({"variant": variant, "failed": stderr.strip().splitlines()[-1:]}))
            continue
        done_stdout = stdout
        result = json.loads(done_stdout.strip().splitlines()[-1])
        print(json.dumps({**result, "process_s": round(time.perf_counter() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
