"""`fsd-chat generate` end to end: JSON Lines output, plain output, one-line errors (exit 2), and a
reply ended by a signal."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsd_chat.cli import main
from fsd_chat.decoding.settings import DEFAULT_GREEDY_THRESHOLD, DEFAULT_THRESHOLD
from tests.test_bench_cli import CLI

CHECKOUT = Path(__file__).resolve().parents[1]
"""The repository root: a subprocess imports fsd_chat from here, the code under test."""


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def pair_args(target_dir: Path, draft_dir: Path) -> list[str]:
    return ["--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu"]


def test_json_lines(target_dir: Path, draft_dir: Path, pair, capsys) -> None:
    args = [
        "generate",
        *pair_args(target_dir, draft_dir),
        "--json",
        "--max-new-tokens",
        "40",
        "-T",
        "0",
        "Once upon a time",
    ]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    steps, final = records[:-1], records[-1]
    assert all({"tokens", "stats", "stop_reason"} <= set(r) for r in steps)
    assert final["token_ids"] == [t["id"] for r in steps for t in r["tokens"]]
    assert final["text"] == pair.tokenizer.decode(final["token_ids"], skip_special_tokens=True)
    assert final["prompt_ids"] == pair.tokenizer("Once upon a time").input_ids
    stats = final["stats"]
    for key in (
        "tokens_per_second",
        "acceptance_rate",
        "mean_accepted_length",
        "drafted",
        "accepted_exact",
        "accepted_fuzzy",
        "target_forwards",
    ):
        assert key in stats
    # The first token comes after the prefill and the first step.
    first_step = steps[0]["stats"]
    assert stats["first_token_seconds"] == pytest.approx(
        stats["prefill_seconds"]
        + first_step["draft_seconds"]
        + first_step["target_seconds"]
        + first_step["other_seconds"]
    )
    assert len(final["token_ids"]) == 40
    assert stats["target_forwards"] == len(steps)
    assert stats["mean_accepted_length"] == pytest.approx(40 / len(steps))
    origins = {t["origin"] for r in steps for t in r["tokens"]}
    assert origins <= {"draft-exact", "target-resampled", "target-bonus", "target"}


def test_draft_policy_option(target_dir: Path, draft_dir: Path, capsys) -> None:
    args = [
        *pair_args(target_dir, draft_dir),
        "--json",
        "--max-new-tokens",
        "30",
        "-T",
        "0",
        "Once upon a time",
    ]
    finals = {}
    for policy in ("fixed", "latency"):
        code, out, _ = run_cli(["generate", *args, "--draft-policy", policy, "-k", "6"], capsys)
        assert code == 0
        records = [json.loads(line) for line in out.splitlines()]
        finals[policy] = records[-1]
        assert records[-1]["settings"]["draft_policy"] == policy
        drafted = {r["stats"]["drafted"] for r in records[:-1]}
        assert max(drafted) <= 6
    # The policy changes only how much is drafted, never the greedy tokens.
    assert finals["fixed"]["token_ids"] == finals["latency"]["token_ids"]
    code, _, err = run_cli(["generate", *args, "--draft-policy", "sometimes"], capsys)
    assert code == 2 and "sometimes" in err


def test_autoregressive_flag_and_plain_output(target_dir: Path, draft_dir: Path, capsys) -> None:
    args = [
        "generate",
        *pair_args(target_dir, draft_dir),
        "--autoregressive",
        "--max-new-tokens",
        "20",
        "Once upon a time",
    ]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    assert out.startswith(", there was a little")  # the target's greedy continuation
    # --json names no draft: target-only decoding speculates nothing.
    code, out, _ = run_cli([*args[:-1], "--json", args[-1]], capsys)
    summary = json.loads(out.splitlines()[-1])
    assert code == 0 and summary["draft"] is None
    assert summary["stats"]["drafted"] == 0 and summary["text"].startswith(", there was a little")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--threshold", "-0.5"], "threshold must be a finite number ≥ 0"),
        (["--threshold", "nan"], "threshold must be a finite number ≥ 0"),
        (["--divergence", "hellinger"], "unknown divergence 'hellinger'; use kl, reverse-kl, js, tv"),
        (["--rule", "lossy"], "unknown rule 'lossy'; use exact, fuzzy, pure, mixture"),
        (["--dtype", "float64"], "unknown dtype 'float64'; use auto, float32, bfloat16, float16"),
        (["--draft-tokens", "0"], "draft length k"),
        (["--top-p", "1.5"], "top-p"),
        (["--min-p", "1.5"], "min-p"),
        (["--device", "cuda"], "no CUDA GPU"),
        (["--threads", "0"], "--threads must be ≥ 1, got 0"),
        (["--threads-batch", "0"], "--threads-batch must be ≥ 1, got 0"),
    ],
)
def test_bad_settings_exit_2_with_one_line(
    target_dir: Path, draft_dir: Path, capsys, extra: list[str], message: str
) -> None:
    code, out, err = run_cli(["generate", *pair_args(target_dir, draft_dir), *extra, "Once"], capsys)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and message in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_failed_quantization_exits_2_with_one_line(
    target_dir: Path, draft_dir: Path, capsys, failing_4bit_kernel: str
) -> None:
    args = ["generate", *pair_args(target_dir, draft_dir), "--quantize-target", "4bit", "Once"]
    code, out, err = run_cli(args, capsys)
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [err.strip()] and f"4bit quantization of {target_dir} failed" in err
    assert failing_4bit_kernel in err


def test_bad_models_and_prompts_exit_2(
    target_dir: Path,
    draft_dir: Path,
    mismatched_draft_dir: Path,
    encoder_only_dir: Path,
    tmp_path: Path,
    capsys,
) -> None:
    cases = [
        (["--target", str(tmp_path / "missing"), "--draft", str(draft_dir), "x"], "model path not found"),
        (["--target", str(target_dir), "--draft", str(mismatched_draft_dir), "x"], "tokenizers differ"),
        (["--target", str(encoder_only_dir), "--draft", str(draft_dir), "x"], "not a causal language model"),
        (
            ["--target", str(target_dir), "--draft", str(draft_dir), "word " * 600],
            "context window is 512 tokens",
        ),
    ]
    for args, message in cases:
        code, _, err = run_cli(["generate", "--device", "cpu", *args], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_missing_bitsandbytes_is_one_line(target_dir: Path, draft_dir: Path, tmp_path: Path) -> None:
    # A broken bitsandbytes install (its import fails), in a real subprocess of the console script.
    shadow = tmp_path / "shadow" / "bitsandbytes"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('bitsandbytes is broken here')\n")
    # The checkout first, so that the subprocess runs the code under test and not an installed
    # fsd_chat; then the shadow, then whatever PYTHONPATH held (kept, not replaced).
    paths = [str(CHECKOUT), str(shadow.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    args = [
        sys.executable,
        "-m",
        "fsd_chat",
        "generate",
        *pair_args(target_dir, draft_dir),
        "--quantize-draft",
        "8bit",
        "x",
    ]
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "8bit quantization" in lines[0], result.stderr


def test_sampling_defaults_come_from_the_generation_config(
    target_dir: Path, draft_dir: Path, tmp_path: Path, capsys
) -> None:
    # A chat model's folder: its generation_config asks for sampling with top-p 0.9 and a
    # repetition penalty, which fsd-chat names as not applied.
    target = tmp_path / "chat-target"
    shutil.copytree(target_dir, target)
    config = json.loads((target / "generation_config.json").read_text())
    config |= {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05}
    (target / "generation_config.json").write_text(json.dumps(config))

    def sampling(*flags: str) -> dict[str, object]:
        args = ["generate", *pair_args(target, draft_dir), "--json", "--max-new-tokens", "8", *flags, "Once"]
        code, out, _ = run_cli(args, capsys)
        assert code == 0
        return json.loads(out.splitlines()[-1])

    own = sampling("--seed", "1")
    assert own["sampling"] == {"temperature": 0.6, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "seed": 1}
    assert own["sampling_source"] == "chat-target's generation_config: temperature 0.6, top-p 0.9"
    assert own["not_applied"] == ["repetition_penalty 1.05"]
    given = sampling("--top-p", "1", "--min-p", "0.1")
    assert given["sampling"] | {"seed": None} == {
        "temperature": 0.6,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.1,
        "seed": None,
    }
    assert given["sampling_source"].endswith("given: top-p 1, min-p 0.1")
    assert sampling("--temperature", "0")["sampling"]["temperature"] == 0.0  # greedy
    # The offline target's own config asks for nothing: greedy, the built-in default.
    plain = json.loads(
        run_cli(
            ["generate", *pair_args(target_dir, draft_dir), "--json", "--max-new-tokens", "4", "Once"], capsys
        )[1].splitlines()[-1]
    )
    assert plain["sampling"]["temperature"] == 0.0 and plain["sampling_source"] == "built-in default"


@pytest.mark.slow  # four processes, each loading the models
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "plain"])
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_reply_with_its_summary(
    target_dir: Path, as_json: bool, signum: int, status: int
) -> None:
    """Ctrl-C or SIGTERM, sent once the reply has begun, ends it where it is: with --json the
    summary object follows the steps, with stop reason "interrupted"; plain, the line is ended and
    stderr says so with the count. Exit 128 + the signal's number."""
    args = ["generate", "--target", str(target_dir), "--device", "cpu", "--max-new-tokens", "400"]
    process = subprocess.Popen(
        [sys.executable, "-c", CLI, *args, *(["--json"] if as_json else []), "Once upon a time"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        first = os.read(process.stdout.fileno(), 1)  # the reply has begun
        assert first, "generate wrote nothing"
        process.send_signal(signum)
        rest, err = process.communicate(timeout=120)
    finally:
        process.kill()
    out, errors = (first + rest).decode("utf-8"), err.decode("utf-8")
    assert process.returncode == status, errors
    if as_json:
        *steps, summary = [json.loads(line) for line in out.splitlines()]
        assert summary["stop_reason"] == "interrupted"
        assert all(step["stop_reason"] is None for step in steps)  # no step ended it
        assert summary["token_ids"] == [t["id"] for step in steps for t in step["tokens"]]
        assert 0 < summary["stats"]["tokens"] == len(summary["token_ids"]) < 400
    else:
        assert out.endswith("\n") and out.strip()
        match = re.search(r"fsd-chat: interrupted after (\d+) tokens? \([\d.]+ tok/s\)\n", errors)
        assert match is not None and 0 < int(match.group(1)) < 400, errors


@pytest.mark.parametrize(
    ("flags", "threshold"),
    [
        ([], DEFAULT_GREEDY_THRESHOLD),  # greedy (the story pair's own sampling): the regret default
        (["-T", "0"], 0.0),  # given, even 0: kept
        (["--temperature", "1"], DEFAULT_THRESHOLD),  # sampling: the divergence's default
    ],
)
def test_the_default_threshold_follows_the_setup(
    target_dir: Path, draft_dir: Path, capsys, flags: list[str], threshold: float
) -> None:
    args = ["generate", *pair_args(target_dir, draft_dir), "--json", "--max-new-tokens", "4", *flags, "Once"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    assert json.loads(out.splitlines()[-1])["settings"]["threshold"] == threshold


@pytest.mark.parametrize("mode", [[], ["--autoregressive"]])
def test_whole_step_flag_reaches_the_decoder_and_keeps_the_reply(
    target_dir: Path, draft_dir: Path, mode: list[str], capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--whole-step` builds the decoder's whole-step runner (eager on the CPU), and its greedy
    reply is the usual decoder's, token for token, with the same acceptances."""
    from fsd_chat.engines.torch_engine import step_graph

    made: list[step_graph.EagerSteps | None] = []
    make_steps = step_graph.make_steps

    def recording(*args: Any, **kwargs: Any) -> step_graph.EagerSteps | None:
        made.append(make_steps(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(step_graph, "make_steps", recording)
    args = ["generate", *pair_args(target_dir, draft_dir), *mode, "-T", "0", "--draft-policy", "fixed"]
    args += ["--temperature", "0", "--max-new-tokens", "40", "--json", "Once upon a time"]
    summaries = []
    for flag in ("--no-whole-step", "--whole-step"):
        code, out, err = run_cli([*args[:-1], flag, args[-1]], capsys)
        assert code == 0 and err == ""  # nothing captured on the CPU, nothing announced
        summaries.append(json.loads(out.splitlines()[-1]))
    assert len(made) == 1 and type(made[0]) is step_graph.EagerSteps  # the --whole-step run's only
    plain, whole = summaries
    assert whole["token_ids"] == plain["token_ids"] and len(whole["token_ids"]) == 40
    for stat in ("drafted", "accepted_exact", "steps"):
        assert whole["stats"][stat] == plain["stats"][stat]
    assert (whole["stats"]["drafted"] > 0) == (mode == [])
