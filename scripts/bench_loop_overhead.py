"""The decoding loop's own work per token on the llama.cpp engine, outside `llama_decode`, beside
llama.cpp's own token loop: the wrapper overhead of issue 46 (goal: ≤ 5% of a token).

Each reply is decoded once per configuration, the configurations of a prompt in turn; every
`llama_decode` (fsd-chat's engine's and llama-cpp-python's alike) is wrapped to add up the process
CPU time spent inside it. What a reply spends outside, divided by its tokens, is the loop's per-token
work: the logits' laws, the rule, sampling, the draft policy, prompt lookup, detokenisation, the
step events, the batch's filling; for llama.cpp, its sampler chain and its copy of each row of
logits. CPU time rather than wall time, on one thread: a loaded machine slows it far less (it is
what the loop takes on an idle one). A reply's prompt is read anew (the caches emptied), so its
prefill is in the `llama_decode` time, and its set-up (a few calls a reply) in the loop's.

Configurations (one thread, the default model unless `--model`):

- `llama.cpp`: `Llama.generate` (the bench's `llama.cpp` baseline, `llama_generate`);
- `target`: fsd-chat's target-only decoding on its llama.cpp engine;
- `chat`: the default chat: prompt lookup, fuzzy, T 1 regret greedy (the default dial), k 5,
  goodput; sampled: the sampled default T (`DEFAULT_THRESHOLD`, js);
- `exact`: the same at T = 0.

`--sampled` adds each configuration at temperature 0.7, top-p 0.9 (a fixed seed a prompt).

`--trees A B ...` runs the measurement under each source tree in turn, a fresh process a tree and a
round (`--rounds`), so that two versions of the loop are compared side by side in one run; without
it, the tree this script is in, in this process. `--profile FILE` writes a cProfile of the
configurations (one round, in this process) instead.

    PYTHONPATH=. .venv/bin/python scripts/bench_loop_overhead.py --limit 5 --output /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class DecodeClock:
    """Process CPU seconds and calls inside `llama_decode`, wrapped in both llama_cpp modules (the
    package's re-export, which fsd-chat's engine calls, and `llama_cpp.llama_cpp`, which
    llama-cpp-python's own `Llama` calls); those of one-token calls (the decoding steps, the prefill
    left out) apart too, so that llama.cpp's own work a token is compared between the two loops."""

    def __init__(self) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as bindings

        self.seconds = 0.0
        self.calls = 0
        self.step_seconds = 0.0
        self.step_calls = 0
        original = bindings.llama_decode

        def timed(ctx: Any, batch: Any) -> int:
            began = time.process_time()
            code = original(ctx, batch)
            spent = time.process_time() - began
            self.seconds += spent
            self.calls += 1
            if batch.n_tokens == 1:
                self.step_seconds += spent
                self.step_calls += 1
            return int(code)

        llama_cpp.llama_decode = bindings.llama_decode = timed


def configurations(sampled: bool) -> list[tuple[str, bool]]:
    """(name, sampled) of each configuration, in the order a prompt runs them."""
    names = ["llama.cpp", "target", "chat", "exact"]
    return [(name, False) for name in names] + ([(name, True) for name in names] if sampled else [])


