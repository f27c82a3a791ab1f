"""Peak memory and first-prompt time of a GGUF file on the llama.cpp engine, beside llama.cpp alone,
the transformers engine and the runtime's own imports.

Each run is a fresh process under `/usr/bin/time -v` (its maximum resident set size; its wall
time: Python, imports, load and the reply, as a user waits for them; and its CPU time, user and
system, which a loaded machine inflates far less: a process on one thread waits this long on an
idle machine), greedy, one thread, the same chat prompt and `--tokens` tokens:

- `imports`: `import torch, transformers` (the runtime any fsd-chat process pays);
- `llama.cpp`: llama-cpp-python alone: `Llama(n_ctx=8192)` and `create_completion`;
- `fsd-chat llama.cpp`: `fsd-chat generate --engine llama.cpp` (prompt lookup, the default dial);
- `fsd-chat transformers`: `fsd-chat generate --engine transformers` (the float32 copy, converted on
  an earlier start);
- `first prompt, new file`: `fsd-chat generate --max-new-tokens 1` on a copy of the file under a new
  name, into an empty cache (no conversion; llama.cpp's own tokenizer, where a tree before it built
  one with transformers and cached it); `second start`: the same again. Their `first_token_s` and `first_token_cpu_s`: in such a
  process (`generate --json`, not under `time`), the wall seconds from its launch to the first
  token on its stdout, and its CPU seconds then: when the prompt is answered, before the process
  ends (its whole time above also holds its exit). Their `load_s`: in such a process, once
  fsd-chat and its libraries are imported, the seconds from `load_pair` to the first token of the
  reply (what a new file costs beyond Python's imports, which any start pays).

`--baseline DIR` runs another fsd-chat source tree (DIR holds its `fsd_chat` package and `themes`)
beside this one, interleaved (which runs first alternates by round): its fsd-chat llama.cpp runs and
starts are reported under the same names with " (baseline)", and each figure of this tree over the
baseline's, round by round (a before and after in one run, under one load).

The runs alternate over `--repeats` rounds (the machine's load drifts into all alike); each figure is
the median over rounds. The goals it checks (issue 46): fsd-chat on llama.cpp peaks at no more than
the imports' RSS + 1.3 × (the file + the KV cache); a new file answers its first prompt in 5 s.

    PYTHONPATH=. .venv/bin/python scripts/bench_llama_memory.py --output docs/bench-llama-cpp-memory.json
    mkdir /tmp/before && git archive a0d2dc5 fsd_chat themes | tar -x -C /tmp/before  # a baseline tree
    PYTHONPATH=. .venv/bin/python scripts/bench_llama_memory.py --baseline /tmp/before --output ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsd_chat.models.default_model import default_model_path
from fsd_chat.support.config import ENV_CACHE_DIR

PROMPT = (
    "Retell this story in two sentences: Lily found a red ball in the park and gave it to her friend Tom."
)
LLAMA_ALONE = """
import sys
from llama_cpp import Llama
llama = Llama(model_path=sys.argv[1], n_ctx=8192, n_threads=1, n_threads_batch=1, verbose=False)
messages = [{"role": "user", "content": sys.argv[2]}]
llama.create_chat_completion(messages, max_tokens=int(sys.argv[3]), temperature=0.0)
"""
FIRST_TOKEN = """
import sys, time
from fsd_chat.decoding import Controls
from fsd_chat.models.chat_template import Message, prompt_ids
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
start, cpu = time.perf_counter(), time.process_time()
pair = load_pair(ModelSpec(sys.argv[1]), ModelSpec("lookup"), LoadOptions(engine="llama.cpp", threads=1), lambda _: None)
ids = prompt_ids(pair.tokenizer, [Message("user", sys.argv[2])])
next(iter(pair.speculative(Controls()).generate(ids, max_new_tokens=1)))
print(time.perf_counter() - start, time.process_time() - cpu)
"""
FIRST_PROMPT_GOAL_S = 5.0
"""Issue 46: a new GGUF file answers its first prompt in 5 s on this machine."""
KV_BYTES = """
import sys
import llama_cpp
from llama_cpp import Llama
llama = Llama(model_path=sys.argv[1], n_ctx=8192, n_threads=1, verbose=False)
model = llama.model
layers, embd = llama_cpp.llama_model_n_layer(model), llama_cpp.llama_model_n_embd(model)
heads, kv_heads = llama_cpp.llama_model_n_head(model), llama_cpp.llama_model_n_head_kv(model)
print(layers * 8192 * 2 * kv_heads * (embd // heads) * 2)  # keys and values, float16
"""


def timed(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """{"rss_mb": peak resident set, "wall_s": wall time, "cpu_s": user + system CPU time} of one
    process. On a loaded machine the wall time grows with the load; the CPU time of a process that
    runs on one thread (one llama.cpp thread, torch on one) barely does, and is what its wall time
    would be on an idle machine."""
    done = subprocess.run(
        ["/usr/bin/time", "-v", *command], capture_output=True, text=True, env=env, check=True
    )
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)[1])  # type: ignore[index]
    wall = re.search(
        r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", done.stderr
    )
    assert wall is not None
    seconds = int(wall[1] or 0) * 3600 + int(wall[2]) * 60 + float(wall[3])
    user, system = (
        float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", done.stderr)[1])  # type: ignore[index]
        for kind in ("User", "System")
    )
    return {"rss_mb": rss / 1024, "wall_s": seconds, "cpu_s": user + system}


def first_token(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """{"first_token_s": wall seconds from the launch of `command` (a `generate --json`) to its first
    line on stdout (the reply's first step), "first_token_cpu_s": the process's CPU seconds, user and
    system, at that moment (/proc/PID/stat)}.

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env) as process:
        assert process.stdout is not None
        process.stdout.readline()
        wall = time.perf_counter() - start
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        process.stdout.read()
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return {"first_token_s": wall, "first_token_cpu_s": cpu}


def against_baseline(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """For each run with a " (baseline)" twin: this tree's figure over the baseline's, round by round
    (the two ran back to back, under the same load), as {"median", "min", "max"} over the rounds, for
    the peak RSS and the CPU seconds (and the CPU seconds to the first token, and from `load_pair`
    on, where measured)."""
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for name, rounds in runs.items():
        before = runs.get(f"{name} (baseline)")
        if before is None:
            continue
        ratios[name] = {}
        for metric in ("rss_mb", "cpu_s", "first_token_cpu_s", "load_cpu_s"):
            if metric in rounds[0]:
                each = [a[metric] / b[metric] for a, b in zip(rounds, before, strict=True)]
                ratios[name][metric] = {"median": statistics.median(each), "min": min(each), "max": max(each)}
    return ratios


def first_starts(
    gguf: Path, folder: Path, suffix: str, env: dict[str, str], runs: dict[str, list[dict[str, float]]]
) -> None:
    """A file fsd-chat has never seen (a copy under a new name, into an empty cache): its first
    prompt and the start after it, timed whole, then again on another copy from `load_pair` on
    (imports done), and on a third from launch to the first token (`first_token`), appended to `runs` under their names + `suffix`, run in `env`."""
    python = sys.executable
    folder.mkdir()
    first = [python, "-m", "fsd_chat", "generate", "--threads", "1", "--max-new-tokens", "1"]
    copy = shutil.copy(gguf, folder / "new.gguf")
    cache = {**env, ENV_CACHE_DIR: str(folder / "cache")}
    for name in ("first prompt, new file", "second start"):
        runs.setdefault(name + suffix, []).append(timed([*first, "--target", str(copy), PROMPT], cache))
    copy = shutil.copy(gguf, folder / "newer.gguf")
    cache = {**env, ENV_CACHE_DIR: str(folder / "cache-load")}
    for name in ("first prompt, new file", "second start"):
        done = subprocess.run(
            [python, "-c", FIRST_TOKEN, str(copy), PROMPT],
            capture_output=True,
            text=True,
            env=cache,
            check=True,
        )
        wall_s, cpu_s = map(float, done.stdout.strip().splitlines()[-1].split())
        runs[name + suffix][-1] |= {"load_s": wall_s, "load_cpu_s": cpu_s}
    copy = shutil.copy(gguf, folder / "newest.gguf")
    cache = {**env, ENV_CACHE_DIR: str(folder / "cache-first-token")}
    for name in ("first prompt, new file", "second start"):
        runs[name + suffix][-1] |= first_token([*first, "--json", "--target", str(copy), PROMPT], cache)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default chat model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another fsd-chat source tree to run beside this one"
    )
    args = parser.parse_args()
    gguf = args.gguf or default_model_path()
    python = sys.executable
    fsd = [python, "-m", "fsd_chat", "generate", "--threads", "1", "--max-new-tokens", str(args.tokens)]
    # Safe paths: `python -m` and `-c` would put the working directory first on sys.path, ahead
    # of PYTHONPATH, and a run from a checkout would import that checkout's fsd_chat, the
    # baseline's runs included. Each tree is named by its absolute path.
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs: dict[str, list[dict[str, float]]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="llama-memory-"))
    trees = {"": env}  # suffix of the names -> the environment that runs that tree's fsd_chat
    if args.baseline is not None:
        trees[" (baseline)"] = {**env, "PYTHONPATH": str(args.baseline.resolve())}
    try:
        for repeat in range(args.repeats):
            commands = {
                "imports": [python, "-c", "import torch, transformers"],
                "llama.cpp": [python, "-c", LLAMA_ALONE, str(gguf), PROMPT, str(args.tokens)],
            }
            for name, command in commands.items():
                runs.setdefault(name, []).append(timed(command, env))
            # The trees in turn, in the other order every other round: the second of two processes
            # run back to back can find the machine warmer.
            order = list(trees.items())[:: -1 if repeat % 2 else 1]
            for suffix, tree in order:
                run = [*fsd, "--target", str(gguf), "--engine", "llama.cpp", PROMPT]
                runs.setdefault(f"fsd-chat llama.cpp{suffix}", []).append(timed(run, tree))
            transformers_engine = [*fsd, "--target", str(gguf), "--engine", "transformers", PROMPT]
            runs.setdefault("fsd-chat transformers", []).append(timed(transformers_engine, env))
            for suffix, tree in order:
                first_starts(gguf, scratch / f"round{repeat}{suffix.strip(' ()')}", suffix, tree, runs)
            print(
                f"round {repeat + 1}: "
                + ", ".join(
                    f"{n} {r[-1]['rss_mb']:.0f} MB {r[-1]['wall_s']:.1f} s ({r[-1]['cpu_s']:.1f} s CPU)"
                    for n, r in runs.items()
                ),
                flush=True,
            )
        kv = int(
            subprocess.run(
                [python, "-c", KV_BYTES, str(gguf)], capture_output=True, text=True, check=True
            ).stdout
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    medians = {
        name: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for name, rounds in runs.items()
    }
    file_mb, kv_mb = gguf.stat().st_size / 2**20, kv / 2**20
    bound = medians["imports"]["rss_mb"] + 1.3 * (file_mb + kv_mb)
    report = {
        "gguf": gguf.name,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "machine": "2-core CPU shared with other processes; medians over rounds, runs interleaved",
        "file_mb": file_mb,
        "kv_cache_mb": kv_mb,
        "goal_rss_mb": bound,
        "goal_first_prompt_s": FIRST_PROMPT_GOAL_S,
        "medians": medians,
        "against_baseline": against_baseline(runs),
        "runs": runs,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for name, figures in medians.items():
        load = (
            f", first token {figures['first_token_s']:.1f} s ({figures['first_token_cpu_s']:.1f} s CPU),"
            f" load to first token {figures['load_s']:.1f} s ({figures['load_cpu_s']:.1f} s CPU)"
            if "load_s" in figures
            else ""
        )
        print(
            f"{name:24} {figures['rss_mb']:7.0f} MB {figures['wall_s']:6.1f} s ({figures['cpu_s']:.1f} s CPU){load}"
        )
    for name, metrics in report["against_baseline"].items():
        print(
            f"{name}: "
            + ", ".join(
                f"{m} ×{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]" for m, r in metrics.items()
            )
        )
    first = medians["first prompt, new file"]
    print(
        f"goal: a new file's first prompt ≤ {FIRST_PROMPT_GOAL_S:.0f} s: first token {first['first_token_s']:.1f} s "
        f"wall, {first['first_token_cpu_s']:.1f} s CPU from launch; whole process {first['wall_s']:.1f} s wall, "
        f"{first['cpu_s']:.1f} s CPU"
    )
    print(
        f"goal: fsd-chat llama.cpp ≤ {bound:.0f} MB (imports + 1.3 × (file {file_mb:.0f} MB + KV {kv_mb:.0f} MB))"
    )


if __name__ == "__main__":
    main()