def measure(args: argparse.Namespace, profile: cProfile.Profile | None) -> dict[str, list[dict[str, float]]]:
    """One round over the prompts in this process: per configuration, a record a reply."""

    from fsd_chat.bench.llama_baselines import baseline_llama, llama_generate
    from fsd_chat.bench.prompts import load_prompt_set
    from fsd_chat.bench.records import ForwardTally
    from fsd_chat.decoding import Controls, DecodingSettings, SamplingConfig
    from fsd_chat.decoding.reply import eos_token_ids
    from fsd_chat.decoding.settings import DEFAULT_GREEDY_THRESHOLD, DEFAULT_THRESHOLD
    from fsd_chat.engines.llama_cpp import LlamaCppModel
    from fsd_chat.models.chat_template import Message, prompt_ids
    from fsd_chat.models.default_model import default_model_path
    from fsd_chat.models.loading import load_pair
    from fsd_chat.models.options import LoadOptions, ModelSpec

    model = args.model or str(default_model_path())
    pair = load_pair(ModelSpec(model), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1))
    pair.use_threads(1)
    target = pair.target
    assert isinstance(target, LlamaCppModel)
    llama = baseline_llama(target, None)
    eos = eos_token_ids(pair.tokenizer, target)
    clock = DecodeClock()
    items = load_prompt_set(args.prompts, data_dir=args.data_dir, limit=args.limit).items
    prompts = [prompt_ids(pair.tokenizer, [Message("user", item.text)]) for item in items]

    def tokens_of(name: str, sampling: SamplingConfig, prompt: list[int]) -> Iterator[int]:
        if name == "llama.cpp":
            llama.reset()
            yield from llama_generate(
                llama,
                prompt,
                sampling,
                max_new_tokens=args.max_new_tokens,
                eos=eos,
                stop_strings=(),
                tally=ForwardTally(),
                stop=lambda: False,
            )
            return
        target.reset()
        decoder = decoders[name, not sampling.greedy]
        for step in decoder.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling):
            yield from (token.id for token in step.tokens)

    # One decoder a configuration, built before any clock starts and kept from reply to reply (as
    # the chat keeps its own: the goodput policy's measurements carry over).
    decoders = {}
    for name, sampled in configurations(True):
        if name != "llama.cpp":
            threshold = 0.0 if name == "exact" else DEFAULT_THRESHOLD if sampled else DEFAULT_GREEDY_THRESHOLD
            settings = DecodingSettings(threshold=threshold, draft_policy="goodput")
            decoders[name, sampled] = pair.decoder(Controls(settings), autoregressive=name == "target")

    runs: dict[str, list[dict[str, float]]] = {}
    warm = SamplingConfig()
    for name, _ in configurations(False):  # each path's first call (torch's kernels) unmeasured
        sum(1 for _ in tokens_of(name, warm, prompts[0][:16]))
    for index, prompt in enumerate(prompts):
        for name, sampled in configurations(args.sampled):
            sampling = SamplingConfig(temperature=0.7, top_p=0.9, seed=index) if sampled else SamplingConfig()
            decode_seconds, decode_calls = clock.seconds, clock.calls
            step_seconds, step_calls = clock.step_seconds, clock.step_calls
            wall, cpu = time.perf_counter(), time.process_time()
            if profile is not None:
                profile.enable()
            count = sum(1 for _ in tokens_of(name, sampling, prompt))
            if profile is not None:
                profile.disable()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            inside = clock.seconds - decode_seconds
            runs.setdefault(f"{name}{' sampled' if sampled else ''}", []).append(
                {
                    "tokens": count,
                    "prompt_tokens": len(prompt),
                    "cpu_s": cpu,
                    "decode_cpu_s": inside,
                    "decode_calls": clock.calls - decode_calls,
                    "step_decode_cpu_s": clock.step_seconds - step_seconds,
                    "step_decode_calls": clock.step_calls - step_calls,
                    "outside_ms_per_token": 1e3 * (cpu - inside) / count,
                    "wall_s": wall,
                }
            )
    llama.close()
    return runs


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """A configuration's replies summed: the loop's CPU outside `llama_decode` a token (over all
    its tokens), the decode CPU a token, that of a one-token `llama_decode` (a step's, the prefill
    left out), and the median and range of the per-reply figure."""
    tokens = sum(r["tokens"] for r in runs)
    outside = sum(r["cpu_s"] - r["decode_cpu_s"] for r in runs)
    per_reply = [r["outside_ms_per_token"] for r in runs]
    return {
        "replies": len(runs),
        "tokens": tokens,
        "outside_ms_per_token": 1e3 * outside / tokens,
        "decode_cpu_ms_per_token": 1e3 * sum(r["decode_cpu_s"] for r in runs) / tokens,
        "step_decode_cpu_ms": 1e3
        * sum(r["step_decode_cpu_s"] for r in runs)
        / max(sum(r["step_decode_calls"] for r in runs), 1),
        "outside_share": outside / sum(r["cpu_s"] for r in runs),
        "reply_median_ms": statistics.median(per_reply),
        "reply_min_ms": min(per_reply),
        "reply_max_ms": max(per_reply),
    }


def worker_argv(args: argparse.Namespace) -> list[str]:
    """This script's arguments for a worker process (one round, JSON on stdout)."""
    argv = [
        __file__,
        "--worker",
        f"--prompts={args.prompts}",
        f"--data-dir={args.data_dir.resolve()}",
        f"--limit={args.limit}",
        f"--max-new-tokens={args.max_new_tokens}",
    ]
    return argv + (["--sampled"] if args.sampled else []) + ([f"--model={args.model}"] if args.model else [])


def run_trees(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """`--rounds` rounds, each a fresh process per tree, the trees in turn."""
    rounds: dict[str, dict[str, list[dict[str, float]]]] = {str(tree): {} for tree in args.trees}
    for number in range(args.rounds):
        for tree in args.trees:
            env = os.environ | {"PYTHONPATH": str(tree.resolve())}
            measured = json.loads(
                subprocess.run(
                    [sys.executable, *worker_argv(args)], env=env, check=True, capture_output=True, text=True
                ).stdout
            )
            for name, runs in measured.items():
                rounds[str(tree)].setdefault(name, []).extend(runs)
            log(
                f"round {number + 1} {tree}: "
                + ", ".join(
                    f"{name} {summary(runs)['outside_ms_per_token']:.2f}" for name, runs in measured.items()
                )
            )
    return {
        tree: {name: {"summary": summary(runs), "replies": runs} for name, runs in by_name.items()}
        for tree, by_name in rounds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="tinystories-retell")
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", help="a GGUF file (default: the default chat model)")
    parser.add_argument("--sampled", action="store_true", help="each configuration sampled too")
    parser.add_argument("--trees", type=Path, nargs="+", help="source trees to compare, in turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="write a cProfile of one round here")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args, None)))
        return
    meta = {"argv": sys.argv[1:], "load_average": os.getloadavg()}
    if args.profile:
        profile = cProfile.Profile()
        runs = measure(args, profile)
        profile.dump_stats(args.profile)
        report: dict[str, Any] = {name: summary(r) for name, r in runs.items()}
    elif args.trees:
        report = run_trees(args, lambda line: print(line, file=sys.stderr, flush=True))
    else:
        report = {name: {"summary": summary(r), "replies": r} for name, r in measure(args, None).items()}
    meta["load_average_after"] = os.getloadavg()
    text = json.dumps(meta | {"results": report}, indent=1)
    if args.output:
        args.output.write_text(text)
    print(text if not args.output else json.dumps(meta), flush=True)


if __name__ == "__main__":
    main()
